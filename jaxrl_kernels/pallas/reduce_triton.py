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

The column form (:func:`reduce_cols`, and :func:`product_reduce_cols` for a weight
gradient ``sum_r g[r, c] * (x[r, c] * scale[r])``) sums a ``[R, N]`` array over its rows
in that very order, for every column at once and without a transpose: lane ``j`` of
column ``c`` accumulates rows ``j, j + lanes, j + 2 lanes, ...`` (``[block_lanes,
block_cols]`` tiles, contiguous along the columns), then the lanes fold in halves. Column
``c``'s result is the bits of the row kernel on column ``c`` (``det_sum(x, axis=0)``).
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


def walk_steps(load, steps: int, unroll: int, op: str):
  """The contract's walk over ``steps`` lane steps (``load(t)``: step ``t``'s float32 tile):
  step 0 as identity (+) x written out (0.0 + (-0.0) is +0.0; 1.0 * x is x), so no compiler
  can fold it to x; then whole groups of ``unroll`` steps, then the remaining steps one at a
  time: the same operations in the same order as one step per loop iteration."""

  def step(t, acc):
    return acc + load(t) if op == "sum" else acc * load(t)

  def unrolled(j, acc):  # steps 1 + j * unroll ... j * unroll + unroll, in that order
    for u in range(unroll):
      acc = step(1 + j * unroll + u, acc)
    return acc

  acc = load(0)
  if op == "sum":
    acc = jnp.where(acc == 0, jnp.zeros_like(acc), acc)
  groups = (steps - 1) // unroll
  acc = lax.fori_loop(0, groups, unrolled, acc)
  return lax.fori_loop(1 + groups * unroll, steps, step, acc)


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

  # Ascending lane steps from column 0 with a trip count set by N alone: the contract.
  acc = walk_steps(load, _common.cdiv(n, lanes), unroll, op)
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


# Programs wanted in flight for the column form: about two per SM. A program owns
# ``block_lanes`` lanes of ``block_cols`` columns; lanes are independent chains until the
# fold, so splitting them over programs changes no bit.
_TARGET_COL_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class ColumnConfig:
  """Free tuning knobs of the column form; none of them changes a column's order.

  ``block_cols``: columns per program (a power of two). ``block_lanes``: lanes per program
  (a power of two dividing the lane count; None: the largest, down to 4, that still
  gives :data:`_TARGET_COL_PROGRAMS` programs). With all lanes in one program the fold runs in
  the kernel; otherwise the kernel writes the ``[lanes, N]`` float32 lane sums and XLA
  folds them (the same adds in the same order). ``unroll``: row steps per loop iteration.
  """

  block_cols: int = 64
  block_lanes: int | None = None
  unroll: int = 8
  num_warps: int = 4
  num_stages: int = 3


