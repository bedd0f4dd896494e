"""The embedded default model pair and its recipe.

The committed checkpoints in ``models/default/`` and ``models/default-draft/`` must load in
transformers with no missing keys, share one tokenizer that round-trips text, carry a chat
template and stop tokens, fit in 25 MB together and generate real text. The recipe
(``flare train-default``) must run end to end on a tiny setting and be deterministic. The draft
model is the learned proposal source of ACC-5.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ops.train_default import (
    DRAFT_DIRECTORY,
    SIZE_LIMIT_BYTES,
    TARGET_DIRECTORY,
    TINY_DRAFT_SHAPE,
    TINY_TARGET_SHAPE,
    RecipeSettings,
    add_arguments,
    settings_from_arguments,
    train_default_pair,
)
from ops.training.corpus import list_source_files, split_files, stdlib_root
from ops.training.export import CHECKPOINT_FILES
from ops.training.llama import LlamaForCausalLM, LlamaShape
from ops.training.special_tokens import (
    CHAT_TEMPLATE,
    END,
    END_OF_TEXT,
    SPECIAL_TOKENS,
    render_chat,
)
from ops.training.trainer import TrainSettings, learning_rate_at, train

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2] / "models"
CHECKPOINTS = (MODELS / TARGET_DIRECTORY, MODELS / DRAFT_DIRECTORY)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
)


@functools.cache
def _hf_model(directory: Path) -> tuple[torch.nn.Module, dict[str, set[str]]]:
    """Loaded once per directory: transformers loading is the slow part of these tests."""
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        directory, local_files_only=True, output_loading_info=True
    )
    model.eval()
    return model, info


@functools.cache
def _tokenizer(directory: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _shape_of(directory: Path) -> LlamaShape:
    config = json.loads((directory / "config.json").read_text())
    return LlamaShape(**{key: config[key] for key in SHAPE_KEYS})


@pytest.mark.slow
@pytest.mark.parametrize("directory", CHECKPOINTS, ids=lambda p: p.name)
def test_checkpoint_loads_in_transformers_with_no_missing_keys(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    model, info = _hf_model(directory)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config.vocab_size == config["vocab_size"]


def test_draft_is_smaller_and_shares_the_target_tokenizer() -> None:
    """ACC-5: the draft proposes tokens the target verifies, so the vocabularies must agree."""
    target, draft = CHECKPOINTS
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    target_params = sum(t.numel() for t in load_file(target / "model.safetensors").values())
    draft_params = sum(t.numel() for t in load_file(draft / "model.safetensors").values())
    assert draft_params * 3 < target_params
    assert _shape_of(target).vocab_size == _shape_of(draft).vocab_size


@pytest.mark.slow
@pytest.mark.parametrize("directory", CHECKPOINTS, ids=lambda p: p.name)
def test_plain_torch_training_model_matches_transformers_logits(directory: Path) -> None:
    """The recipe's own model and transformers compute the same function from the file."""
    ours = LlamaForCausalLM(_shape_of(directory))
    result = ours.load_state_dict(load_file(directory / "model.safetensors"), strict=False)
    assert list(result.unexpected_keys) == []
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embeddings
    ours.eval()
    theirs, _ = _hf_model(directory)
    ids = torch.randint(
        0, ours.shape.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = theirs(ids).logits
        actual = ours(ids)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_total_checkpoint_size_is_at_most_25_mb() -> None:
    total = sum(path.stat().st_size for d in CHECKPOINTS for path in d.iterdir())
    assert total <= SIZE_LIMIT_BYTES
    for directory in CHECKPOINTS:
        for name in CHECKPOINT_FILES:
            assert (directory / name).is_file(), f"{directory.name} lacks {name}"


@pytest.mark.parametrize(
    "text",
    ["def f(x):\n    return x * 2\n", "naïve café — 東京 🚀\r\n\ttabs", "", "   \n\n  "],
)
def test_tokenizer_round_trips_text(text: str) -> None:
    tokenizer = _tokenizer(CHECKPOINTS[0])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_eos_is_configured() -> None:
    directory = CHECKPOINTS[0]
    tokenizer = _tokenizer(directory)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    for token, token_id in ids.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    config = json.loads((directory / "config.json").read_text())
    generation = json.loads((directory / "generation_config.json").read_text())
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer.eos_token == END_OF_TEXT == tokenizer_config["eos_token"]
    assert config["eos_token_id"] == ids[END_OF_TEXT]
    assert set(generation["eos_token_id"]) == {ids[END_OF_TEXT], ids[END]}
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]


