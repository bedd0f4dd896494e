"""Logit processing and ``stop_token_ids`` through the official ``openai`` client on the
real runtime and the embedded default model: each parameter changes the output the
way it should, streaming and not. Reference token ids come from the runtime itself
(the same request without the parameter)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from scheduler_client import OpenRuntime
from test_openai_real_runtime import served

from actors.public import GenerationRequest, Runtime, SamplingParams, TokenDelta

pytestmark = pytest.mark.slow
PROMPT = "import os\n\ndef main():\n"
NEW = 24


async def greedy_ids(runtime: Runtime, prompt: str, max_tokens: int) -> list[int]:
    request = GenerationRequest(prompt_token_ids=tuple(runtime.codec.encode(prompt)),
                                max_tokens=max_tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0))
    ids: list[int] = []
    async with runtime.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                ids.extend(event.token_ids)
    return ids


def distinct_share(runtime: Runtime, text: str) -> float:
    ids = runtime.codec.encode(text)
    return len(set(ids)) / max(len(ids), 1)


async def test_each_sampling_field_changes_the_output(real_open_runtime: OpenRuntime) -> None:
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            model, codec = runtime.model_name, runtime.codec
            plain = await greedy_ids(runtime, PROMPT, NEW)
            eos = codec.eos_token_ids[0]

            def complete(stream: bool = False, **fields: Any) -> tuple[str, str, int]:
                standard = {k: fields.pop(k) for k in ("logit_bias", "presence_penalty",
                                                       "frequency_penalty", "max_tokens",
                                                       "temperature", "seed") if k in fields}
                args = {"model": model, "prompt": PROMPT, "max_tokens": NEW,
                        "temperature": 0, **standard}
                if not stream:
                    out = client.completions.create(**args, extra_body=fields)
                    choice = out.choices[0]
                    return choice.text, str(choice.finish_reason), out.usage.completion_tokens
                with client.completions.create(**args, extra_body=fields, stream=True,
                                               stream_options={"include_usage": True}) as s:
                    chunks = list(s)
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                return text, str(finish), chunks[-1].usage.completion_tokens

            def chat(stream: bool = False, **fields: Any) -> tuple[str, str, int]:
                args = {"model": model, "max_tokens": 8, "messages": [
                    {"role": "user", "content": "def add(a, b):"}], **fields}
                if not stream:
                    out = client.chat.completions.create(**args)
                    choice = out.choices[0]
                    return (choice.message.content or "", str(choice.finish_reason),
                            out.usage.completion_tokens)
                with client.chat.completions.create(
                        **args, stream=True, stream_options={"include_usage": True}) as s:
                    chunks = list(s)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                return text, str(finish), chunks[-1].usage.completion_tokens

            # a token greedy decoding never picks here, forced while sampling
            forced = next(t for t in range(100, codec.vocab_size) if t not in plain)

            def run() -> dict[str, tuple[str, str, int]]:
                return {
                    "plain": complete(ignore_eos=True),
                    "forced": complete(logit_bias={str(forced): 100}, ignore_eos=True,
                                       temperature=1.0, seed=3),
                    "avoid": complete(logit_bias={str(plain[0]): -100}, max_tokens=1),
                    "frequency": complete(frequency_penalty=2.0, ignore_eos=True),
                    "presence": complete(presence_penalty=2.0, ignore_eos=True),
                    "repetition": complete(repetition_penalty=1.5, ignore_eos=True),
                    "stop_id": complete(stop_token_ids=[plain[2]]),
                    "stop_id_stream": complete(True, stop_token_ids=[plain[2]]),
                    "eos_forced": complete(logit_bias={str(eos): 100}),
                    "min_tokens": complete(logit_bias={str(eos): 100}, min_tokens=5),
                    "min_tokens_stream": complete(True, logit_bias={str(eos): 100},
                                                  min_tokens=5),
                    "min_p": complete(temperature=2.0, seed=11, min_p=1.0, ignore_eos=True),
                    "hot": complete(temperature=2.0, seed=11, ignore_eos=True),
                    "chat_forced": chat(logit_bias={str(forced): 100}, seed=2),
                    "chat_min_tokens_stream": chat(True, logit_bias={str(eos): 100},
                                                   extra_body={"min_tokens": 3}),
                }

            out = await trio.to_thread.run_sync(run)
            client.close()
    text, finish, _ = out["plain"]
    assert text == codec.decode(plain) and finish == "length"
    assert distinct_share(runtime, text) < 0.75  # greedy repeats itself on this prompt
    # logit_bias +100 forces a token even when sampling; -100 avoids the greedy one
    assert out["forced"][0] == codec.decode([forced] * NEW)
    assert out["avoid"][0] != codec.decode(plain[:1])
    # the penalties make the greedy output repeat less
    for name in ("frequency", "presence", "repetition"):
        assert out[name][0] != text, name
        assert distinct_share(runtime, out[name][0]) > distinct_share(runtime, text), name
    # a stop token id ends the output like EOS: finish "stop", the token is not in the text
    first = plain.index(plain[2])
    for name in ("stop_id", "stop_id_stream"):
        assert out[name] == (codec.decode(plain[:first]), "stop", first + 1), name
    # EOS biased to win ends at once; min_tokens holds it back for five tokens
    assert out["eos_forced"] == ("", "stop", 1)
    for name in ("min_tokens", "min_tokens_stream"):
        min_text, min_finish, tokens = out[name]
        assert (min_finish, tokens) == ("stop", 6), name
        assert min_text == out["min_tokens"][0]
    # chat: the same fields, streaming and not
    assert out["chat_forced"] == (codec.decode([forced] * 8), "length", 8)
    assert out["chat_min_tokens_stream"][1:] == ("stop", 4)
    # min_p 1 keeps only the most likely token: hot sampling becomes greedy
    assert out["min_p"][0] == text and out["hot"][0] != text
