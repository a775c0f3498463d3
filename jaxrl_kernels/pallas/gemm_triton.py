"""Deterministic, batch-invariant GEMM in Pallas (Triton lowering; interpret mode on CPU).

One program computes one ``[block_m, block_n]`` output tile by walking the K
axis in fixed ``block_k`` steps in ascending order, accumulating in float32.
Nothing about that walk depends on M, so a row's bits do not depend on the
batch it sits in. Out-of-range rows, columns and K entries are masked loads
(zeros), so no operand is ever padded or copied.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.contract import GEMM_TRITON_BLOCK_K
from jaxrl_kernels.pallas._common import cdiv, dot_precision, triton_compiler_params

# The K tile fixes each output element's reduction order (contract.py); it
# depends only on the input dtype, never on the shape.
CONTRACT_BLOCK_K = GEMM_TRITON_BLOCK_K


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile choices of the Triton kernel.

  ``block_m`` is held fixed per dtype too: on some GPUs Triton picks a
  different tensor-core instruction for small M tiles, and that is not shown
  to keep the bits (see docs/gemm.md).
  """

  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3


def default_config(dtype) -> Config:
  name = jnp.dtype(dtype).name
  if name == "float32":
    return Config(block_m=64, block_n=64, block_k=CONTRACT_BLOCK_K[name], num_warps=4,
                        num_stages=3)
  return Config(block_m=64, block_n=128, block_k=CONTRACT_BLOCK_K[name], num_warps=4,
                      num_stages=4)


def _kernel(lhs_ref, rhs_ref, out_ref, *, m, n, k, block_m, block_n, block_k,
            lhs_transposed, rhs_transposed, precision):
  i = pl.program_id(0)
  j = pl.program_id(1)
  rows = i * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
  cols = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
  row_ok = rows < m
  col_ok = cols < n

  def body(kk, acc):
    ks = kk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    k_ok = ks < k
    if lhs_transposed:  # lhs is [K, M]
      a = pltriton.load(lhs_ref.at[pl.ds(kk * block_k, block_k), pl.ds(i * block_m, block_m)],
                        mask=k_ok[:, None] & row_ok[None, :], other=0)
      a_dims = (0,)
    else:  # lhs is [M, K]
      a = pltriton.load(lhs_ref.at[pl.ds(i * block_m, block_m), pl.ds(kk * block_k, block_k)],
                        mask=row_ok[:, None] & k_ok[None, :], other=0)
      a_dims = (1,)
    if rhs_transposed:  # rhs is [N, K]
      b = pltriton.load(rhs_ref.at[pl.ds(j * block_n, block_n), pl.ds(kk * block_k, block_k)],
                        mask=col_ok[:, None] & k_ok[None, :], other=0)
      b_dims = (1,)
    else:  # rhs is [K, N]
      b = pltriton.load(rhs_ref.at[pl.ds(kk * block_k, block_k), pl.ds(j * block_n, block_n)],
                        mask=k_ok[:, None] & col_ok[None, :], other=0)
      b_dims = (0,)
    part = lax.dot_general(a, b, ((a_dims, b_dims), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)
    return acc + part

  # Ascending K order, fixed trip count for a given K: the contract.
  acc = lax.fori_loop(0, cdiv(k, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
  pltriton.store(out_ref.at[pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)],
                 acc.astype(out_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def matmul(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
           out_dtype, interpret: bool, config: Config | None = None) -> jax.Array:
  """``op(lhs) @ op(rhs)`` with the deterministic tile walk.

  Args:
    lhs: ``[M, K]``, or ``[K, M]`` when ``lhs_transposed``.
    rhs: ``[K, N]``, or ``[N, K]`` when ``rhs_transposed`` (read in place).
    out_dtype: dtype of the ``[M, N]`` result; accumulation is always float32.
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
  """
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  cfg = config or default_config(lhs.dtype)
  if cfg.block_k != CONTRACT_BLOCK_K[jnp.dtype(lhs.dtype).name]:
    raise ValueError(f"det_matmul: block_k={cfg.block_k} breaks the contract K tile "
                     f"{CONTRACT_BLOCK_K[jnp.dtype(lhs.dtype).name]} for {lhs.dtype}")
  kernel = functools.partial(
      _kernel, m=m, n=n, k=k, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
      lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed,
      precision=dot_precision(lhs.dtype, interpret))
  return pl.pallas_call(
      kernel,
      grid=(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      interpret=interpret,
      name="det_matmul_triton",
      **triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(lhs, rhs)
