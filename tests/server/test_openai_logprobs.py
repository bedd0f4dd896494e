"""Logprobs through the official ``openai`` client on the real runtime and the embedded
default model, checked against transformers' log-softmax of the same checkpoint.

- lm-eval's ``local-completions`` loglikelihood request, reproduced exactly (token-id
  prompt = context + continuation, ``echo``, ``max_tokens: 1``, ``logprobs: 1``,
  ``temperature: 0``, ``seed: 1234``) and read as lm-eval reads it
  (``token_logprobs[ctxlen:-1]``, ``is_greedy`` from ``top_logprobs``); the same with
  ``max_tokens: 0``, the scoring-only form, which generates nothing;
- completions ``logprobs: k`` and chat ``logprobs`` + ``top_logprobs: k``, streaming and
  not: k alternatives best first, the greedy token first, values equal to
  transformers' to 1e-4; ``logprobs: 0`` gives the sampled logprob only.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx
import openai
import pytest
import trio
from scheduler_client import OpenRuntime
from test_openai_real_runtime import served

from actors.config import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
REPEAT_TOLERANCE = 1e-5
"""Between repeats of one request: a repeat finds its prompt in the prefix cache and
feeds the last prompt token to a decode step (``RuntimeConfig.decode_prompt_tail``),
whose float32 reductions differ from the prefill's in the last few bits."""
CONTEXT = "def add(a, b):\n    return"
CONTINUATION = " a + b\n"
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


@functools.cache
def reference_model() -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype="float32").eval()


def reference_log_softmax(tokens: list[int]) -> Any:
    """transformers' log-softmax at every place of ``tokens`` (row i predicts i + 1)."""
    import torch

    model = reference_model()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def lm_eval_parse(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs`` for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs,
                                                                  strict=True))
    return sum(token_logprobs), is_greedy


def assert_best_first(values: list[float], k: int) -> None:
    assert len(values) == k and values == sorted(values, reverse=True)


