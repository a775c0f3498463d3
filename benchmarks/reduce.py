"""det_sum's Triton kernel against jnp.sum, and its tuning configs (every one the same bits).

  PYTHONPATH=$PWD python benchmarks/reduce.py [--cases rows,cols] \
      [--out benchmarks/results/reduce_<device>.md]

``rows``: sums over the last axis of the log-softmax over a vocabulary (2047 x 128256),
attention probabilities (32768 x 2048), and decode-sized rows (64 x 128256); float32.
``cols``: sums over the first axis at a Qwen2.5-0.5B training step's norm shape (16384
tokens x 896, float32): det_sum through the transpose and the row kernel, the column kernel
(its configs), ``jnp.sum(axis=0)``; and the RMSNorm weight gradient from bf16 ``g`` and
``x`` (the rows' rstd included): the written ``g * y`` summed through the transpose against
the fused column kernel. Floor: the bytes read once at HBM bandwidth. Device time by CUPTI
(benchmarks/_timing.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import device_ms  # noqa: E402

from jaxrl_kernels.pallas import reduce_triton  # noqa: E402
from jaxrl_kernels.reduce import REDUCE_LANES, det_sum  # noqa: E402

SHAPES = ((2047, 128256), (32768, 2048), (64, 128256))
CONFIGS = (dict(block_rows=16, unroll=1, num_stages=1), dict(block_rows=4, unroll=1, num_stages=1),
           dict(), dict(block_rows=1), dict(block_rows=2), dict(unroll=4),
           dict(num_warps=8), dict(num_stages=1), dict(unroll=16, num_stages=4))


COLUMN_SHAPE = (16384, 896)
COLUMN_CONFIGS = (dict(), dict(block_lanes=REDUCE_LANES), dict(block_lanes=8),
                  dict(block_lanes=16), dict(block_lanes=2), dict(block_cols=32),
                  dict(block_cols=128), dict(block_cols=32, block_lanes=16),
                  dict(block_cols=128, block_lanes=2), dict(unroll=4), dict(unroll=16),
                  dict(num_warps=8), dict(num_warps=2), dict(num_stages=1))
EPS = 1e-6


def _row(lines: list[str], shape: str, what: str, ms: float, gb: float, base: float,
         same) -> None:
  lines.append(f"| {shape} | {what} | {ms:.4f} | {gb / ms * 1e3:.0f} | {base / ms:.2f} | "
               f"{same} |")
  print(lines[-1], flush=True)


def column_lines(rows: int, n: int, *, interpret: bool = False) -> list[str]:
  """The ``cols`` case's table rows at ``rows x n`` (``interpret``: the Pallas interpreter,
  for a run on the CPU; its times say nothing)."""
  impl = "interpret" if interpret else "triton"
  shape = f"{rows}x{n}"
  lines: list[str] = []
  x = jax.random.normal(jax.random.key(0), (rows, n), jnp.float32)
  gb = x.size * 4 / 1e9
  stock = jax.jit(lambda x: jnp.sum(x, axis=0))
  base = device_ms(stock, x)
  _row(lines, shape, "jnp.sum(axis=0)", base, gb, base, "-")
  transposed = jax.jit(lambda x: det_sum(x.T, axis=1, implementation=impl))
  ref = np.asarray(transposed(x)).view(np.uint32)
  _row(lines, shape, "det_sum: transpose + row kernel", device_ms(transposed, x), gb, base, "-")
  for cfg in COLUMN_CONFIGS:
    c = reduce_triton.ColumnConfig(**cfg)
    f = jax.jit(lambda x, c=c: reduce_triton.reduce_cols(
        x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=interpret, config=c))
    same = np.array_equal(np.asarray(f(x)).view(np.uint32), ref)
    bl = reduce_triton.block_lanes_for(n, REDUCE_LANES, c)
    _row(lines, shape, f"column kernel {cfg or 'default'} (block_lanes {bl})", device_ms(f, x),
         gb, base, same)

  # RMSNorm's weight gradient from bf16 g and x: 2 reads of 2 bytes an element, float32 rstd.
  kg, kx = jax.random.split(jax.random.key(1))
  g = jax.random.normal(kg, (rows, n), jnp.bfloat16)
  xb = jax.random.normal(kx, (rows, n), jnp.bfloat16)
  gb = 2 * xb.size * 2 / 1e9

  def rstd_of(x):
    x32 = x.astype(jnp.float32)
    return x32, jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(EPS))

  @jax.jit
  def written(g, x):  # g32 * y written, transposed and summed by the row kernel
    x32, rstd = rstd_of(x)
    return det_sum((g.astype(jnp.float32) * (x32 * rstd)).T, axis=1, implementation=impl)

  @jax.jit
  def stock_dw(g, x):
    x32, rstd = rstd_of(x)
    return jnp.sum(g.astype(jnp.float32) * (x32 * rstd), axis=0)

  @jax.jit
  def fused(g, x):
    _, rstd = rstd_of(x)
    return reduce_triton.product_reduce_cols(g, x, rstd.reshape(-1), lanes=REDUCE_LANES,
                                             interpret=interpret)

  base = device_ms(stock_dw, g, xb)
  _row(lines, shape, "norm dw: jnp.sum(g32 * y, axis=0)", base, gb, base, "-")
  ref = np.asarray(written(g, xb)).view(np.uint32)
  _row(lines, shape, "norm dw: g32 * y written + transpose + row kernel",
       device_ms(written, g, xb), gb, base, "-")
  same = np.array_equal(np.asarray(fused(g, xb)).view(np.uint32), ref)
  _row(lines, shape, "norm dw: fused column kernel", device_ms(fused, g, xb), gb, base, same)
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default="rows,cols", help="comma-separated: rows, cols")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  cases = args.cases.split(",")
  lines = [f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
           f"{datetime.date.today()}", "",
           "| shape | config | ms | GB/s | vs jnp.sum | same bits |", "|---|---|---|---|---|---|"]
  if "cols" in cases:
    lines += column_lines(*COLUMN_SHAPE)
  for rows, n in SHAPES if "rows" in cases else ():
    x = jax.random.normal(jax.random.key(0), (rows, n), jnp.float32)
    gb = x.size * 4 / 1e9
    base = device_ms(jax.jit(lambda x: jnp.sum(x, axis=1)), x)
    lines.append(f"| {rows}x{n} | jnp.sum | {base:.3f} | {gb / base * 1e3:.0f} | 1.00 | - |")
    print(lines[-1], flush=True)
    ref = None
    for cfg in CONFIGS:
      c = reduce_triton.Config(**cfg)
      f = jax.jit(lambda x, c=c: reduce_triton.reduce_rows(
          x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=False, config=c))
      out = np.asarray(f(x)).view(np.uint32)
      ref = out if ref is None else ref
      ms = device_ms(f, x)
      br = reduce_triton.block_rows_for(rows, c)
      lines.append(f"| {rows}x{n} | {cfg or 'default'} (block_rows {br}) | {ms:.3f} | "
                   f"{gb / ms * 1e3:.0f} | {base / ms:.2f} | {np.array_equal(out, ref)} |")
      print(lines[-1], flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write("\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
