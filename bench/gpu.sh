#!/usr/bin/env bash
# One command for a GPU machine (issues 20 and 55): the CUDA suite first, then the GPU benchmark, one
# results folder, in one call of under 8 minutes on one H100/H200 (the suite ~2, the benchmark the rest).
#
#   bench/gpu.sh                    # the README's setup into .venv (when missing), then both
#   PYTHON=python3 bench/gpu.sh     # an interpreter that already has torch with CUDA and kdeq's needs
#   bench/gpu.sh --seconds 3 --repeat 3   # arguments go to bench/gpu.py (a shorter run)
#   bench/gpu.sh --sections peer,models,cpu,profile,targets   # some of its sections
#
# Installs nothing beyond the README's setup (`pip install -c constraints.txt -e '.[dev]'`), and
# that only when no PYTHON is given and .venv is missing. Writes bench/out/gpu-<time>/ (or under $OUT
# when set): nvidia-smi.txt, cuda-suite.txt (pytest's report) and results.md (bench/gpu.py's tables,
# rewritten after each of its sections, with each section's wall time against its budget).
# The whole call stops at GPU_LIMIT_S seconds (default 465): the benchmark gets what the suite left
# (at least 60 s) and is then interrupted, its finished sections kept in results.md (exit 124).
# Exits non-zero when the suite fails; the benchmark still runs, so one call gets both.
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${GPU_LIMIT_S:-465}
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
left=$((limit - SECONDS))
[ "$left" -ge 60 ] || left=60
# SIGINT, not SIGTERM: Python unwinds, so the service section's `finally` stops its server
timeout --signal=INT --kill-after=15 "$left" "$PYTHON" bench/gpu.py --out "$out/results.md" "$@"
bench=$?
[ "$bench" -ne 124 ] || echo "bench/gpu.sh: the benchmark stopped at the call's limit ($limit s); results.md keeps its finished sections"
echo "results in $out (suite exit $suite, benchmark exit $bench, $SECONDS s)"
[ "$suite" -eq 0 ] && [ "$bench" -eq 0 ]
