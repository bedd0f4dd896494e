"""Work before admission is bounded: a prompt or rendered chat longer than the context can
hold is refused before it is encoded, and one client may have only a few large bodies
being prepared at once (429 beyond, with ``Retry-After``)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from app.body_checks import json_units
from app.service import OFFLOAD_BYTES, PREPARING_PER_CLIENT

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class CountingCodec(TinyCodec):
    """Counts ``encode`` calls and the characters they were given."""

    calls: list[int] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        self.calls.append(len(text))
        return super().encode(text)


def _counting(codec: TinyCodec) -> CountingCodec:
    return CountingCodec(codec.tokenizer)


async def test_an_oversize_prompt_is_refused_before_encoding(codec: TinyCodec) -> None:
    counting = _counting(codec)
    rt = FakeRuntime(counting, max_context=256)
    bound = counting.max_chars_per_token
    assert bound is not None
    limit = 256 * bound
    repro = json.dumps({"prompt": "word " * 780_000, "max_tokens": 1}).encode()
    with trio.fail_after(30):
        async with running_server(rt) as server, client_for(server) as client:
            just_over = await client.post(COMPLETIONS, json={"prompt": "x" * (limit + 1)})
            large = await client.post(COMPLETIONS, content=repro,
                                      headers={"Content-Type": "application/json"})
            at_limit = await client.post(COMPLETIONS, json={"prompt": "x" * limit})
    for response in (just_over, large):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
        assert str(limit) in error["message"]
    # only the text at the bound was encoded (and then refused on its token count)
    assert counting.calls == [limit]
    assert at_limit.status_code == 400
    assert at_limit.json()["error"]["code"] == "context_length_exceeded"
    assert rt.requests == []


async def test_an_oversize_chat_is_refused_before_encoding(codec: TinyCodec) -> None:
    counting = _counting(codec)
    rt = FakeRuntime(counting, max_context=256)
    many = [{"role": "user", "content": "hello there " * 4} for _ in range(2048)]
    with trio.fail_after(60):
        async with running_server(rt) as server, client_for(server) as client:
            long_one = await client.post(CHAT, json={
                "messages": [{"role": "user", "content": "word " * 50_000}]})
            many_messages = await client.post(CHAT, json={"messages": many})
            fine = await client.post(CHAT, json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    for response in (long_one, many_messages):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert fine.status_code == 200
    # the two refusals encoded nothing; the small chat encoded its segments
    assert counting.calls and sum(counting.calls) < 200


@dataclass
class BlockingCodec(TinyCodec):
    """``encode`` (run in a worker thread for large bodies) reports that it started and
    then waits until the test opens the gate."""

    started: trio.MemorySendChannel[int] | None = None
    gate: threading.Event = field(default_factory=threading.Event)

    def encode(self, text: str) -> list[int]:
        if len(text) >= OFFLOAD_BYTES and not self.gate.is_set():
            assert self.started is not None
            trio.from_thread.run_sync(self.started.send_nowait, len(text))
            assert self.gate.wait(30)
        return super().encode(text)


async def test_one_client_may_prepare_only_a_few_large_bodies_at_once(
        codec: TinyCodec) -> None:
    started_send, started_receive = trio.open_memory_channel[int](10)
    blocking = BlockingCodec(codec.tokenizer, started=started_send)
    rt = FakeRuntime(blocking, max_context=1_000_000)
    text = "The quick brown fox jumps over the lazy dog. " * (2 * OFFLOAD_BYTES // 45)
    body = {"prompt": text, "max_tokens": 1}
    statuses: list[int] = []
    with trio.fail_after(60):
        async with running_server(rt) as server, client_for(server) as client:

            async def send() -> None:
                statuses.append((await client.post(COMPLETIONS, json=body)).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(PREPARING_PER_CLIENT):
                    nursery.start_soon(send)
                for _ in range(PREPARING_PER_CLIENT):
                    await started_receive.receive()
                refused = await client.post(COMPLETIONS, json=body)
                small = await client.post(COMPLETIONS, json={"prompt": "hello",
                                                             "max_tokens": 1})
                blocking.gate.set()
            again = await client.post(COMPLETIONS, json=body)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert small.status_code == 200  # small bodies are not counted
    assert statuses == [200] * PREPARING_PER_CLIENT
    assert again.status_code == 200  # the slots were given back


def test_json_units_counts_values_outside_strings() -> None:
    body = json.dumps({"prompt": [1, 2, 3], "s": 'a, b: [c] \\" ,', "n": {"x": []}}).encode()
    # strings: "prompt" "s" its value "n" "x"; outside them: 2 ',' in the list, 2 between
    # fields, 4 ':', 2 '['
    assert json_units(body, limit=5) == 5 + 2 + 2 + 4 + 2
    assert json_units(body, limit=4) == 5  # more strings than the limit: counted no further
    assert json_units(body, limit=10_000) >= 15  # under the limit: the quick over-count


async def test_a_body_of_too_many_json_values_is_refused_before_parsing(
        codec: TinyCodec) -> None:
    counting = _counting(codec)
    rt = FakeRuntime(counting, max_context=256)
    ids = json.dumps({"prompt": [1] * 1_000_000, "max_tokens": 1}).encode()
    prose = "a, b: [c] " * (2 * OFFLOAD_BYTES // 10)  # many separators inside a string
    rt_prose = FakeRuntime(counting, max_context=1_000_000)
    with trio.fail_after(30):
        async with running_server(rt) as server, client_for(server) as client:
            refused = await client.post(COMPLETIONS, content=ids,
                                        headers={"Content-Type": "application/json"})
        async with running_server(rt_prose) as server, client_for(server) as client:
            served = await client.post(COMPLETIONS, json={"prompt": prose, "max_tokens": 1})
    assert refused.status_code == 400
    assert "JSON values" in refused.json()["error"]["message"]
    assert served.status_code == 200
