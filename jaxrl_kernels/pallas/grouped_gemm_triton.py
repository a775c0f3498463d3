"""Grouped (per-expert) GEMM in Pallas (Triton lowering; interpret mode on CPU).

The rows arrive in the tile-aligned group layout (``grouped_gemm/layout.py``):
every ``block_m`` row tile belongs to one expert, named by ``tile_expert``.

* :func:`matmul`: tile ``i`` of ``out`` is ``lhs[tile i] @ op(rhs[tile_expert[i]])``,
  walked over the reduction axis in the contract's ``block_k`` steps, ascending,
  float32 accumulation: the program of ``pallas/gemm_triton.py`` with the weight
  picked per tile, so a row's bits depend on its own values and its expert's
  weight only (not on how many rows its expert got, nor where it sits).
* :func:`weight_grad`: ``dw[e] = lhs[rows of e]^T @ rhs[rows of e]``, one program per
  (expert, output tile) walking the expert's row tiles in ascending order:
  deterministic run to run, no atomics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.contract import GEMM_TRITON_BLOCK_K, GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.pallas._common import cdiv, dot_precision, triton_compiler_params


@dataclasses.dataclass(frozen=True)
class Config:
  """Free tile choices (the row tile and K tile are the contract's, by dtype).

  ``dw_block_k`` is the K rows of one ``dw`` output tile: each element of it sums the
  expert's row tiles in ascending order whatever its size.
  """

  block_n: int = 128
  dw_block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3


def default_config(dtype) -> Config:
  if jnp.dtype(dtype).name == "float32":
    return Config(block_n=64, dw_block_k=32, num_warps=4, num_stages=3)
  return Config(block_n=128, dw_block_k=64, num_warps=4, num_stages=4)


def _fwd_kernel(tile_expert_ref, lhs_ref, rhs_ref, out_ref, *, n, k, block_m, block_n,
                block_k, rhs_transposed, precision):
  i = pl.program_id(0)
  j = pl.program_id(1)
  e = tile_expert_ref[i]
  cols = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
  col_ok = cols < n

  def body(kk, acc):
    ks = kk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    k_ok = ks < k
    a = pltriton.load(lhs_ref.at[pl.ds(i * block_m, block_m), pl.ds(kk * block_k, block_k)],
                      mask=k_ok[None, :], other=0)
    if rhs_transposed:  # rhs is [E, N, K]
      b = pltriton.load(rhs_ref.at[e, pl.ds(j * block_n, block_n), pl.ds(kk * block_k, block_k)],
                        mask=col_ok[:, None] & k_ok[None, :], other=0)
      b_dims = (1,)
    else:  # rhs is [E, K, N]
      b = pltriton.load(rhs_ref.at[e, pl.ds(kk * block_k, block_k), pl.ds(j * block_n, block_n)],
                        mask=k_ok[:, None] & col_ok[None, :], other=0)
      b_dims = (0,)
    part = lax.dot_general(a, b, (((1,), b_dims), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)
    return acc + part

  # Ascending K order, a trip count fixed by K: the contract.
  acc = lax.fori_loop(0, cdiv(k, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
  pltriton.store(out_ref.at[pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)],
                 acc.astype(out_ref.dtype), mask=col_ok[None, :])


def _check(lhs, tile_expert, block_m):
  if lhs.shape[0] != tile_expert.shape[0] * block_m:
    raise ValueError(f"grouped_matmul: lhs has {lhs.shape[0]} rows but tile_expert names "
                     f"{tile_expert.shape[0]} tiles of {block_m} rows")


def matmul(lhs: jax.Array, rhs: jax.Array, tile_expert: jax.Array, *, rhs_transposed: bool,
           out_dtype, interpret: bool, config: Config | None = None) -> jax.Array:
  """``out[tile i] = lhs[tile i] @ op(rhs[tile_expert[i]])``.

  Args:
    lhs: ``[P, K]``, ``P`` a multiple of the row tile ``GROUPED_GEMM_BLOCK_M``.
    rhs: ``[E, K, N]``, or ``[E, N, K]`` when ``rhs_transposed`` (read in place).
    tile_expert: int32 ``[P / block_m]``, each in ``[0, E)``.
    out_dtype: dtype of the ``[P, N]`` result (float32 accumulation).
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
  """
  name = jnp.dtype(lhs.dtype).name
  block_m, block_k = GROUPED_GEMM_BLOCK_M, GEMM_TRITON_BLOCK_K[name]
  _check(lhs, tile_expert, block_m)
  k = lhs.shape[1]
  n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
  cfg = config or default_config(lhs.dtype)
  kernel = functools.partial(_fwd_kernel, n=n, k=k, block_m=block_m, block_n=cfg.block_n,
                             block_k=block_k, rhs_transposed=rhs_transposed,
                             precision=dot_precision(lhs.dtype, interpret))
  return pl.pallas_call(
      kernel,
      grid=(tile_expert.shape[0], cdiv(n, cfg.block_n)),
      out_shape=jax.ShapeDtypeStruct((lhs.shape[0], n), out_dtype),
      interpret=interpret,
      name="grouped_matmul_triton",
      **triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(tile_expert, lhs, rhs)


def _dw_kernel(tile_start_ref, tile_count_ref, lhs_ref, rhs_ref, out_ref, *, k, n, block_m,
               block_k, block_n, precision):
  e = pl.program_id(0)
  a_blk = pl.program_id(1)
  j = pl.program_id(2)
  ks = a_blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
  cols = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
  k_ok = ks < k
  col_ok = cols < n
  start = tile_start_ref[e]

  def body(t, acc):
    rows = pl.ds((start + t) * block_m, block_m)
    a = pltriton.load(lhs_ref.at[rows, pl.ds(a_blk * block_k, block_k)], mask=k_ok[None, :],
                      other=0)
    b = pltriton.load(rhs_ref.at[rows, pl.ds(j * block_n, block_n)], mask=col_ok[None, :],
                      other=0)
    return acc + lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)

  # The expert's row tiles in ascending order: deterministic run to run.
  acc = lax.fori_loop(0, tile_count_ref[e], body, jnp.zeros((block_k, block_n), jnp.float32))
  pltriton.store(out_ref.at[e, pl.ds(a_blk * block_k, block_k), pl.ds(j * block_n, block_n)],
                 acc.astype(out_ref.dtype), mask=k_ok[:, None] & col_ok[None, :])


def weight_grad(lhs: jax.Array, rhs: jax.Array, tile_start: jax.Array, tile_count: jax.Array,
                *, num_experts: int, out_dtype, interpret: bool,
                config: Config | None = None) -> jax.Array:
  """``dw[e] = lhs[tiles of e]^T @ rhs[tiles of e]``: ``[E, K, N]`` from ``[P, K]``, ``[P, N]``.

  ``tile_start``/``tile_count`` (int32 ``[E]``): expert ``e``'s row tiles are
  ``tile_start[e] ... tile_start[e] + tile_count[e] - 1``, summed in that order.
  """
  block_m = GROUPED_GEMM_BLOCK_M
  if lhs.shape[0] % block_m:
    raise ValueError(f"grouped_matmul: {lhs.shape[0]} rows is not a multiple of {block_m}")
  k, n = lhs.shape[1], rhs.shape[1]
  cfg = config or default_config(lhs.dtype)
  block_k = cfg.dw_block_k
  kernel = functools.partial(_dw_kernel, k=k, n=n, block_m=block_m, block_k=block_k,
                             block_n=cfg.block_n, precision=dot_precision(lhs.dtype, interpret))
  return pl.pallas_call(
      kernel,
      grid=(num_experts, cdiv(k, block_k), cdiv(n, cfg.block_n)),
      out_shape=jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
      interpret=interpret,
      name="grouped_matmul_dw_triton",
      **triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(tile_start, tile_count, lhs, rhs)