def test_chat_template_renders_what_the_model_was_trained_on() -> None:
    tokenizer = _tokenizer(CHECKPOINTS[0])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse a list."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(
        [("system", "Be brief."), ("user", "Reverse a list.")], add_generation_prompt=True
    )
    assert (
        rendered
        == "<|system|>\nBe brief.<|end|>\n<|user|>\nReverse a list.<|end|>\n<|assistant|>\n"
    )
    config = json.loads((CHECKPOINTS[0] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_chat_template_refuses_unknown_roles() -> None:
    with pytest.raises(ValueError, match="unsupported chat role"):
        render_chat([("tool", "x")], add_generation_prompt=False)


@pytest.mark.slow
@pytest.mark.parametrize("directory", CHECKPOINTS, ids=lambda p: p.name)
def test_greedy_generation_produces_varied_python(directory: Path) -> None:
    tokenizer = _tokenizer(directory)
    model, _ = _hf_model(directory)
    prompt = tokenizer("import os\n\n\ndef ", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **prompt,
            max_new_tokens=24,
            min_new_tokens=24,  # suppresses the stop tokens so the length is fixed
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    new_ids = output[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(new_ids) == 24
    assert len(set(new_ids)) >= 5, tokenizer.decode(new_ids)
    text = tokenizer.decode(new_ids)
    assert sum(ch.isalpha() for ch in text) >= 10, text


def test_corpus_split_is_deterministic_and_disjoint() -> None:
    files = list_source_files(stdlib_root())
    assert files == tuple(sorted(files))
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    split = split_files(files)
    assert split == split_files(list_source_files(stdlib_root()))
    assert not set(split.train_files) & set(split.held_out_files)
    assert len(split.train_files) + len(split.held_out_files) == len(files)
    assert split.held_out_files


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    settings = TrainSettings(
        steps=200,
        max_seconds=60,
        learning_rate=1e-3,
        warmup_steps=20,
        final_learning_rate_ratio=0.1,
    )
    rates = [learning_rate_at(step, settings) for step in range(200)]
    assert rates[0] < rates[10] < rates[19] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(rates[19:]))
    assert learning_rate_at(10_000, settings) == pytest.approx(1e-4)


def test_learning_rate_decay_follows_the_clock_when_the_time_cap_binds() -> None:
    settings = TrainSettings(steps=1000, max_seconds=100, learning_rate=1e-3, warmup_steps=10)
    assert learning_rate_at(50, settings, elapsed_seconds=100) == pytest.approx(1e-4)
    halfway = learning_rate_at(50, settings, elapsed_seconds=50)
    assert halfway == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert learning_rate_at(50, settings, elapsed_seconds=1) > halfway


def _tiny_settings(output: Path) -> RecipeSettings:
    return RecipeSettings(
        output_root=output,
        target_shape=TINY_TARGET_SHAPE,
        draft_shape=TINY_DRAFT_SHAPE,
        target_steps=3,
        draft_steps=3,
        minutes_per_model=0,  # no time cap: the schedule then depends on the step alone
        sequence_length=32,
        batch_size=2,
        max_files=8,
        sample_tokens=4,
    )


@pytest.mark.slow
def test_recipe_runs_end_to_end_and_is_deterministic(tmp_path: Path) -> None:
    lines: list[str] = []
    report = train_default_pair(_tiny_settings(tmp_path / "a"), log=lines.append)
    assert any("loss" in line and "tokens/s" in line for line in lines)
    assert report.target.result.steps == 3 and report.draft.result.steps == 3
    assert torch.isfinite(torch.tensor(report.target.result.held_out_loss))
    for directory in (tmp_path / "a" / TARGET_DIRECTORY, tmp_path / "a" / DRAFT_DIRECTORY):
        _, info = _hf_model(directory)
        assert not info["missing_keys"] and not info["unexpected_keys"]
    train_default_pair(_tiny_settings(tmp_path / "b"), log=lambda _: None)
    for name in (TARGET_DIRECTORY, DRAFT_DIRECTORY):
        for file in ("model.safetensors", "tokenizer.json"):
            first = (tmp_path / "a" / name / file).read_bytes()
            assert first == (tmp_path / "b" / name / file).read_bytes(), f"{name}/{file}"


def test_command_line_flags_reach_the_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_arguments(
        parser.parse_args(["--output", str(tmp_path), "--steps", "7", "--minutes", "2", "--tiny"])
    )
    assert settings.target_steps == settings.draft_steps == 7
    assert settings.minutes_per_model == 2
    assert settings.target_shape == TINY_TARGET_SHAPE
    assert settings.output_root == tmp_path


def test_distillation_moves_a_draft_towards_its_teacher() -> None:
    """ACC-5: a draft is accepted where it agrees with the target. ``distill`` from a
    tiny teacher trained on a simple rule into an untrained tiny draft lowers the
    draft's soft-label loss against the teacher and raises top-token agreement on
    text it did not train on."""
    from ops.training.distill import DistillSettings, agreement, distill
    from ops.training.llama import greedy_generate
    from ops.training.trainer import _soft_label_loss

    vocab = TINY_TARGET_SHAPE.vocab_size
    rng = torch.Generator().manual_seed(6)
    stream = torch.randint(3, vocab, (6000,), generator=rng)
    for i in range(1, stream.numel()):  # a rule the teacher learns: t' = 7t + 3, mostly
        if i % 8:
            stream[i] = (7 * stream[i - 1] + 3) % (vocab - 3) + 3
    corpus = stream.int()
    teacher, student = LlamaForCausalLM(TINY_TARGET_SHAPE), LlamaForCausalLM(TINY_DRAFT_SHAPE)
    teacher.initialise(torch.Generator().manual_seed(4))
    student.initialise(torch.Generator().manual_seed(5))
    train(teacher, corpus, corpus, TrainSettings(steps=150, sequence_length=24, batch_size=8,
                                                 seed=7), log=lambda _: None)
    teacher.eval()
    continuations = torch.tensor([p + greedy_generate(teacher, p, 24)
                                  for p in corpus[:96].view(12, 8).tolist()])
    probe, corpus = corpus[-96:].view(4, 24).long(), corpus[:-96]

    def loss_and_agreement() -> tuple[float, float]:
        with torch.no_grad():
            loss = float(_soft_label_loss(student(probe), teacher(probe)))
        return loss, agreement(student, teacher, probe)

    before = loss_and_agreement()
    result = distill(student, teacher, corpus, continuations.int(), corpus,
                     DistillSettings(steps=60, max_seconds=math.inf, sequence_length=24,
                                     batch_size=8, learning_rate=3e-3),
                     log=lambda _: None)
    after = loss_and_agreement()
    assert result.steps == 60
    assert after[0] < before[0]
    assert after[1] > before[1]


@pytest.mark.slow
def test_distill_draft_rewrites_the_draft_and_records_the_run(tmp_path: Path) -> None:
    """``flare train-default --distill-draft`` on the tiny recipe: flare's engine
    generates the target's continuations, the draft keeps its shape and loads in
    transformers and flare, and ``flare_training.json`` gains the run's record."""
    from gpu.engine import ModelEngine
    from ops.train_default import distill_draft

    settings = _tiny_settings(tmp_path)
    train_default_pair(settings, log=lambda _: None)
    draft_dir = tmp_path / DRAFT_DIRECTORY
    config_before = (draft_dir / "config.json").read_text()
    weights_before = load_file(str(draft_dir / "model.safetensors"))
    lines: list[str] = []
    record = distill_draft(replace(settings, minutes_per_model=0.05), log=lines.append)
    assert any("target continuations" in line for line in lines)
    assert (draft_dir / "config.json").read_text() == config_before
    weights_after = load_file(str(draft_dir / "model.safetensors"))
    assert weights_after.keys() == weights_before.keys()
    assert any(not torch.equal(weights_after[k], weights_before[k]) for k in weights_before)
    saved = json.loads((draft_dir / "flare_training.json").read_text())
    assert saved["distillation"] == json.loads(json.dumps(record))
    assert "training" in saved  # the original run's record stays
    _, info = _hf_model(draft_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ModelEngine.load(draft_dir, device="cpu", dtype=None, catalog=(), page_size=16,
                     num_pages=8, state_rows=1)
