"""Fixed-order row reduction in Pallas (Triton lowering; interpret mode on CPU).

One program reduces ``block_rows`` rows of a ``[R, N]`` array. Each row is
walked in ``lanes``-wide steps from column 0 in ascending order (``unroll``
steps per loop iteration): lane ``j`` accumulates ``x[j], x[j + lanes],
x[j + 2 lanes], ...`` one after the other (float32 state), then the lanes are
folded in halves (``lo + hi``, ``lanes / 2`` wide, and so on down to one).
Nothing in that order depends on R, on the row's position or on the tuning
knobs, and columns past N read the identity, so a row's result is the same
bits whatever the batch, and trailing exact zeros (masked keys, padding) never
change a sum. ``jaxrl_kernels/pallas/fixed_order.py`` runs the same operations
in plain XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.pallas import _common

# Programs wanted in flight: a few per SM keep memory bandwidth busy (a tuning knob, not
# part of the contract: the grid does not change any row's order).
_TARGET_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class Config:
  """Free tuning knobs; none of them changes a row's reduction order.

  ``block_rows``: rows per program (None: the largest power of two <= 16 that still
  gives :data:`_TARGET_PROGRAMS` programs, so a few long rows, a vocabulary's
  log-softmax, spread over the GPU). ``unroll``: lane steps per loop iteration
  (independent loads in flight; the adds stay in step order).
  """

  block_rows: int | None = None
  unroll: int = 8
  num_warps: int = 4
  num_stages: int = 3


def block_rows_for(rows: int, cfg: Config) -> int:
  if cfg.block_rows is not None:
    return cfg.block_rows
  br = 16
  while br > 1 and _common.cdiv(rows, br) < _TARGET_PROGRAMS:
    br //= 2
  return br


def _kernel(x_ref, o_ref, *, rows, n, lanes, block_rows, unroll, op):
  i = pl.program_id(0)
  row_ids = i * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
  row_ok = row_ids < rows
  identity = 0.0 if op == "sum" else 1.0

  def load(t):  # lane step t: columns [t * lanes, (t + 1) * lanes), float32
    cols = t * lanes + lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    x = pltriton.load(x_ref.at[pl.ds(i * block_rows, block_rows), pl.ds(t * lanes, lanes)],
                      mask=row_ok[:, None] & (cols < n)[None, :], other=identity)
    return x.astype(jnp.float32)

  def step(t, acc):
    return acc + load(t) if op == "sum" else acc * load(t)

  def unrolled(j, acc):  # steps 1 + j * unroll ... j * unroll + unroll, in that order
    for u in range(unroll):
      acc = step(1 + j * unroll + u, acc)
    return acc

  # Ascending lane steps from column 0 with a trip count set by N alone: the contract.
  # Step 0 is identity (+) x written out (0.0 + (-0.0) is +0.0; 1.0 * x is x), so no
  # compiler can fold it to x. Then whole groups of `unroll` steps, then the remaining
  # steps one at a time: the same operations in the same order as one step per iteration.
  steps = _common.cdiv(n, lanes)
  acc = load(0)
  if op == "sum":
    acc = jnp.where(acc == 0, jnp.zeros_like(acc), acc)
  groups = (steps - 1) // unroll
  acc = lax.fori_loop(0, groups, unrolled, acc)
  acc = lax.fori_loop(1 + groups * unroll, steps, step, acc)
  width = lanes
  while width > 1:  # fixed halving tree over the lanes
    lo, hi = jnp.split(acc, 2, axis=1)
    acc = lo + hi if op == "sum" else lo * hi
    width //= 2
  pltriton.store(o_ref.at[pl.ds(i * block_rows, block_rows)],
                 acc.reshape(block_rows).astype(o_ref.dtype), mask=row_ok)


def reduce_rows(x: jax.Array, *, op: str, lanes: int, out_dtype, interpret: bool,
                config: Config | None = None) -> jax.Array:
  """``out[r] = sum_c x[r, c]`` (or the product) in the fixed lane order.

  Args:
    x: ``[R, N]`` bfloat16, float16 or float32.
    op: ``"sum"`` or ``"prod"``.
    lanes: the contract's lane width (a power of two).
    out_dtype: dtype of the ``[R]`` result; the state is float32.
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
    config: tuning knobs (:class:`Config`); every config gives the same bits.
  """
  rows, n = x.shape
  cfg = config or Config()
  if cfg.unroll < 1:
    raise ValueError(f"reduce_rows: config.unroll must be >= 1, got {cfg.unroll}")
  br = block_rows_for(rows, cfg)
  if br < 1 or br & (br - 1):
    raise ValueError(f"reduce_rows: config.block_rows must be a power of two, got {br}")
  kernel = functools.partial(_kernel, rows=rows, n=n, lanes=lanes, block_rows=br,
                             unroll=cfg.unroll, op=op)
  return pl.pallas_call(
      kernel,
      grid=(_common.cdiv(rows, br),),
      out_shape=jax.ShapeDtypeStruct((rows,), out_dtype),
      interpret=interpret,
      name=f"det_{op}_rows",
      **_common.triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(x)
