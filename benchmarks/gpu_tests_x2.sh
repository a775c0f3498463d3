#!/usr/bin/env bash
# Usage (repository root, a machine of two GPUs): PART_C=0 bash benchmarks/gpu_tests_x2.sh [seconds per part]
# GPU test run on a 2-GPU machine: two pytest parts in parallel (one GPU each), then the
# multi-GPU tests on both (skip with PART_C=0). Logs under $OUT. The "cuda" cases need the
# FFI library built first (benchmarks/gpu_tests.sh): deselected here.
set -uo pipefail
out=${OUT:-/tmp/gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
budget=${1:-400}
nvidia-smi -L > "$out/device.txt"; python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$out/device.txt"
common=(-m gpu -v --tb=line -k "not cuda" -p no:cacheprovider -p no:benchmark --timeout 300 -rfE --ignore=tests/custom_calls)
CUDA_VISIBLE_DEVICES=0 timeout "$budget" python3 -m pytest "${common[@]}" -n 8 ${PART_A:-tests/attention tests/test_contract.py tests/pallas tests/reduce tests/transform tests/test_golden.py} > "$out/part_a.log" 2>&1 &
a=$!
CUDA_VISIBLE_DEVICES=1 timeout "$budget" python3 -m pytest "${common[@]}" -n 8 ${PART_B:-tests/gemm tests/nn tests/models tests/cli tests/test_rl.py tests/test_train.py tests/linear_logp --deselect tests/linear_logp/test_vocab_parallel_gpu.py} > "$out/part_b.log" 2>&1 &
b=$!
wait $a; echo "part_a rc=$?" >> "$out/summary.txt"
wait $b; echo "part_b rc=$?" >> "$out/summary.txt"
if [ "${PART_C:-1}" = 1 ]; then
  timeout 150 python3 -m pytest "${common[@]}" tests/distributed tests/linear_logp/test_vocab_parallel_gpu.py > "$out/part_c.log" 2>&1
  echo "part_c rc=$?" >> "$out/summary.txt"
fi
for f in part_a part_b part_c; do [ -f "$out/$f.log" ] && { echo "== $f"; grep -E "FAILED|ERROR" "$out/$f.log" | head -30; tail -3 "$out/$f.log"; }; done
cat "$out/summary.txt"
