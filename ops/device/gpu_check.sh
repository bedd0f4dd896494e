#!/bin/bash
# The CUDA checks issue 6 waits on, as one prepared command for the lent GPU machine.
#
# Here (once): bash ops/device/fetch_wheels.sh
# Then one `run` of the device tool, with carry [".whl"] and a timeout_s of about 560:
#     bash ops/device/gpu_check.sh
# It installs the carried wheels into /tmp/site, runs the CUDA tests (pytest -m cuda
# tests/gpu) and then `flare bench speculation --backend cuda` (fixed depths and adaptive
# under the throughput preset: the tokens-per-second target), each under its own
# time limit, and leaves the logs in $OUT (they come back). REPEATS (default 2: the
# fewest for the held-out verdicts), MAX_TOKENS (default 128) and POLICIES (default
# throughput; balanced,throughput adds the cadence trade) size the bench; the bench
# prints only at its end, so size it to finish inside its 320 s.
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
  --max-tokens "${MAX_TOKENS:-128}" --repeats "${REPEATS:-2}" \
  --adaptive-policies "${POLICIES:-throughput}" --diagnose 2>&1 \
  | tee "$OUT/bench-speculation.log"
