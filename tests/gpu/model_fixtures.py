"""Shared pieces of the gpu model/program tests: tiny random HF checkpoints, the
transformers reference, the test catalog and engine construction.

Checkpoints use a large ``initializer_range`` so logits are peaked and greedy
continuations are free of near-ties; each has a small word-level ``tokenizer.json``
and a ``tokenizer_config.json`` with a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpu.engine import ModelEngine
from policy.descriptors import GraphKind, GraphShape, StateOp

PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
PREFILL_128 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=128)
SCORED_64 = GraphShape(kind=GraphKind.SCORED_PREFILL, batch_capacity=1, token_capacity=64)
DECODE = {b: GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1)
          for b in (1, 2, 4, 8)}
MIXED_2 = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
                     prefill_capacity=64, packed_capacity=65)
MIXED_4 = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=1,
                     prefill_capacity=64, packed_capacity=67)
SNAPSHOT = GraphShape(kind=GraphKind.STATE, batch_capacity=2, token_capacity=0,
                      state_op=StateOp.SNAPSHOT)
RESTORE = GraphShape(kind=GraphKind.STATE, batch_capacity=2, token_capacity=0,
                     state_op=StateOp.RESTORE)
PAGE_COPY = GraphShape(kind=GraphKind.STATE, batch_capacity=4, token_capacity=0,
                       state_op=StateOp.PAGE_COPY)
INITIALIZE = GraphShape(kind=GraphKind.STATE, batch_capacity=4, token_capacity=0,
                        state_op=StateOp.INITIALIZE)

CATALOG = (PREFILL_64, PREFILL_128, SCORED_64, *DECODE.values(), MIXED_2, MIXED_4,
           SNAPSHOT, RESTORE, PAGE_COPY, INITIALIZE)

PAGE_SIZE = 16


def build_engine(model_dir: Path, *, state_rows: int = 8, num_pages: int = 64) -> ModelEngine:
    return ModelEngine.load(
        model_dir, device="cpu", dtype=None, catalog=CATALOG, page_size=PAGE_SIZE,
        num_pages=num_pages, state_rows=state_rows,
    )


def prompt_of(length: int, seed: int, vocab: int = 96) -> list[int]:
    """A deterministic prompt of token ids 3..vocab-1."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=length)]


VOCAB = 96
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
    }))


def _common(**extra: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=1, eos_token_id=EOS_ID, rope_theta=10000.0,
    )
    base.update(extra)
    return base


def build_checkpoint(kind: str, directory: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3, "llama_untied": 4}[kind])
    if kind == "llama":
        config = tf.LlamaConfig(**_common(tie_word_embeddings=True))
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama_untied":
        config = tf.LlamaConfig(**_common(tie_word_embeddings=False, num_key_value_heads=4))
        model = tf.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = tf.Qwen2Config(**_common(tie_word_embeddings=False))
        model = tf.Qwen2ForCausalLM(config)
    else:
        config = tf.Qwen3Config(**_common(tie_word_embeddings=True, head_dim=16))
        model = tf.Qwen3ForCausalLM(config)
    model.eval()
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


MODEL_KINDS = ("llama", "qwen2", "qwen3", "llama_untied")


class HFReference:
    """transformers as the peer: greedy ``generate`` and full-prompt log-probabilities."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        self._dirs = checkpoints
        self._models: dict[str, object] = {}

    def model(self, kind: str):  # type: ignore[no-untyped-def]
        import transformers as tf

        if kind not in self._models:
            self._models[kind] = tf.AutoModelForCausalLM.from_pretrained(
                self._dirs[kind], dtype="float32"
            ).eval()
            # generate() must not stop at the checkpoint's EOS: we compare fixed lengths.
            self._models[kind].generation_config.eos_token_id = None  # type: ignore[attr-defined]
        return self._models[kind]

    def greedy(self, kind: str, prompt: list[int], new_tokens: int) -> list[int]:
        import torch
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0,
            eos_token_id=None, pad_token_id=0, bos_token_id=None,
        )
        with torch.no_grad():
            out = self.model(kind).generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]), generation_config=config
            )
        tokens = out[0, len(prompt):].tolist()
        assert len(tokens) == new_tokens, "reference stopped early"
        return tokens

    def log_probs(self, kind: str, prompt: list[int]):  # type: ignore[no-untyped-def]
        import torch

        with torch.no_grad():
            logits = self.model(kind)(torch.tensor([prompt])).logits[0]  # type: ignore[operator]
        return torch.log_softmax(logits.float(), dim=-1)


def build_draft_pair(root: Path) -> tuple[Path, Path]:
    """A tiny target (``build_checkpoint("llama")``) and a smaller random draft with
    the same vocabulary, for the speculative program tests."""
    import torch
    import transformers as tf

    target = build_checkpoint("llama", root / "target")
    torch.manual_seed(11)
    draft_dir = root / "draft"
    config = tf.LlamaConfig(**_common(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      tie_word_embeddings=True))
    assert config.vocab_size == VOCAB
    tf.LlamaForCausalLM(config).eval().save_pretrained(draft_dir)
    return target, draft_dir
