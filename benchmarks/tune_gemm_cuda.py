"""Sweep the CUDA FFI GEMM's CTA walk (scheduler swizzle and raster order) per shape.

  PYTHONPATH=$PWD python benchmarks/tune_gemm_cuda.py [--shapes M,K,N;...]

The walk is read from ``JAXRL_DET_GEMM_SWIZZLE`` / ``JAXRL_DET_GEMM_RASTER`` at
every call (det_gemm_sm90.cu, ``SchedulerKnobs``), so one compiled program is
re-timed under each setting. Every setting must give the same bits (the walk
never changes a tile's K order); the sweep checks that too. Prints a markdown
table of TFLOP/s per setting against jnp.dot.
"""

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copies_for, device_ms

from jaxrl_kernels import det_matmul

SHAPES = [(1024, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336), (1024, 14336, 4096),
          (8192, 14336, 4096), (8192, 4096, 4096)]
WALKS = [(s, r) for r in ("h", "m", "n") for s in (1, 2, 4, 8)]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=None, help="M,K,N;M,K,N")
  args = p.parse_args()
  shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(","))
                                           for s in args.shapes.split(";")]
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| M | K | N | jnp.dot | " + " | ".join(f"s{s}{r}" for s, r in WALKS) + " | best |")
  print("|" + "---|" * (len(WALKS) + 5))
  for m, k, n in shapes:
    reps = copies_for(k * n * 2)
    bs = [jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) for i in range(reps)]
    a = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
    flops = 2.0 * m * n * k * reps
    dot = jax.jit(lambda a, bs: [jnp.dot(a, b) for b in bs])
    det = jax.jit(lambda a, bs: [det_matmul(a, b, implementation="cuda") for b in bs])
    base = flops / device_ms(dot, a, bs) / 1e9
    cells, digests = [], set()
    for s, r in WALKS:
      os.environ["JAXRL_DET_GEMM_SWIZZLE"] = str(s)
      os.environ["JAXRL_DET_GEMM_RASTER"] = r
      cells.append(flops / device_ms(det, a, bs) / 1e9)
      digests.add(hashlib.sha256(np.asarray(det(a, bs[:1])[0]).tobytes()).hexdigest())
    os.environ.pop("JAXRL_DET_GEMM_SWIZZLE")
    os.environ.pop("JAXRL_DET_GEMM_RASTER")
    best = int(np.argmax(cells))
    same = "same bits" if len(digests) == 1 else f"{len(digests)} DIFFERENT bit patterns"
    print(f"| {m} | {k} | {n} | {base:.1f} | " + " | ".join(f"{c:.1f}" for c in cells)
          + f" | s{WALKS[best][0]}{WALKS[best][1]} {cells[best] / base:.2f}x ({same}) |",
          flush=True)


if __name__ == "__main__":
  main()
