"""``implementation="cpu"``: the batch-invariant GEMM as fixed-shape XLA CPU dots.

``op(lhs) @ op(rhs)`` with float32 accumulation (bf16/fp16 operands are upcast
to float32, exactly):

* rows of the result (``lhs_transposed=False``): the rows of ``lhs`` are
  zero-padded to a multiple of ``CPU_ROW_BLOCK``, the columns of the weight to a
  multiple of ``CPU_COL_BLOCK``, and each (row block, column block) pair is one
  dot of shape ``[CPU_ROW_BLOCK, K] x [K, CPU_COL_BLOCK]`` in a
  ``lax.fori_loop``. XLA's CPU GEMM fixes its blocking (so each output
  element's order of additions) by the operand shapes, which are then the same
  for every batch size and every number of columns; within a block an
  element's result does not depend on its position or on the other rows and
  columns (the tests check both). So each output element is a function of its
  input row and weight column only: batch-, position-, padding-, chunk- and
  mode-invariant, and the same in a column-parallel shard of the weight, with
  XLA's default flags (see ``jaxrl_kernels/_cpu.py`` on FMA contraction).
  The weight is upcast to float32 once per call (a ``[K, N]`` float32 copy for
  16-bit weights).
* reductions over rows (``lhs_transposed=True``, the dB product ``lhs^T
  op(rhs)`` with ``lhs`` ``[K, M]``): ``CPU_ROW_BLOCK``-row slices of the
  reduced axis, each a fixed-shape dot, summed in ascending order: deterministic
  run to run (it depends on the batch by its nature).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels._cpu import (
  CPU_ROW_BLOCK,
  dot_f32,
  from_storage,
  opaque_zero,
  pad_rows,
  storage_dtype,
  to_storage,
  varying_like,
)
from jaxrl_kernels.contract import CPU_COL_BLOCK


def matmul(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
           out_dtype) -> jax.Array:
  """``op(lhs) @ op(rhs)`` on XLA CPU dots of fixed shapes.

  Args:
    lhs: ``[M, K]``, or ``[K, M]`` when ``lhs_transposed``.
    rhs: ``[K, N]``, or ``[N, K]`` when ``rhs_transposed`` (read in place).
    out_dtype: dtype of the ``[M, N]`` result; accumulation is float32.

  Returns:
    ``[M, N]`` in ``out_dtype``.
  """
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  k_rhs = rhs.shape[1] if rhs_transposed else rhs.shape[0]
  if k != k_rhs:
    raise ValueError(f"det_matmul[cpu]: lhs has K={k} (shape {lhs.shape}) but rhs has "
                     f"K={k_rhs} (shape {rhs.shape})")
  out_dtype = jnp.dtype(out_dtype)
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  if lhs_transposed:
    return _reduce_rows(lhs, rhs, rhs_transposed=rhs_transposed, out_dtype=out_dtype)
  return _row_blocks(lhs, rhs, rhs_transposed=rhs_transposed, out_dtype=out_dtype)


def _row_blocks(lhs, rhs, *, rhs_transposed: bool, out_dtype) -> jax.Array:
  m = lhs.shape[0]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  rb, cb = CPU_ROW_BLOCK, CPU_COL_BLOCK
  x = pad_rows(lhs, rb)
  # The weight as [N_pad, K] (column blocks are row slices of it): zero columns add
  # output columns that are sliced off.
  w = pad_rows(rhs if rhs_transposed else rhs.T, cb).astype(jnp.float32)
  n_col = w.shape[0] // cb
  zero = opaque_zero(w)

  def block(idx, out):
    i, j = idx // n_col, idx % n_col
    xb = lax.dynamic_slice_in_dim(x, i * rb, rb)
    wb = lax.dynamic_slice_in_dim(w, j * cb, cb)
    y = dot_f32(xb, wb, ((1,), (1,)), zero)
    return lax.dynamic_update_slice(out, to_storage(y, out_dtype), (i * rb, j * cb))

  out = varying_like(jnp.zeros((x.shape[0], w.shape[0]), storage_dtype(out_dtype)), x, w)
  out = lax.fori_loop(0, (x.shape[0] // rb) * n_col, block, out)
  return from_storage(out[:m, :n], out_dtype)


def _reduce_rows(lhs, rhs, *, rhs_transposed: bool, out_dtype) -> jax.Array:
  # lhs [K, M]; rhs [K, N] (or [N, K]): out [M, N] = sum over K blocks, ascending.
  m = lhs.shape[1]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  tb = CPU_ROW_BLOCK
  a = pad_rows(lhs, tb)
  b = pad_rows(rhs.T if rhs_transposed else rhs, tb)  # zero rows add exact zeros
  zero = opaque_zero(b)

  def block(i, acc):
    ab = lax.dynamic_slice_in_dim(a, i * tb, tb)
    bb = lax.dynamic_slice_in_dim(b, i * tb, tb)
    return acc + dot_f32(ab, bb, ((0,), (0,)), zero)

  acc = varying_like(jnp.zeros((m, n), jnp.float32), a, b)
  acc = lax.fori_loop(0, a.shape[0] // tb, block, acc)
  return acc.astype(out_dtype)
