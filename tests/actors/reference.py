"""transformers references for the runtime's CPU tests (greedy continuations and
prompt log-probabilities of a tiny checkpoint)."""

from __future__ import annotations

from pathlib import Path


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int,
              dtype: str = "float32") -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS stop), run in ``dtype``."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    config = tf.GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                                 bos_token_id=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return [int(t) for t in out[0, len(prompt):].tolist()]


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def hf_log_softmax(model_dir: Path, tokens: list[int]) -> list[list[float]]:
    """transformers' log-softmax of the next-token logits at every place of ``tokens``
    (row ``i`` predicts ``tokens[i + 1]``)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return [[float(v) for v in row] for row in torch.log_softmax(logits.float(), dim=-1)]
