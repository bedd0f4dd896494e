"""The scheduler and runtime phase tests need no GPU. Covers VER-22: nothing under
tests/policy or tests/actors names CUDA, the cuda backend or a device other than the
CPU, so ``pytest tests/policy tests/actors`` runs (and passes) on a CPU-only machine."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_ONLY = re.compile(r"cuda|cuda_backend|device=['\"](?!cpu)", re.IGNORECASE)


def test_ver_22_policy_and_actor_tests_need_no_gpu() -> None:
    files = [p for package in ("policy", "actors") for p in (ROOT / "tests" / package).rglob("*.py")]
    assert files
    offenders = [str(p.relative_to(ROOT)) for p in files if GPU_ONLY.search(p.read_text())]
    assert offenders == []
