"""``n`` choices, batched prompts, ``continuous_usage_stats`` and the field table,
through the official ``openai`` client against the in-process server (fake runtime).

The sync client runs in a worker thread (see ``test_http_openai_client.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import openai
import pytest
import structlog
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import SseReader, client_for, raw_post, receive_until, running_server
from test_http_openai_client import in_thread, make_client

from app.choices import SEED_SPACE, sibling_seed
from app.errors import ApiError
from app.field_table import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS_HEADER,
    Support,
    checked_parse,
)

REPLY = "Hello world, this is a tiny reply."
MODEL = "flare-test"
T = TypeVar("T")


async def served_call(rt: FakeRuntime, call: Callable[[openai.OpenAI], T]) -> T:
    """``call(client)`` in a worker thread against a server on ``rt``."""
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            try:
                return await in_thread(functools.partial(call, client))
            finally:
                client.close()


async def test_n_three_non_streaming_choices_seeds_and_usage(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    result = await served_call(rt, lambda client: client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=5, n=3, best_of=3, seed=41,
        temperature=0.8))
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.finish_reason for c in result.choices] == ["length"] * 3
    prompt_tokens = len(codec.encode("The quick brown fox"))
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 15)
    # three runtime requests: seeds s, s+1, s+2, one prefill group, distinct ids
    assert [r.sampling.seed for r in rt.requests] == [41, 42, 43]
    groups = {r.prefill_group for r in rt.requests}
    assert len(groups) == 1 and groups != {""}
    assert sorted(r.request_id for r in rt.requests) == [f"{result.id}-{i}" for i in range(3)]


async def test_n_without_a_seed_leaves_each_sibling_its_own_draw(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    result = await served_call(rt, lambda client: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2))
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.message.content == codec.decode(codec.encode(REPLY)[:4])
               for c in result.choices)
    assert [r.sampling.seed for r in rt.requests] == [None, None]
    assert result.usage is not None and result.usage.completion_tokens == 8


def test_sibling_seeds_wrap_within_the_seed_space() -> None:
    assert sibling_seed(7, 0) == 7 and sibling_seed(7, 2) == 9
    assert sibling_seed(SEED_SPACE - 1, 1) == 0
    assert sibling_seed(None, 3) is None


async def test_n_three_streaming_interleaves_indices_and_finishes_each(
        codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)

    def run(client: openai.OpenAI) -> list[Any]:
        with client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=100, n=3, stream=True,
                stream_options={"include_usage": True}) as stream:
            return list(stream)

    chunks = await served_call(rt, run)
    texts = {i: "".join(c.choices[0].text for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(3)}
    assert texts == {0: REPLY, 1: REPLY, 2: REPLY}
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "stop"), (2, "stop")]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 3 * len(codec.encode(REPLY))
    assert usage.prompt_tokens == len(codec.encode("Hello"))


async def test_chat_streaming_n_two_sends_one_done(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply="one two")
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                events = await SseReader(response).rest()
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]] += choice["delta"].get("content", "")
    assert by_index == {0: "one two", 1: "one two"}
    assert sorted(c["choices"][0]["index"] for c in chunks
                  if c["choices"][0]["finish_reason"] == "stop") == [0, 1]


async def test_batched_prompts_index_prompt_times_n_plus_i(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    prompts = ["alpha beta", "gamma"]
    ids = [codec.encode("delta"), codec.encode("epsilon zeta")]

    def run(client: openai.OpenAI) -> tuple[Any, Any]:
        return (client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2,
                                          echo=True),
                client.completions.create(model=MODEL, prompt=ids, max_tokens=1))

    result, by_ids = await served_call(rt, run)
    reply = codec.decode(codec.encode(REPLY)[:2])
    assert [(c.index, c.text) for c in result.choices] == [
        (0, prompts[0] + reply), (1, prompts[0] + reply),
        (2, prompts[1] + reply), (3, prompts[1] + reply)]
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(len(codec.encode(p)) for p in prompts)
    assert result.usage.completion_tokens == 8
    # every prompt's first choice is submitted before the other siblings
    first, second = (tuple(codec.encode(p)) for p in prompts)
    assert [r.prompt_token_ids for r in rt.requests[:4]] == [first, second, first, second]
    assert [r.request_id.rsplit("-", 1)[1] for r in rt.requests[:4]] == ["0", "2", "1", "3"]
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [r.prompt_token_ids for r in rt.requests[4:]] == [tuple(i) for i in ids]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == sum(map(len, ids))
    # a batch of single choices shares no prefill: nothing to wait for
    assert {r.prefill_group for r in rt.requests[4:]} == {""}


async def test_continuous_usage_stats_in_every_chunk(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply="one two three")

    def run(client: openai.OpenAI) -> tuple[list[Any], list[Any]]:
        options = {"include_usage": True, "continuous_usage_stats": True}
        with client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, n=2,
                                       stream=True, stream_options=options) as s:
            completion = list(s)
        with client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                stream=True, stream_options=options) as s:
            chat = list(s)
        return completion, chat

    completion, chat = await served_call(rt, run)
    reply_tokens = len(codec.encode("one two three"))
    for chunks, choices in ((completion, 2), (chat, 1)):
        assert all(c.usage is not None for c in chunks)
        so_far = {i: [c.usage.completion_tokens for c in chunks
                      if c.choices and c.choices[0].index == i] for i in range(choices)}
        for counts in so_far.values():
            assert counts == sorted(counts) and counts[-1] == reply_tokens
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == choices * reply_tokens
    assert chat[0].usage.completion_tokens == 0  # the role chunk: nothing generated yet


async def test_unknown_refused_and_ignored_fields(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)

    def run(client: openai.OpenAI) -> tuple[Any, ...]:
        errors = []
        for extra in ({"temprature": 0.3}, {"priority": 2},
                      {"guided_whitespace_pattern": " "}):
            try:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                          extra_body=extra)
            except openai.BadRequestError as exc:
                errors.append(exc.body)
        neutral = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                            extra_body={"priority": 0})
        ignored = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"cache_salt": "a", "store": True})
        return errors, neutral, ignored

    with structlog.testing.capture_logs() as logs:
        errors, neutral, ignored = await served_call(rt, run)
    assert [e["param"] for e in errors] == ["temprature", "priority",
                                             "guided_whitespace_pattern"]
    assert "priority scheduling" in errors[1]["message"]
    assert neutral.choices[0].finish_reason == "length"
    assert ignored.headers[IGNORED_FIELDS_HEADER] == "cache_salt,store"
    assert ignored.parse().choices[0].message.content
    warnings = [e for e in logs if e["event"] == "request.ignored_fields"]
    assert [w["fields"] for w in warnings] == [["cache_salt", "store"]]


def test_a_supported_field_the_parser_does_not_read_is_refused() -> None:
    """A row that claims support the parser does not give (here ``guided_json``, read
    by no stub) is a 400 naming the field, never a silent drop."""
    assert COMPLETION_FIELDS["guided_json"].support is Support.SUPPORTED

    def parser_without_guided_json(body: dict[str, Any]) -> str:
        return str(body.get("prompt"))

    body = {"prompt": "x", "guided_json": {"type": "object"}, "store": None}
    with pytest.raises(ApiError) as refused:
        checked_parse(body, COMPLETION_FIELDS, parser_without_guided_json)
    assert refused.value.param == "guided_json"

    def parser_reading_it(body: dict[str, Any]) -> str:
        return str(body.get("prompt")) + str(body.get("guided_json"))

    result, ignored = checked_parse({**body, "metadata": None}, COMPLETION_FIELDS,
                                    parser_reading_it)
    assert result.startswith("x") and ignored == ()


def test_refused_fields_accept_only_their_neutral_value() -> None:
    def read_nothing(body: dict[str, Any]) -> None:
        return None

    checked_parse({"use_beam_search": False}, CHAT_FIELDS, read_nothing)
    for value in (True, 0):  # 0 is not the neutral False
        with pytest.raises(ApiError):
            checked_parse({"use_beam_search": value}, CHAT_FIELDS, read_nothing)


async def test_a_client_that_leaves_cancels_every_sibling(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, gated=True)
    body = {"prompt": "Hello", "max_tokens": 20, "stream": True, "n": 3}
    with trio.fail_after(20):
        async with running_server(rt) as server:
            sock = await raw_post(server, "/v1/completions", body)
            rt.release(1)
            await receive_until(sock, b"data: ")
            await rt.wait_until(lambda: rt.active == 3)
            await sock.aclose()  # the client leaves mid-stream
            await rt.wait_until(lambda: len(rt.cancelled) == 3)
    assert rt.finished == [] and rt.active == 0


async def test_a_failing_choice_fails_the_request_and_ends_its_siblings(
        codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY, fail_after=2)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            whole = await client.post("/v1/completions",
                                      json={"prompt": "Hi", "max_tokens": 9, "n": 2})
            body = {"prompt": "Hi", "max_tokens": 9, "n": 2, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = await SseReader(response).rest()
    assert whole.status_code == 500
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert rt.active == 0
