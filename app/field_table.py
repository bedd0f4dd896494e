"""Every request field each route knows, with its support status (pure: no I/O).

One table per route says, for each top-level field, whether it is

- ``SUPPORTED``: the parser reads and honours it;
- ``IGNORED``: accepted with no effect, as vLLM accepts it (the response names it in the
  ``X-Flare-Ignored-Fields`` header and a warning is logged);
- ``REFUSED``: a ``400`` naming the field, with the reason, unless it holds its neutral
  value (``neutral``: sending the value that changes nothing is always fine).

A field in no table is unknown: a ``400`` naming it (a misspelt ``temprature`` must
not be dropped silently). A ``null`` value counts as absent everywhere.

The parse is checked too: ``checked_parse`` runs the route's parser over a body that
records which fields it read, and a present ``SUPPORTED`` field the parser never read
is refused, so a row that claims support the code does not give fails loudly instead
of dropping the field. ``docs/api.md`` lists the same tables.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.errors import bad_request

T = TypeVar("T")
IGNORED_FIELDS_HEADER = "X-Flare-Ignored-Fields"


class Support(enum.Enum):
    SUPPORTED = "supported"
    IGNORED = "ignored"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldRule:
    support: Support
    reason: str = ""
    neutral: tuple[Any, ...] = ()
    """Values of a refused field that change nothing (accepted silently)."""


def _s() -> FieldRule:
    return FieldRule(support=Support.SUPPORTED)


def _ignored(reason: str) -> FieldRule:
    return FieldRule(support=Support.IGNORED, reason=reason)


def _refused(reason: str, *neutral: Any) -> FieldRule:
    return FieldRule(support=Support.REFUSED, reason=reason, neutral=neutral)


_SAMPLING = {name: _s() for name in (
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "stream_options", "ignore_eos", "user", "n", "best_of", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "stop_token_ids",
    "min_tokens", "logprobs", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs")}
_VLLM_COMMON = {
    "priority": _refused("priority scheduling is not offered; every request has "
                         "priority 0.", 0),
    "use_beam_search": _refused("beam search is not offered.", False),
    "length_penalty": _refused("it applies to beam search, which is not offered.", 1, 1.0),
    "include_stop_str_in_output": _refused("the stop string is never included in the "
                                           "output.", False),
    "allowed_token_ids": _refused("restricting the vocabulary is not offered."),
    "bad_words": _refused("bad words are not offered.", []),
    "prompt_logprobs": _refused("use echo with logprobs on /v1/completions for prompt "
                                "logprobs."),
    "truncate_prompt_tokens": _refused("prompts are never truncated; a prompt that does "
                                       "not fit is refused."),
    "guided_whitespace_pattern": _refused("a custom whitespace pattern is not offered."),
    "skip_special_tokens": _refused("special tokens are always skipped in the text.",
                                    True),
    "return_tokens_as_token_ids": _refused("tokens are returned as text.", False),
    "guided_decoding_backend": _ignored("the server picks the structured-output backend."),
    "spaces_between_special_tokens": _ignored("special tokens are skipped, so there is "
                                              "nothing to space."),
    "request_id": _ignored("send the X-Request-Id header instead."),
    "cache_salt": _ignored("the prefix cache is not partitioned."),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SAMPLING, **_VLLM_COMMON,
    "prompt": _s(), "echo": _s(),
    "suffix": _refused("insertion (suffix) is not offered.", ""),
    "add_special_tokens": _refused("the prompt is tokenized as sent.", True),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SAMPLING, **_VLLM_COMMON,
    "messages": _s(), "max_completion_tokens": _s(), "top_logprobs": _s(), "tools": _s(),
    "tool_choice": _s(), "parallel_tool_calls": _s(),
    "functions": _refused("the legacy functions API is not offered; send tools."),
    "function_call": _refused("the legacy functions API is not offered; send tool_choice."),
    "echo": _refused("echo is offered on /v1/completions.", False),
    "add_generation_prompt": _refused("the generation prompt is always added.", True),
    "continue_final_message": _refused("continuing the final message is not offered.",
                                       False),
    "add_special_tokens": _refused("the chat template decides special tokens.", False),
    "chat_template": _refused("the model's own chat template is used."),
    "chat_template_kwargs": _refused("the chat template takes no extra variables."),
    "documents": _refused("documents for the chat template are not offered."),
    "store": _ignored("nothing is stored."),
    "metadata": _ignored("nothing is stored, so metadata has no use."),
    "service_tier": _ignored("there is one service tier."),
}

TOKENIZE_FIELDS: dict[str, FieldRule] = {
    "model": _s(), "prompt": _s(), "messages": _s(), "add_generation_prompt": _s(),
    "tools": _s(), "tool_choice": _s(), "parallel_tool_calls": _s(),
    "add_special_tokens": _refused("the prompt is tokenized as sent.", True),
    "return_token_strs": _refused("token strings are not returned.", False),
}

DETOKENIZE_FIELDS: dict[str, FieldRule] = {"model": _s(), "tokens": _s()}


class ReadRecordingBody(dict[str, Any]):
    """A request body that records which fields were read (``get``, ``[]``, ``in``)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


def check_fields(body: dict[str, Any], table: dict[str, FieldRule]) -> tuple[str, ...]:
    """Refuse unknown fields and refused ones; return the ignored fields present."""
    ignored: list[str] = []
    for name, value in body.items():
        if value is None:
            continue
        rule = table.get(name)
        if rule is None:
            raise bad_request(f"Unknown field '{name[:80]}'; this route does not accept it "
                              "(see docs/api.md for every field).", param=name[:80])
        if rule.support is Support.REFUSED and not _is_neutral(value, rule.neutral):
            raise bad_request(f"'{name}' is not supported: {rule.reason}", param=name)
        if rule.support is Support.IGNORED:
            ignored.append(name)
    return tuple(ignored)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # ``True == 1`` in Python: a neutral number must not accept a boolean and vice versa.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool)
               for n in neutral)


def checked_parse(body: dict[str, Any], table: dict[str, FieldRule],
                  parse: Callable[[dict[str, Any]], T]) -> tuple[T, tuple[str, ...]]:
    """``parse(body)`` under the table's rules: (its result, the ignored fields)."""
    ignored = check_fields(body, table)
    recording = ReadRecordingBody(body)
    result = parse(recording)
    for name, value in body.items():
        rule = table.get(name)
        if (value is not None and rule is not None and rule.support is Support.SUPPORTED
                and name not in recording.read):
            raise bad_request(f"'{name}' is not supported by this server.", param=name)
    return result, ignored
