"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, through the HTTP app."""

from __future__ import annotations

from typing import Any

import httpx
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from app import AppSettings
from app.chat_template import ChatTemplate
from app.request_parsing import ChatMessage


async def _post(codec: TinyCodec, path: str, body: Any, *, settings: AppSettings | None = None,
                headers: dict[str, str] | None = None) -> httpx.Response:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec), settings) as server, \
                client_for(server) as client:
            if isinstance(body, bytes):
                return await client.post(path, content=body, headers={
                    "Content-Type": "application/json", **(headers or {})})
            return await client.post(path, json=body, headers=headers)


async def test_tokenize_prompt_returns_count_tokens_and_context(codec: TinyCodec) -> None:
    response = await _post(codec, "/tokenize", {"model": "flare-test", "prompt": "Hello world"})
    assert response.status_code == 200
    tokens = codec.encode("Hello world")
    assert response.json() == {"count": len(tokens), "max_model_len": 256,
                               "tokens": list(tokens)}


async def test_tokenize_messages_uses_the_chat_template(codec: TinyCodec) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    template = ChatTemplate(codec.chat_template, codec.special_tokens)
    parsed = [ChatMessage(role="user", content="hi there")]
    for add, expected_text in (
            (True, template.render(parsed, add_generation_prompt=True)),
            (False, template.render(parsed, add_generation_prompt=False))):
        response = await _post(codec, "/tokenize",
                               {"messages": messages, "add_generation_prompt": add})
        assert response.status_code == 200
        assert codec.decode(response.json()["tokens"]) == codec.decode(
            codec.encode(expected_text))
    default = await _post(codec, "/tokenize", {"messages": messages})
    with_prompt = await _post(codec, "/tokenize",
                              {"messages": messages, "add_generation_prompt": True})
    assert default.json() == with_prompt.json()


async def test_detokenize_round_trips_tokenize(codec: TinyCodec) -> None:
    tokens = codec.encode("Hello world, again")
    response = await _post(codec, "/detokenize", {"tokens": list(tokens)})
    assert response.status_code == 200
    assert response.json() == {"prompt": codec.decode(tokens)}


async def test_bad_bodies_are_400_naming_the_field(codec: TinyCodec) -> None:
    cases = [
        ("/detokenize", {"tokens": [1, codec.vocab_size]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
         "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "add_generation_prompt": "yes"}, "add_generation_prompt"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ]
    for path, body, param in cases:
        response = await _post(codec, path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body)


async def test_unknown_model_is_404(codec: TinyCodec) -> None:
    for path, body in (("/tokenize", {"model": "other", "prompt": "a"}),
                       ("/detokenize", {"model": "other", "tokens": [1]})):
        response = await _post(codec, path, body)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"


async def test_api_key_and_content_type_apply(codec: TinyCodec) -> None:
    settings = AppSettings(api_key="sekrit")
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        missing = await _post(codec, path, body, settings=settings)
        assert missing.status_code == 401
        allowed = await _post(codec, path, body, settings=settings,
                              headers={"Authorization": "Bearer sekrit"})
        assert allowed.status_code == 200
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            response = await client.post("/tokenize", content=b'{"prompt": "a"}',
                                         headers={"Content-Type": "text/plain"})
    assert response.status_code == 415


async def test_text_past_the_context_is_refused_before_encoding(codec: TinyCodec) -> None:
    limit = 256 * (codec.max_chars_per_token or 0)
    response = await _post(codec, "/tokenize", {"prompt": "a" * (limit + 1)})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert response.json()["error"]["param"] == "prompt"


async def test_large_body_is_prepared_off_the_loop(codec: TinyCodec) -> None:
    """Bodies over the offload size go through the same bounded preparation (a JSON-value
    bound applies): a huge token list is refused, a large one is answered."""
    tokens = codec.encode("Hello world")
    many = list(tokens) * (70_000 // (3 * len(tokens)))
    response = await _post(codec, "/detokenize", {"tokens": many})
    assert response.status_code == 200
    assert response.json()["prompt"] == codec.decode(many)
