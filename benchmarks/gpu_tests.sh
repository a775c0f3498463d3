#!/usr/bin/env bash
# The GPU test run in one call: builds the CUDA FFI library (needs nvcc and the CUTLASS
# headers of the nvidia-cutlass package) while the Pallas tests run, then the CUDA tests.
# Needs pytest-xdist and pytest-timeout. Logs go to ${OUT:-/tmp/gpu_tests}. Usage
# (repository root, GPU machine):
#   bash benchmarks/gpu_tests.sh [seconds for the Pallas tests, default 420]
set -uo pipefail
out=${OUT:-/tmp/gpu_tests}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
budget=${1:-420}
nvidia-smi -L | tee "$out/device.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee -a "$out/device.txt"
(python3 -m jaxrl_kernels.custom_calls.build >"$out/build.log" 2>&1; echo "build rc=$?" >>"$out/build.log") &
build=$!
# Compiles dominate: several workers share the GPU (memory is not preallocated).
# The "cuda" cases wait for the library (below): the build runs meanwhile.
timeout "$budget" python3 -m pytest -m gpu -v -n 8 -p no:cacheprovider -p no:benchmark --timeout 240 \
  -rfE --ignore=tests/custom_calls -k "not cuda" tests 2>&1 | tee "$out/pytest_gpu.log" | tail -40
wait "$build"
tail -2 "$out/build.log"
timeout 240 python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/custom_calls \
  tests/test_contract.py tests/gemm -k "cuda or custom_calls or ffi" 2>&1 \
  | tee "$out/pytest_cuda.log" | tail -15
