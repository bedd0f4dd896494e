"""Structured output on the host (``actors.grammar``): matchers over the served
vocabulary, the validator's grammar checks, and admission's refusals (OPEN-22 as
decided in docs/design/requirements.md; QUEUE-13, SEL-13)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from test_completion_validator import good, order, outcome

from actors.admission import AdmissionLimits, check_request
from actors.completion_validator import check_frame
from actors.config import DEFAULT_MODEL_DIR
from actors.errors import InvalidRequest
from actors.grammar import GrammarError, GrammarVocabulary, grammar_problem, load_vocabulary
from actors.public import GenerationRequest, GrammarSpec
from gpu.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Tokenizer) -> GrammarVocabulary:
    return GrammarVocabulary(tokenizer.to_json(), vocab_size=tokenizer.vocab_size,
                             eos_token_ids=tokenizer.eos_token_ids)


def _allowed(mask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_masks_follow_the_grammar_and_allow_eos_only_where_it_may_end(
    tokenizer: Tokenizer, vocabulary: GrammarVocabulary,
) -> None:
    """A choice grammar: each mask allows exactly the tokens that keep a choice
    reachable; end-of-sequence only once the output is complete, which then reports
    ``complete``."""
    matcher = vocabulary.matcher(GrammarSpec("choice", '["yes", "no"]'))
    eos = set(tokenizer.eos_token_ids)
    first = _allowed(matcher.mask())
    assert first and not first & eos
    assert all("yes".startswith(t) or "no".startswith(t)
               for t in (tokenizer.decode([i]) for i in first))
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert not matcher.complete
        assert matcher.accept(token)
    assert matcher.complete
    assert _allowed(matcher.mask()) <= eos


def test_a_refused_token_puts_the_matcher_in_error(tokenizer: Tokenizer,
                                                   vocabulary: GrammarVocabulary) -> None:
    matcher = vocabulary.matcher(GrammarSpec("regex", "[0-9]+"))
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    assert letter not in _allowed(matcher.mask())
    assert not matcher.accept(letter)
    with pytest.raises(GrammarError):
        matcher.mask()


def test_validator_advances_the_grammar_fails_a_refused_token_and_ends_complete(
    tokenizer: Tokenizer, vocabulary: GrammarVocabulary,
) -> None:
    """The validator advances each constrained lane's matcher with its valid token: a
    token the grammar refuses fails that lane alone (the frame ran without its mask),
    and a token that completes the grammar terminates the request (``stop``)."""
    (one,) = tokenizer.encode("1", add_special_tokens=False)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    o = order()
    grammars = (vocabulary.matcher(GrammarSpec("choice", '["1"]')),
                vocabulary.matcher(GrammarSpec("regex", "[0-9]")))
    o = dataclasses.replace(o, lanes=tuple(
        dataclasses.replace(c, grammar=g) for c, g in zip(o.lanes, grammars, strict=True)))
    check = check_frame(o, outcome(o, (good(10, token=one), good(11, token=letter))),
                        vocab_size=tokenizer.vocab_size)
    assert [r.ok for r in check.records] == [True, False]
    assert check.records[0].terminated and grammars[0].complete
    assert "grammar" in check.failures[0].message


def test_admission_refuses_grammars_that_cannot_run(vocabulary: GrammarVocabulary) -> None:
    """A grammar that does not compile, a runtime without a vocabulary and a policy
    that speculates every decode (SEL-13) each refuse the request before it is queued."""
    request = GenerationRequest(prompt_token_ids=(5, 6), max_tokens=4,
                                grammar=GrammarSpec("json_schema", json.dumps({"type": 3})))
    good_request = dataclasses.replace(request, grammar=GrammarSpec("regex", "[a-z]+"))
    limits = AdmissionLimits(max_context=64, vocab_size=vocabulary.vocab_size, max_queue=4,
                             grammar=vocabulary)
    assert check_request(good_request, limits) is None
    assert isinstance(check_request(request, limits), InvalidRequest)
    assert grammar_problem(request.grammar) is not None
    for refusing in (dataclasses.replace(limits, grammar=None),
                     dataclasses.replace(limits, structured_output="speculates")):
        assert isinstance(check_request(good_request, refusing), InvalidRequest)


def test_lark_grammars_embed_json_schemas_and_gbnf_is_read(
    tokenizer: Tokenizer, vocabulary: GrammarVocabulary,
) -> None:
    """A ``grammar`` spec is llguidance's Lark: it may embed a JSON schema (``%json``),
    the shape a tool call takes; GBNF is read as well."""
    lark = ('start: "<call>" args "</call>"\n'
            'args: %json {"type": "object", "properties": {"n": {"type": "integer"}}, '
            '"required": ["n"], "additionalProperties": false}\n')
    matcher = vocabulary.matcher(GrammarSpec("grammar", lark))
    for token in tokenizer.encode('<call>{"n":42}</call>', add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.complete
    refused = vocabulary.matcher(GrammarSpec("grammar", lark))
    assert not all(refused.accept(t) for t in
                   tokenizer.encode('<call>{"m":1}</call>', add_special_tokens=False))
    assert grammar_problem(GrammarSpec("grammar", 'root ::= "a" | "b"')) is None


def test_a_frames_masks_computed_together_equal_each_matchers_own(
    tokenizer: Tokenizer, vocabulary: GrammarVocabulary,
) -> None:
    """``masks`` (one frame's constrained lanes, on llguidance's executor threads) gives
    each matcher exactly the mask it computes alone, in order."""
    specs = [GrammarSpec("json_object"), GrammarSpec("regex", "[0-9]{2,4}"),
             GrammarSpec("choice", '["alpha", "beta"]')]
    grammars = [vocabulary.matcher(spec) for spec in specs]
    grammars[0].accept(tokenizer.encode("{", add_special_tokens=False)[0])
    together = vocabulary.masks(grammars)
    assert together == [g.mask() for g in grammars]
    assert len(set(together)) == len(specs)


def test_a_tokenizer_llguidance_cannot_read_leaves_structured_output_off(
    tiny_llama: Path,
) -> None:
    """A checkpoint whose tokenizer llguidance cannot read (the tiny test Llama's word
    level one) still serves: there is no grammar vocabulary, with the reason, and
    admission then refuses constrained requests (``InvalidRequest``)."""
    tokenizer = Tokenizer.load(tiny_llama)
    vocabulary, reason = load_vocabulary(tokenizer.to_json(), vocab_size=tokenizer.vocab_size,
                                         eos_token_ids=tokenizer.eos_token_ids)
    assert vocabulary is None and "structured output is not available" in reason
