"""Sweep the CUDA FFI GEMM's free knobs per shape: the CUTLASS tile and the CTA walk.

  PYTHONPATH=$PWD python benchmarks/tune_gemm_cuda.py [--shapes M,K,N;...] [--sweep walk|tile]

Each setting is a ``gemm_ffi.Config`` (tile, swizzle, raster), passed to
the kernel as FFI attributes (det_gemm_sm90_kernels.cuh: ``SchedulerKnobs``), so
each is its own compiled program. Every setting must give the same bits (the
walk never changes a tile's K order); the sweep checks that too. Prints a
markdown table of TFLOP/s per setting against jnp.dot.
"""

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copies_for, device_ms

from jaxrl_kernels import det_matmul
from jaxrl_kernels.custom_calls.gemm_ffi import Config, matmul_cuda

SHAPES = [(1024, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336), (1024, 14336, 4096),
          (8192, 14336, 4096), (8192, 4096, 4096)]
WALKS = [Config(swizzle=s, raster=r) for r in ("heuristic", "m", "n")
         for s in (1, 2, 4, 8)]
TILE_SHAPES = [(64, 4096, 4096), (256, 4096, 4096), (256, 4096, 14336), (256, 14336, 4096),
               (1024, 4096, 4096), (1024, 4096, 14336), (1024, 14336, 4096), (2048, 4096, 14336),
               (4096, 4096, 14336), (8192, 4096, 14336)]
# Each tile with the default walk (swizzle 0: the rule in SchedulerKnobs).
TILES = [Config(tile=t) for t in ("large", "medium", "small")]


def _name(c: Config) -> str:
  if c.tile is not None:
    return c.tile
  return f"s{c.swizzle}{c.raster[0]}"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=None, help="M,K,N;M,K,N")
  p.add_argument("--sweep", default="walk", choices=["walk", "tile"])
  args = p.parse_args()
  configs = WALKS if args.sweep == "walk" else TILES
  default = SHAPES if args.sweep == "walk" else TILE_SHAPES
  shapes = default if not args.shapes else [tuple(int(x) for x in s.split(","))
                                            for s in args.shapes.split(";")]
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| M | K | N | jnp.dot | auto | " + " | ".join(_name(c) for c in configs) + " | best |")
  print("|" + "---|" * (len(configs) + 6))
  for m, k, n in shapes:
    reps = copies_for(k * n * 2)
    bs = [jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) for i in range(reps)]
    a = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
    flops = 2.0 * m * n * k * reps
    dot = jax.jit(lambda a, bs: [jnp.dot(a, b) for b in bs])
    det = jax.jit(lambda a, bs: [det_matmul(a, b, implementation="cuda") for b in bs])
    base = flops / device_ms(dot, a, bs) / 1e9
    auto = flops / device_ms(det, a, bs) / 1e9
    cells, digests = [], set()
    for c in configs:
      run = jax.jit(lambda a, bs, c=c: [matmul_cuda(a, b, lhs_transposed=False,
                                                    rhs_transposed=False, out_dtype=a.dtype,
                                                    config=c) for b in bs])
      cells.append(flops / device_ms(run, a, bs) / 1e9)
      digests.add(hashlib.sha256(np.asarray(run(a, bs[:1])[0]).tobytes()).hexdigest())
    best = int(np.argmax(cells))
    same = "same bits" if len(digests) == 1 else f"{len(digests)} DIFFERENT bit patterns"
    print(f"| {m} | {k} | {n} | {base:.1f} | {auto:.1f} ({auto / base:.2f}x) | "
          + " | ".join(f"{c:.1f}" for c in cells)
          + f" | {_name(configs[best])} {cells[best] / base:.2f}x ({same}) |", flush=True)


if __name__ == "__main__":
  main()
