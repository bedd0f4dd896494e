"""The embedded default model (``models/default``) through our programs equals
transformers' greedy ``generate`` token for token (greedy equality holds for the
embedded default model too); skipped until the trained checkpoint is committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import DECODE, MIXED_2, PREFILL_64, build_engine

from gpu.frames import NO_PROMPT_ROW
from gpu.programs.driver import ReferenceDriver

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = [REPO / "models" / "default", REPO / "models" / "default-draft"]


def _greedy_generate(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    model.generation_config.eos_token_id = None
    config = tf.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                 pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", DEFAULT_MODELS, ids=["default", "default-draft"])
def test_default_model_greedy_equals_generate(model_dir: Path) -> None:
    if not (model_dir / "config.json").exists():
        pytest.skip(f"{model_dir.name} is not trained/committed yet")
    engine = build_engine(model_dir, num_pages=64)
    tok = engine.tokenizer
    prompts = [tok.encode("def main(argv):\n    return"),
               tok.encode("import os\nimport sys\n\n\nclass ")]
    new_tokens = 12
    expected = [_greedy_generate(model_dir, p, new_tokens) for p in prompts]
    driver = ReferenceDriver(engine)
    got = {0: [driver.prefill(PREFILL_64, 0, prompts[0], chunk=5)]}
    for _ in range(3):
        got[0] += driver.decode(DECODE[2], [0])
    # second prompt enters through a mixed frame next to the running request
    result = driver.mixed(MIXED_2, (0, 1), prefill_row=1, prompt=prompts[1], prompt_ends=True)
    by_row = {s.row: s.token for s in result.samples}
    got[0].append(by_row[0])
    got[1] = [by_row[1]]
    while len(got[1]) < new_tokens:
        result = driver.mixed(MIXED_2, (1, 0), prefill_row=NO_PROMPT_ROW)
        for s in result.samples:
            got[s.row].append(s.token)
    assert got[0][:new_tokens] == expected[0]
    assert got[1] == expected[1]
