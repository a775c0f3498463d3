"""Sweep the Mosaic GEMM's free knobs per shape; check every config gives the same bits.

  PYTHONPATH=$PWD python benchmarks/tune_gemm_mosaic.py [--shapes M,K,N;...] [--product fwd|dA|dB]
      [--all]   (every config list, the shape's default config first)
"""

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copies_for, device_ms

from jaxrl_kernels.pallas import gemm_mosaic as gm

C = gm.Config
SMALL = [
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=8),
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=12),
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=10,
      grid_minor="m"),
    C(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n", max_concurrent_steps=8),
]
LARGE = [
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=8),
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=16),
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=4),
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="n", grid_tile_width=8),
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=3,
      grid_minor="m", grid_tile_width=8),
    C(tile_m=128, tile_n=128, num_compute_wgs=2, wg_split="n", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=16),
]
MID = LARGE[:3]
# 64 < M <= 512: how to cover the SMs with few row tiles.
M256 = [
    C(tile_m=64, tile_n=64, num_compute_wgs=2, wg_split="n", max_concurrent_steps=6),
    C(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="n", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=4),
    C(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=4),
    C(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n", max_concurrent_steps=6,
      grid_minor="m", grid_tile_width=4),
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=3,
      grid_minor="m", grid_tile_width=8),
    C(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="n", max_concurrent_steps=6,
      grid_minor="m", grid_tile_width=2),
]
# 192 x 192 CTA tiles (three compute warpgroups): weight gradients whose 128 x 256 tiles
# leave the last wave of the 132 SMs nearly empty (896 x 9728: 266 tiles; 4864 x 896: 152).
WIDE = [
    C(tile_m=64, tile_n=192, num_compute_wgs=3, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=8),
    C(tile_m=64, tile_n=192, num_compute_wgs=3, wg_split="m", max_concurrent_steps=4,
      grid_minor="n", grid_tile_width=8),
    C(tile_m=64, tile_n=192, num_compute_wgs=2, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=8),
    C(tile_m=64, tile_n=128, num_compute_wgs=3, wg_split="m", max_concurrent_steps=4,
      grid_minor="m", grid_tile_width=8),
]
# M <= 64 (a decode step): how many columns per CTA spread a weight stream over the SMs
# (32 columns: A's K tile in the weight tile's narrower swizzle), how many K columns per
# pipeline step (tile_k), how deep a pipeline.
DECODE = [
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=8),
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=6,
      tile_k=128),
    C(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n", max_concurrent_steps=4,
      tile_k=256),
    C(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n", max_concurrent_steps=4),
    C(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n", max_concurrent_steps=4,
      tile_k=128),
    C(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n", max_concurrent_steps=2,
      tile_k=256),
    C(tile_m=64, tile_n=32, num_compute_wgs=1, wg_split="n", max_concurrent_steps=8,
      tile_k=128),
]
LARGE_K = [
    C(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m", max_concurrent_steps=2,
      grid_minor="m", grid_tile_width=8, tile_k=128),
    C(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="n", max_concurrent_steps=3,
      grid_minor="m", grid_tile_width=4, tile_k=128),
]
# 64 < M <= 512: the tiles gemm_mosaic.mid_config picks from.
MID_TILES = [cfg for cfg, _ in gm.MID_TILES]
LISTS = dict(small=SMALL, m256=M256, large=LARGE, large_k=LARGE_K, wide=WIDE, decode=DECODE,
             mid=MID_TILES)
SHAPES = [(1, 4096, 4096), (16, 4096, 14336), (1024, 4096, 14336), (1024, 14336, 4096),
          (4096, 4096, 4096), (8192, 4096, 14336), (8192, 4096, 151936)]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=None)
  p.add_argument("--product", default="fwd", choices=["fwd", "dA", "dB"],
                 help="fwd: A @ B; dA: dC @ B^T (B read transposed); dB: A^T @ dC (A read "
                      "transposed); M, K, N are the forward's")
  p.add_argument("--all", action="store_true",
                 help="every config list for every shape (not only the list of its M)")
  p.add_argument("--lists", default=None,
                 help="comma-separated config lists to sweep after the shape's default config "
                      f"(of {sorted(LISTS)}), instead of the list of its M")
  args = p.parse_args()
  shapes = SHAPES
  if args.shapes:
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
  for m, k, n in shapes:
    # The product actually run, as (lhs, rhs, flags): out = op(lhs) @ op(rhs).
    if args.product == "fwd":
      lhs_shape, rhs_shape, lt, rt, om = (m, k), (k, n), False, False, m
    elif args.product == "dA":  # [M, N] x [K, N]^T -> [M, K]
      lhs_shape, rhs_shape, lt, rt, om = (m, n), (k, n), False, True, m
    else:  # dB: [M, K]^T x [M, N] -> [K, N]
      lhs_shape, rhs_shape, lt, rt, om = (m, k), (m, n), True, False, k
    a = jax.random.normal(jax.random.key(0), lhs_shape, jnp.bfloat16)
    reps = copies_for(rhs_shape[0] * rhs_shape[1] * 2)
    bs = [jax.random.normal(jax.random.key(i + 1), rhs_shape, jnp.bfloat16)
          for i in range(reps)]
    flops = 2.0 * m * n * k
    ref = lambda a, b, lt=lt, rt=rt: jnp.dot(a.T if lt else a, b.T if rt else b)
    ref_ms = device_ms(jax.jit(lambda a, bs, ref=ref: [ref(a, b) for b in bs]), a, bs) / reps
    print(f"== {args.product} M={m} K={k} N={n}: jnp.dot {ref_ms * 1e3:.1f} us "
          f"{flops / ref_ms / 1e9:.1f} TFLOP/s", flush=True)
    configs = SMALL if om <= 64 else (M256 if om <= 512 else (MID if om <= 1024 else LARGE))
    if args.all:
      configs = list(dict.fromkeys([gm.default_config(om, n if args.product != "dA" else k,
                                                      k), *SMALL, *M256, *LARGE, *WIDE]))
    elif args.lists:
      configs = list(dict.fromkeys([gm.default_config(om, n if args.product != "dA" else k, k),
                                    *(c for name in args.lists.split(",") for c in LISTS[name])]))
    digest0 = None
    for cfg in configs:
      try:
        f = jax.jit(lambda a, bs, cfg=cfg, lt=lt, rt=rt: [gm.matmul(a, b, lhs_transposed=lt,
                                                       rhs_transposed=rt,
                                                       out_dtype=jnp.bfloat16, config=cfg)
                                             for b in bs])
        ms = device_ms(f, a, bs) / reps
        digest = hashlib.sha1(np.asarray(f(a, bs[:1])[0]).view(np.uint16).tobytes()).hexdigest()
        digest0 = digest0 or digest
        print(f"  {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s {ref_ms / ms:5.2f}x "
              f"bits={'same' if digest == digest0 else 'DIFFERENT'} {cfg}", flush=True)
      except Exception as e:  # noqa: BLE001 - a sweep report
        print(f"  FAIL {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)

if __name__ == "__main__":
  main()