async def test_lm_eval_scoring_request_equals_transformers(
        real_open_runtime: OpenRuntime) -> None:
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            codec = runtime.codec
            context = codec.encode(CONTEXT)
            tokens = codec.encode(CONTEXT + CONTINUATION)
            assert tokens[:len(context)] == context
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                # exactly lm-eval's payload (``_create_payload(generate=False)``)
                lm_eval = (await http.post("/v1/completions", json={
                    "model": runtime.model_name, "prompt": tokens, "temperature": 0,
                    "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})).json()
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            scoring = await trio.to_thread.run_sync(lambda: client.completions.create(
                model=runtime.model_name, prompt=tokens, echo=True, max_tokens=0, logprobs=1,
                temperature=0))
            client.close()
    reference = reference_log_softmax(tokens)
    expected = [float(reference[i - 1, tokens[i]]) for i in range(1, len(tokens))]
    greedy = [int(reference[i - 1].argmax()) for i in range(1, len(tokens))]

    choice = lm_eval["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(tokens) + 1  # the prompt and one token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(tokens)] == pytest.approx(expected, abs=TOLERANCE)
    loglikelihood, is_greedy = lm_eval_parse(choice, len(context))
    assert loglikelihood == pytest.approx(sum(expected[len(context) - 1:]), abs=TOLERANCE)
    assert is_greedy == (greedy[len(context) - 1:] == tokens[len(context):])
    for i in range(1, len(tokens)):
        top = logprobs["top_logprobs"][i]
        best = codec.decode([greedy[i - 1]])
        assert next(iter(top)) == best  # the top-1 alternative is transformers' argmax
        assert top[best] == pytest.approx(float(reference[i - 1].max()), abs=TOLERANCE)
        assert len(top) == (1 if greedy[i - 1] == tokens[i] else 2)  # k, plus the token

    only = scoring.choices[0]
    assert only.logprobs is not None and only.finish_reason == "length"
    assert scoring.usage is not None and scoring.usage.completion_tokens == 0
    assert only.text == codec.decode(tokens)  # the echoed prompt, nothing generated
    assert len(only.logprobs.token_logprobs) == len(tokens)
    assert only.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=TOLERANCE)
    assert only.logprobs.top_logprobs is not None
    assert [next(iter(t)) for t in only.logprobs.top_logprobs[1:]] == [
        codec.decode([g]) for g in greedy]


async def test_top_alternatives_streaming_and_not_equal_transformers(
        real_open_runtime: OpenRuntime) -> None:
    k = 5
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            codec, model = runtime.codec, runtime.model_name
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                chat_prompt = (await http.post("/tokenize", json={
                    "messages": MESSAGES})).json()["tokens"]

            def run() -> tuple[Any, ...]:
                args = dict(model=model, prompt=CONTEXT, max_tokens=8, temperature=0,
                            extra_body={"ignore_eos": True})
                whole = client.completions.create(**args, logprobs=k)  # type: ignore[call-overload]
                with client.completions.create(**args, logprobs=k,  # type: ignore[call-overload]
                                               stream=True) as stream:
                    chunks = list(stream)
                sampled_only = client.completions.create(**args, logprobs=0)  # type: ignore[call-overload]
                chat_args = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                 logprobs=True, top_logprobs=k)
                chat = client.chat.completions.create(**chat_args)  # type: ignore[call-overload]
                with client.chat.completions.create(**chat_args,  # type: ignore[call-overload]
                                                    stream=True) as stream:
                    chat_chunks = list(stream)
                return whole, chunks, sampled_only, chat, chat_chunks

            whole, chunks, sampled_only, chat, chat_chunks = await trio.to_thread.run_sync(run)
            client.close()

    # completions: logprobs k
    lp = whole.choices[0].logprobs
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.tokens]
    streamed_top = [t for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.top_logprobs]
    assert streamed_tokens == lp.tokens and len(lp.tokens) == 8
    assert [list(t) for t in streamed_top] == [list(t) for t in lp.top_logprobs]
    for streamed_dict, whole_dict in zip(streamed_top, lp.top_logprobs, strict=True):
        assert streamed_dict == pytest.approx(whole_dict, abs=REPEAT_TOLERANCE)
    prompt = codec.encode(CONTEXT)
    reference = reference_log_softmax(prompt + greedy_ids(codec, prompt, reference_log_softmax))
    for i, (text, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                 strict=True)):
        row = reference[len(prompt) - 1 + i]
        values, ids = row.topk(k)
        assert list(top) == [codec.decode([int(t)]) for t in ids]  # best first, k of them
        assert_best_first(list(top.values()), k)
        assert list(top.values()) == pytest.approx(values.tolist(), abs=TOLERANCE)
        assert next(iter(top)) == text and top[text] == logprob  # greedy: the token is first
    assert sampled_only.choices[0].logprobs.top_logprobs is None
    assert sampled_only.choices[0].logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs, abs=REPEAT_TOLERANCE)

    # chat: logprobs + top_logprobs k
    content = chat.choices[0].logprobs.content
    streamed = [e for c in chat_chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                           abs=REPEAT_TOLERANCE)
    chat_reference = reference_log_softmax(
        chat_prompt + greedy_ids(codec, chat_prompt, reference_log_softmax, len(content)))
    for i, entry in enumerate(content):
        row = chat_reference[len(chat_prompt) - 1 + i]
        values, ids = row.topk(k)
        assert [t.token for t in entry.top_logprobs] == [codec.decode([int(t)]) for t in ids]
        assert_best_first([t.logprob for t in entry.top_logprobs], k)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(),
                                                                        abs=TOLERANCE)
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.token for t in streamed[i].top_logprobs] == [t.token for t in entry.top_logprobs]


def greedy_ids(codec: Any, prompt: list[int], log_softmax: Any, count: int = 8) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``count`` tokens."""
    out: list[int] = []
    for _ in range(count):
        out.append(int(log_softmax(prompt + out)[-1].argmax()))
    return out
