"""Structured output on the host (``actors.grammar``): matchers over the served
vocabulary, the validator's grammar checks, and admission's refusals (OPEN-22 as
decided in docs/design/requirements.md; QUEUE-13, SEL-13)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_completion_validator import good, order, outcome

from actors.admission import AdmissionLimits, check_request
from actors.completion_validator import check_frame
from actors.config import DEFAULT_MODEL_DIR
from actors.errors import InvalidRequest
from actors.grammar import GrammarError, GrammarVocabulary, grammar_problem
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
