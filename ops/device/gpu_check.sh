#!/bin/bash
# The CUDA checks issue 6 waits on, as one prepared command for the lent GPU machine.
#
# Here (once): bash ops/device/fetch_wheels.sh
# Then one `run` of the device tool, with carry [".whl"] and a timeout_s of about 560:
#     bash ops/device/gpu_check.sh
# It installs the carried wheels into /tmp/site, runs the CUDA tests (pytest -m cuda
# tests/gpu) and then `flare bench speculation --backend cuda` with adaptive under both
# presets, each under its own time limit, and leaves the logs in $OUT (they come back).
# REPEATS (default 3) and MAX_TOKENS (default 192) size the bench; lower them if the
# first run shows it does not fit.
set -o pipefail
OUT=${OUT:-/tmp/flare-gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"; } \
  2>&1 | tee "$OUT/device.txt"
timeout 200 python3 -m pytest -q -m cuda tests/gpu -p no:cacheprovider 2>&1 \
  | tee "$OUT/cuda-tests.log"
timeout 320 python3 -c 'import sys; from ops.cli import main; sys.exit(main(sys.argv[1:]))' \
  bench speculation --backend cuda --sources draft --depths 1,2,3,4 --loads 1,8 \
  --max-tokens "${MAX_TOKENS:-192}" --repeats "${REPEATS:-3}" \
  --adaptive-policies balanced,throughput --diagnose 2>&1 | tee "$OUT/bench-speculation.log"
