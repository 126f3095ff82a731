#!/usr/bin/env bash
# One command for a GPU machine (issue 20): the CUDA suite first, then the GPU benchmark, one results
# folder. Under 8 minutes on one H100 (the suite ~2, the benchmark ~4).
#
#   bench/gpu.sh                    # the README's setup into .venv (when missing), then both
#   PYTHON=python3 bench/gpu.sh     # an interpreter that already has torch with CUDA and kdeq's needs
#   bench/gpu.sh --seconds 3 --repeat 3   # arguments go to bench/gpu.py (a shorter run)
#
# Installs nothing beyond the README's setup (`pip install -c constraints.txt -e '.[dev]'`), and
# that only when no PYTHON is given and .venv is missing. Writes bench/out/gpu-<time>/ (or under $OUT
# when set): nvidia-smi.txt, cuda-suite.txt (pytest's report) and results.md (bench/gpu.py's tables).
# Exits non-zero when the suite fails; the benchmark still runs, so one call gets both.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  [ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]'; } || exit 1
  PYTHON=.venv/bin/python
fi
out=${OUT:-bench/out}/gpu-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: torch sees no CUDA device")' || exit 2
"$PYTHON" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/cuda-suite.txt"
suite=${PIPESTATUS[0]}
"$PYTHON" bench/gpu.py --out "$out/results.md" "$@"
bench=$?
echo "results in $out (suite exit $suite, benchmark exit $bench)"
[ "$suite" -eq 0 ] && [ "$bench" -eq 0 ]