def block_lanes_for(n: int, lanes: int, cfg: ColumnConfig) -> int:
  """Lanes per program of the column form for ``n`` columns."""
  if cfg.block_lanes is not None:
    return cfg.block_lanes
  col_blocks = _common.cdiv(n, cfg.block_cols)
  bl = lanes
  while bl > min(lanes, 4) and col_blocks * (lanes // bl) < _TARGET_COL_PROGRAMS:
    bl //= 2
  return bl


def _cols_kernel(*refs, rows, n, lanes, block_lanes, block_cols, unroll, op, fused):
  *in_refs, o_ref = refs
  c, part = pl.program_id(0), pl.program_id(1)
  col0 = c * block_cols
  col_ok = col0 + lax.broadcasted_iota(jnp.int32, (block_cols,), 0) < n
  lane0 = part * block_lanes
  identity = 0.0 if op == "sum" else 1.0

  def load(t):  # row step t: rows t * lanes + [lane0, lane0 + block_lanes), float32
    row0 = t * lanes + lane0
    row_ok = row0 + lax.broadcasted_iota(jnp.int32, (block_lanes,), 0) < rows
    mask = row_ok[:, None] & col_ok[None, :]
    window = (pl.ds(row0, block_lanes), pl.ds(col0, block_cols))
    if not fused:
      x = pltriton.load(in_refs[0].at[window], mask=mask, other=identity)
      return x.astype(jnp.float32)
    g_ref, x_ref, s_ref = in_refs
    g = pltriton.load(g_ref.at[window], mask=mask, other=0).astype(jnp.float32)
    x = pltriton.load(x_ref.at[window], mask=mask, other=0).astype(jnp.float32)
    scale = pltriton.load(s_ref.at[pl.ds(row0, block_lanes)], mask=row_ok, other=0)
    # XLA's order, y = x * scale first, then g * y. The select puts the identity past the
    # last row and rounds the product on its own: no compiler contracts it with the add
    # that consumes it into an FMA (the product XLA writes to memory is rounded too).
    return jnp.where(mask, g * (x * scale.astype(jnp.float32)[:, None]), 0.0)

  # The row kernel's order (_kernel); the trip count is set by R alone.
  acc = walk_steps(load, _common.cdiv(rows, lanes), unroll, op)
  if block_lanes < lanes:  # the lane sums; fold_lanes folds them
    pltriton.store(o_ref.at[pl.ds(lane0, block_lanes), pl.ds(col0, block_cols)], acc,
                   mask=col_ok[None, :])
    return
  acc = fold_lanes(acc, op)
  pltriton.store(o_ref.at[pl.ds(col0, block_cols)], acc.reshape(block_cols).astype(o_ref.dtype),
                 mask=col_ok)


def fold_lanes(acc: jax.Array, op: str) -> jax.Array:
  """The fixed halving fold of ``[lanes, ...]`` lane sums over axis 0: ``lo (+) hi``,
  ``lanes / 2`` wide, and so on down to ``[1, ...]``."""
  while acc.shape[0] > 1:
    lo, hi = jnp.split(acc, 2, axis=0)
    acc = lo + hi if op == "sum" else lo * hi
  return acc


def _reduce_cols_call(args, *, rows: int, n: int, op: str, lanes: int, out_dtype,
                      interpret: bool, config: ColumnConfig | None, fused: bool, name: str):
  if op not in ("sum", "prod"):
    raise ValueError(f"{name}: op must be 'sum' or 'prod', got {op!r}")
  if lanes < 1 or lanes & (lanes - 1):
    raise ValueError(f"{name}: lanes must be a power of two, got {lanes}")
  cfg = config or ColumnConfig()
  if cfg.unroll < 1:
    raise ValueError(f"{name}: config.unroll must be >= 1, got {cfg.unroll}")
  bc = cfg.block_cols
  if bc < 1 or bc & (bc - 1):
    raise ValueError(f"{name}: config.block_cols must be a power of two, got {bc}")
  # The interpreter runs programs one after the other: all lanes in one program there.
  bl = lanes if interpret and cfg.block_lanes is None else block_lanes_for(n, lanes, cfg)
  if bl < 1 or bl & (bl - 1) or lanes % bl:
    raise ValueError(f"{name}: config.block_lanes must be a power of two dividing {lanes}, "
                     f"got {bl}")
  split = bl < lanes
  kernel = functools.partial(_cols_kernel, rows=rows, n=n, lanes=lanes, block_lanes=bl,
                             block_cols=bc, unroll=cfg.unroll, op=op, fused=fused)
  out_shape = (jax.ShapeDtypeStruct((lanes, n), jnp.float32) if split
               else jax.ShapeDtypeStruct((n,), out_dtype))
  out = pl.pallas_call(
      kernel,
      grid=(_common.cdiv(n, bc), lanes // bl),
      out_shape=out_shape,
      interpret=interpret,
      name=name,
      **_common.triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(*args)
  if split:
    out = fold_lanes(out, op).reshape(n).astype(out_dtype)
  return out


def reduce_cols(x: jax.Array, *, op: str, lanes: int, out_dtype, interpret: bool,
                config: ColumnConfig | None = None) -> jax.Array:
  """``out[c] = sum_r x[r, c]`` (or the product) in the fixed lane order over rows.

  Column ``c`` gets the bits :func:`reduce_rows` gives row ``c`` of ``x.T``.

  Args:
    x: ``[R, N]`` bfloat16, float16 or float32.
    op: ``"sum"`` or ``"prod"``.
    lanes: the contract's lane width (a power of two).
    out_dtype: dtype of the ``[N]`` result; the state is float32.
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
    config: tuning knobs (:class:`ColumnConfig`); every config gives the same bits.
  """
  if x.ndim != 2:
    raise ValueError(f"det_{op}_cols: x must be [R, N], got shape {x.shape}")
  rows, n = x.shape
  return _reduce_cols_call((x,), rows=rows, n=n, op=op, lanes=lanes, out_dtype=out_dtype,
                           interpret=interpret, config=config, fused=False,
                           name=f"det_{op}_cols")


def product_reduce_cols(g: jax.Array, x: jax.Array, scale: jax.Array, *, lanes: int,
                        interpret: bool, config: ColumnConfig | None = None) -> jax.Array:
  """``out[c] = sum_r g32[r, c] * (x32[r, c] * scale[r])`` in float32, summed over rows in
  the order of :func:`reduce_cols`: an RMSNorm weight gradient (``scale`` the rows'
  ``rsqrt(mean(x^2) + eps)``) without writing the products.

  Each product has the bits XLA's ``g32 * (x32 * scale[:, None])`` gives (two rounded
  multiplies), so ``out`` is bitwise ``reduce_cols`` of that array.

  Args:
    g: ``[R, N]`` bfloat16, float16 or float32.
    x: ``[R, N]`` bfloat16, float16 or float32.
    scale: ``[R]`` float32.
    lanes: the contract's lane width (a power of two).
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
    config: tuning knobs (:class:`ColumnConfig`); every config gives the same bits.

  Returns:
    ``[N]`` float32.
  """
  if x.ndim != 2:
    raise ValueError(f"product_reduce_cols: x must be [R, N], got shape {x.shape}")
  rows, n = x.shape
  if g.shape != x.shape or scale.shape != (rows,):
    raise ValueError(f"product_reduce_cols: expected g {x.shape} and scale {(rows,)} for x "
                     f"{x.shape}, got g {g.shape} and scale {scale.shape}")
  if scale.dtype != jnp.float32:
    raise TypeError(f"product_reduce_cols: scale must be float32, got {scale.dtype}")
  return _reduce_cols_call((g, x, scale), rows=rows, n=n, op="sum", lanes=lanes,
                           out_dtype=jnp.float32, interpret=interpret, config=config,
                           fused=True, name="det_product_sum_cols")
