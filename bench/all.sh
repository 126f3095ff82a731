#!/usr/bin/env bash
# The speed benchmarks, one after the other (about 20 minutes on 2 cores; needs ../shared/data and the
# benchmark environment of docs/BENCHMARKS.md): the solvers on one fixed-point map, the models against
# classical denoisers with the linear path and memory sections (GPU figures: bench/gpu.sh),
# then the HTTP service against the predictor in process, batching off and on. Each writes its tables
# to stdout and to bench/out/<time>/. The quality benchmarks (bench/quality.py, bench/finetune.py)
# take hours and run on their own.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv-bench/bin/python}
out=bench/out/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
"$python" bench/solvers.py --seed 0 | tee "$out/solvers.md"
"$python" bench/speed.py --seed 0 --images 2 | tee "$out/speed.md"
"$python" bench/load.py --seed 0 --seconds 6 --batch 1 8 | tee "$out/load.md"
echo "tables in $out"
