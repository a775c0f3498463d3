"""det_sum's Triton kernel against jnp.sum, and its tuning configs (every one the same bits).

  PYTHONPATH=$PWD python benchmarks/reduce.py [--out benchmarks/results/reduce_<device>.md]

Shapes: the log-softmax over a vocabulary (2047 x 128256), attention probabilities
(32768 x 2048), and decode-sized rows (64 x 128256); float32. Floor: the bytes read
once at HBM bandwidth (~3 TB/s on an H100). Device time by CUPTI (benchmarks/_timing.py).
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
from jaxrl_kernels.reduce import REDUCE_LANES  # noqa: E402

SHAPES = ((2047, 128256), (32768, 2048), (64, 128256))
CONFIGS = (dict(block_rows=16, unroll=1, num_stages=1), dict(block_rows=4, unroll=1, num_stages=1),
           dict(), dict(block_rows=1), dict(block_rows=2), dict(unroll=4),
           dict(num_warps=8), dict(num_stages=1), dict(unroll=16, num_stages=4))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  lines = [f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
           f"{datetime.date.today()}", "",
           "| shape | config | ms | GB/s | vs jnp.sum | same bits |", "|---|---|---|---|---|---|"]
  for rows, n in SHAPES:
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
