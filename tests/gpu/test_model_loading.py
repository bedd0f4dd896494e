"""Loading HF-format checkpoints: config, weights (single and sharded), tokenizer,
refusals with a message naming what is supported, and prefill logits against
transformers.

Stated tolerance: every prompt token's log-probability (scored prefill) and every
next-token logit agree with transformers' float32 forward within 1e-4 absolute.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_fixtures import EOS_ID, MODEL_KINDS, SCORED_64, HFReference, build_engine, prompt_of

from gpu.engine import ModelEngine
from gpu.frames import (
    TOP_LOGPROBS,
    PageAppend,
    PrefillFrame,
    RowInit,
    StepResult,
    as_inputs,
    result_of,
)
from gpu.model.config import (
    ModelLoadError,
    UnsupportedModelError,
    load_model_config,
    parse_model_config,
)
from gpu.model.tokenizer import Tokenizer

LOGPROB_TOLERANCE = 1e-4


def test_config_reads_each_architecture(tiny_checkpoints: dict[str, Path]) -> None:
    llama = load_model_config(tiny_checkpoints["llama"])
    qwen2 = load_model_config(tiny_checkpoints["qwen2"])
    qwen3 = load_model_config(tiny_checkpoints["qwen3"])
    untied = load_model_config(tiny_checkpoints["llama_untied"])
    assert (llama.architecture, llama.tie_word_embeddings, llama.num_kv_heads) == (
        "LlamaForCausalLM", True, 2)
    assert qwen2.attention_bias and not qwen2.qk_norm and not qwen2.tie_word_embeddings
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.attention_bias
    assert not untied.tie_word_embeddings and untied.num_kv_heads == untied.num_heads
    assert llama.eos_token_ids == (EOS_ID,) and llama.rope_theta == 10000.0


def _raw(**extra: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 10,
    }
    raw.update(extra)
    return raw


@pytest.mark.parametrize("archs", [["Gemma3ForCausalLM"], ["GPT2LMHeadModel"], [], None])
def test_unsupported_architecture_is_refused_naming_the_supported(archs: object) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        parse_model_config(_raw(architectures=archs))
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM"):
        assert name in str(info.value)


def test_unknown_rope_options_and_other_activations_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"rope scaling 'mrope'.*llama3, yarn"):
        parse_model_config(_raw(rope_scaling={"rope_type": "mrope", "factor": 8.0}))
    with pytest.raises(UnsupportedModelError, match="'llama3' needs a numeric 'low_freq_factor'"):
        parse_model_config(_raw(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        parse_model_config(_raw(rope_parameters={"rope_type": "default",
                                                 "partial_rotary_factor": 0.5}))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu'"):
        parse_model_config(_raw(hidden_act="relu"))
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        parse_model_config(_raw(attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        parse_model_config(_raw(mlp_bias=True))
    plain = parse_model_config(_raw(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert plain.rope_theta == 5e5


def test_rope_scaling_is_read_from_either_layout() -> None:
    """The older flat layout (``rope_theta`` + ``rope_scaling`` with ``type``) and the
    current ``rope_parameters`` one describe the same variant."""
    old = parse_model_config(_raw(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2}))
    new = parse_model_config(_raw(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                   "rope_theta": 5e5}))
    assert old.rope == new.rope and new.rope.rope_type == "linear" and new.rope_theta == 5e5
    longrope = parse_model_config(_raw(max_position_embeddings=4096, rope_scaling={
        "type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 1024}))
    assert longrope.rope.rope_type == "longrope" and longrope.max_context == 1024


def test_sliding_windows_per_family() -> None:
    """Mistral windows every layer; Qwen2 only with use_sliding_window, from
    max_window_layers on; Gemma2 every other layer from the first; Llama ignores the
    key (as transformers)."""
    mistral = parse_model_config(_raw(architectures=["MistralForCausalLM"],
                                      num_hidden_layers=2, sliding_window=8))
    assert mistral.layer_windows == (8, 8)
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 8}
    assert parse_model_config(_raw(**qwen2)).layer_windows == (None,) * 3
    windowed = parse_model_config(_raw(**qwen2, use_sliding_window=True, max_window_layers=1))
    assert windowed.layer_windows == (None, 8, 8)
    llama = parse_model_config(_raw(use_sliding_window=True, sliding_window=8))
    assert llama.layer_windows == (None,)
    gemma2 = parse_model_config(_raw(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                                     sliding_window=8))
    assert gemma2.layer_windows == (8, None, 8, None)
    assert (gemma2.attention_softcap, gemma2.final_softcap) == (50.0, 30.0)


def test_missing_files_give_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_raw()))
    with pytest.raises(ModelLoadError, match="safetensors"):
        ModelEngine.load(tmp_path, device="cpu", dtype=None, catalog=(), page_size=16,
                         num_pages=4, state_rows=1, require_tokenizer=False)


def test_generation_config_eos_ids_are_included() -> None:
    config = parse_model_config(_raw(eos_token_id=2), {"eos_token_id": [7, 2]})
    assert config.eos_token_ids == (7, 2)


def test_tokenizer_round_trip_eos_and_chat_template(tiny_checkpoints: dict[str, Path]) -> None:
    tok = Tokenizer.load(tiny_checkpoints["llama"], extra_eos_ids=(EOS_ID,))
    ids = tok.encode("w5 w17 w90")
    assert ids == [5, 17, 90]
    assert tok.decode(ids) == "w5 w17 w90"
    assert tok.eos_token_ids == (EOS_ID,) and tok.bos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "w5"}])
    assert text == "<user> w5 <assistant>"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_prefill_logprobs_match_transformers(
    kind: str, tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """Scored prefill in two chunks (the second starting at a cached position) gives
    every prompt token's log-probability within 1e-4 of transformers."""
    prompt = prompt_of(100, seed=31)
    reference = hf_reference.log_probs(kind, prompt)
    expected = reference[torch.arange(99), torch.tensor(prompt[1:])]
    engine = build_engine(tiny_checkpoints[kind])
    program = engine.programs[SCORED_64]
    got: list[float] = []
    updates: tuple = (RowInit(row=0), PageAppend(row=0, first_block=0, page_ids=tuple(range(7))))
    final: StepResult | None = None
    for start, end in ((0, 64), (64, 100)):
        program.bind(as_inputs(PrefillFrame(
            row=0, tokens=tuple(prompt[start:end]), start_position=start,
            ends_prompt=end == 100, following_token=prompt[end] if end < 100 else -1,
            updates=updates,
        )))
        updates = ()
        program.execute()
        final = result_of(program.read_outputs())
        assert isinstance(final, StepResult) and final.prompt_logprobs is not None
        got.extend(final.prompt_logprobs)
    assert torch.isnan(torch.tensor(got[-1]))
    assert torch.allclose(torch.tensor(got[:-1]), expected, atol=LOGPROB_TOLERANCE, rtol=0)
    assert final is not None and len(final.samples) == 1
    sample = final.samples[0]
    assert sample.token == int(reference[-1].argmax())
    assert sample.logprob == pytest.approx(float(reference[-1].max()), abs=LOGPROB_TOLERANCE)
    assert sample.finite
    # top alternatives: best first, the sampled greedy token leads (TOP_LOGPROBS of them)
    best = reference[-1].topk(TOP_LOGPROBS)
    assert [t for t, _ in sample.top_logprobs] == best.indices.tolist()
    assert [lp for _, lp in sample.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert final.prompt_top_logprobs is not None
    first_top = final.prompt_top_logprobs[0]
    assert [t for t, _ in first_top] == reference[64].topk(TOP_LOGPROBS).indices.tolist()


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_checkpoints: dict[str, Path], hf_reference: HFReference, tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded"
    hf_reference.model("qwen2").save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoints["qwen2"] / name, sharded / name)
    a = build_engine(tiny_checkpoints["qwen2"]).parts.decoder.w
    b = build_engine(sharded).parts.decoder.w
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_chat_template_helpers_follow_hf(tiny_checkpoints: dict[str, Path]) -> None:
    """``tojson`` does not HTML-escape; ``raise_exception`` raises a template error."""
    import jinja2

    tok = Tokenizer.load(tiny_checkpoints["llama"])
    tok.chat_template = "{{ messages[0]['content'] | tojson }}"
    assert tok.apply_chat_template([{"role": "user", "content": "a<b>&é"}]) == '"a<b>&é"'
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tok.apply_chat_template([])
