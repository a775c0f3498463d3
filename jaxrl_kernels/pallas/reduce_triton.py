"""Fixed-order row reduction in Pallas (Triton lowering; interpret mode on CPU).

One program reduces ``block_rows`` rows of a ``[R, N]`` array. Each row is
walked in ``lanes``-wide steps from column 0 in ascending order: lane ``j``
accumulates ``x[j], x[j + lanes], x[j + 2 lanes], ...`` one after the other
(float32 state), then the lanes are folded in halves (``lo + hi``, ``lanes / 2``
wide, and so on down to one). Nothing in that order depends on R or on the
row's position, and columns past N read the identity, so a row's result is the
same bits whatever the batch, and trailing exact zeros (masked keys, padding)
never change a sum. ``jaxrl_kernels/reduce/fixed_order.py`` runs the same
operations in plain XLA.
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


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
  """Free tuning knobs: rows per program and the Triton launch parameters (they
  never change a row's reduction order)."""

  block_rows: int = 16
  num_warps: int = 4
  num_stages: int = 1


def _kernel(x_ref, o_ref, *, rows, n, lanes, block_rows, op):
  i = pl.program_id(0)
  row_ids = i * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
  row_ok = row_ids < rows
  identity = 0.0 if op == "sum" else 1.0

  def body(t, acc):
    cols = t * lanes + lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    x = pltriton.load(x_ref.at[pl.ds(i * block_rows, block_rows), pl.ds(t * lanes, lanes)],
                      mask=row_ok[:, None] & (cols < n)[None, :], other=identity)
    x = x.astype(jnp.float32)
    return acc + x if op == "sum" else acc * x

  # Ascending lane steps from column 0 with a trip count set by N alone: the contract.
  acc = lax.fori_loop(0, _common.cdiv(n, lanes), body,
                      jnp.full((block_rows, lanes), identity, jnp.float32))
  width = lanes
  while width > 1:  # fixed halving tree over the lanes
    lo, hi = jnp.split(acc, 2, axis=1)
    acc = lo + hi if op == "sum" else lo * hi
    width //= 2
  pltriton.store(o_ref.at[pl.ds(i * block_rows, block_rows)],
                 acc.reshape(block_rows).astype(o_ref.dtype), mask=row_ok)


def reduce_rows(x: jax.Array, *, op: str, lanes: int, out_dtype, interpret: bool,
                config: ReduceConfig | None = None) -> jax.Array:
  """``out[r] = sum_c x[r, c]`` (or the product) in the fixed lane order.

  Args:
    x: ``[R, N]`` bfloat16, float16 or float32.
    op: ``"sum"`` or ``"prod"``.
    lanes: the contract's lane width (a power of two).
    out_dtype: dtype of the ``[R]`` result; the state is float32.
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
  """
  rows, n = x.shape
  cfg = config or ReduceConfig()
  kernel = functools.partial(_kernel, rows=rows, n=n, lanes=lanes, block_rows=cfg.block_rows,
                             op=op)
  return pl.pallas_call(
      kernel,
      grid=(_common.cdiv(rows, cfg.block_rows),),
      out_shape=jax.ShapeDtypeStruct((rows,), out_dtype),
      interpret=interpret,
      name=f"det_{op}_rows",
      **_common.triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(x)
