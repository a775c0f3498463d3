"""``implementation="cpu"``: the grouped GEMM as fixed-shape XLA CPU dots.

Each (row tile, column block) is one dot of shape ``[GROUPED_GEMM_BLOCK_M, K] x
[K, CPU_COL_BLOCK]`` against the tile's expert's weight (float32, the last column
block zero-padded), in a ``lax.fori_loop``: XLA's CPU GEMM fixes its blocking by
the operand shapes, which are then the same for every routing (see
``gemm/cpu.py``). ``dw`` adds each used tile's ``[K, N]`` product into its
expert's accumulator in ascending tile order: deterministic run to run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels._cpu import (
  dot_f32,
  from_storage,
  opaque_zero,
  pad_rows,
  storage_dtype,
  to_storage,
)
from jaxrl_kernels.contract import CPU_COL_BLOCK, GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.grouped_gemm.base import GroupedGemmBackend


def matmul(lhs: jax.Array, rhs: jax.Array, tile_expert: jax.Array, *, rhs_transposed: bool,
           out_dtype) -> jax.Array:
  bm, cb = GROUPED_GEMM_BLOCK_M, CPU_COL_BLOCK
  n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
  # [E, N_pad, K] float32: a column block is a row slice of one expert's weight.
  w = rhs if rhs_transposed else jnp.swapaxes(rhs, 1, 2)
  w = jax.vmap(lambda x: pad_rows(x, cb))(w).astype(jnp.float32)
  k = w.shape[2]
  n_col = w.shape[1] // cb
  zero = opaque_zero(w)

  def block(idx, out):
    i, j = idx // n_col, idx % n_col
    xb = lax.dynamic_slice_in_dim(lhs, i * bm, bm)
    wb = lax.dynamic_slice(w, (tile_expert[i], j * cb, 0), (1, cb, k))[0]
    y = dot_f32(xb, wb, ((1,), (1,)), zero)
    return lax.dynamic_update_slice(out, to_storage(y, out_dtype), (i * bm, j * cb))

  out = jnp.zeros((lhs.shape[0], w.shape[1]), storage_dtype(out_dtype))
  out = lax.fori_loop(0, tile_expert.shape[0] * n_col, block, out)
  return from_storage(out[:, :n], out_dtype)


def weight_grad(lhs: jax.Array, g: jax.Array, layout, *, num_experts: int,
                out_dtype) -> jax.Array:
  bm = GROUPED_GEMM_BLOCK_M
  k, n = lhs.shape[1], g.shape[1]
  zero = opaque_zero(g)
  used = layout.tile_start[-1] + layout.tile_count[-1]

  def tile(t, acc):
    e = layout.tile_expert[t]
    part = dot_f32(lax.dynamic_slice_in_dim(lhs, t * bm, bm),
                   lax.dynamic_slice_in_dim(g, t * bm, bm), ((0,), (0,)), zero)
    cur = lax.dynamic_slice(acc, (e, 0, 0), (1, k, n))
    return lax.dynamic_update_slice(acc, cur + part[None], (e, 0, 0))

  acc = lax.fori_loop(0, used, tile, jnp.zeros((num_experts, k, n), jnp.float32))
  return acc.astype(out_dtype)


BACKEND = GroupedGemmBackend("cpu", matmul, weight_grad)
