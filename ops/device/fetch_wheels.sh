#!/bin/bash
# Download into .whl/ the wheels the lent GPU machine (the workplace's `device` tool,
# image 'cuda', Python 3.12, no package registry) lacks to run flare's CUDA checks:
# trio, the HTTP stack, structlog, pytest-trio. Its image already has torch, numpy,
# safetensors, tokenizers, transformers, cuda-bindings, pytest, httpx, jinja2, attrs,
# idna, h11, werkzeug, click, sortedcontainers (.library/device/KINDS.md).
# Versions are the ones this repository's virtual environment pins. Run it here, in
# the repository root; then carry `.whl` with ops/device/gpu_check.sh (see that file).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PY=${PY:-.venv/bin/python}
PACKAGES=(
  trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1
  hypercorn==0.18.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2
  quart==0.22.0 quart-trio==0.12.0 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0
  structlog==26.1.0 prometheus-client==0.26.0 httpx-sse==0.4.3 pytest-trio==0.8.0
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${PACKAGES[@]}"
ls .whl
