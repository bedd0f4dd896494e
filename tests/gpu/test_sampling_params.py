"""``SamplingParams`` is one value from the request to the state row: OpenAI's defaults
for a request, one rule for what can never run (admission's ``InvalidRequest`` and a
row's ``ValueError`` give the same reason), and a row always has a seed."""

from __future__ import annotations

import math
import re

import pytest

from actors import public
from actors.admission import AdmissionLimits, check_request
from actors.errors import InvalidRequest
from gpu.frames import GREEDY, RowCopy, RowInit, SamplingParams

LIMITS = AdmissionLimits(max_context=64, vocab_size=16, max_queue=4)


def test_one_class_with_openai_defaults() -> None:
    assert public.SamplingParams is SamplingParams
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=None)
    assert (GREEDY.temperature, GREEDY.seed) == (0.0, 0)
    assert RowInit(row=0).sampling == GREEDY


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=-0.5, seed=1), SamplingParams(temperature=math.inf, seed=1),
    SamplingParams(temperature=math.nan, seed=1), SamplingParams(top_p=0.0, seed=1),
    SamplingParams(top_p=1.5, seed=1), SamplingParams(top_k=-1, seed=1),
    SamplingParams(seed=-1), SamplingParams(seed=2**63),
])
def test_admission_and_rows_refuse_the_same_parameters(params: SamplingParams) -> None:
    refused = check_request(public.GenerationRequest(
        prompt_token_ids=(1, 2), max_tokens=4, sampling=params), LIMITS)
    assert isinstance(refused, InvalidRequest)
    with pytest.raises(ValueError, match=re.escape(str(refused))):
        RowInit(row=0, sampling=params)
    with pytest.raises(ValueError):
        RowCopy(src_row=0, dst_row=1, sampling=params)


def test_a_row_needs_a_seed_a_request_does_not() -> None:
    unseeded = SamplingParams(temperature=0.7)
    assert check_request(public.GenerationRequest(
        prompt_token_ids=(1, 2), max_tokens=4, sampling=unseeded), LIMITS) is None
    with pytest.raises(ValueError, match="seed"):
        RowInit(row=0, sampling=unseeded)
    assert RowInit(row=0, sampling=SamplingParams(temperature=0.7, seed=3)).sampling.seed == 3
