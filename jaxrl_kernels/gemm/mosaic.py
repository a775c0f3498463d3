"""``implementation="mosaic"``: ``pallas/gemm_mosaic.py`` (Hopper, bf16/fp16).

Forward and ``dA`` products run the Mosaic kernel for every weight it takes:
K and N multiples of 64 with N at least the CTA tile of every config the
shape heuristic may pick (decided by N and K only, so the same kernel for
every M). The ``dB = A^T dC`` product reduces over tokens, so its shape
depends on the batch anyway (it is deterministic run to run, never
batch-invariant): it runs Mosaic where the token count allows, the Triton
kernel otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend
from jaxrl_kernels.contract import GEMM_TILE_K
from jaxrl_kernels.gemm.base import GemmBackend
from jaxrl_kernels.pallas import gemm_mosaic, gemm_triton
from jaxrl_kernels.pallas._common import round_up

DTYPES = ("bfloat16", "float16")


def supported(n: int, k: int, dtype) -> str | None:
  """None when the Mosaic kernel takes a ``[K, N]`` weight of ``dtype`` at every M."""
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not one of {DTYPES}"
  for m in (1, 128, 4096):  # every M-dependent config must accept the weight
    cfg = gemm_mosaic.default_config(m, n, k)
    why = gemm_mosaic.supported_shape(m, n, k, cfg, lhs_transposed=False, rhs_transposed=False)
    if why is not None:
      return why
  return None


def matmul(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
           out_dtype) -> jax.Array:
  kw = dict(lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed, out_dtype=out_dtype)
  if lhs_transposed:
    m, n, k = lhs.shape[1], rhs.shape[0] if rhs_transposed else rhs.shape[1], lhs.shape[0]
    # gemm_mosaic.matmul pads the token (reduction) axis to the K tile itself.
    cfg = gemm_mosaic.default_config(m, n, k)
    if gemm_mosaic.supported_shape(m, n, round_up(k, GEMM_TILE_K), cfg, lhs_transposed=True,
                                   rhs_transposed=rhs_transposed) is not None:
      return gemm_triton.matmul(lhs, rhs, interpret=False, **kw)
  return gemm_mosaic.matmul(lhs, rhs, **kw)


def takes_whole(m: int, k: int, n: int) -> bool:
  """Whether the Mosaic kernel runs ``dx = dy @ w^T`` (``[m, n] x [n, k]``) and ``dw = x^T
  @ dy`` (``[k, m] x [m, n]``) of an unpadded ``[k, n]`` weight. A row-parallel plan's
  chunks may be off the K tile (a padded plan) while the whole ``k`` is not: each element's
  walk is over ``n`` (dx) or the tokens (dw), which the padding does not touch, so the
  unpadded whole products have the padded layout's bits, without its copies of x and dx."""
  dx = gemm_mosaic.supported_shape(m, k, n, gemm_mosaic.default_config(m, k, n),
                                   lhs_transposed=False, rhs_transposed=True)
  tokens = round_up(m, GEMM_TILE_K)  # matmul pads them
  dw = gemm_mosaic.supported_shape(k, n, tokens, gemm_mosaic.default_config(k, n, tokens),
                                   lhs_transposed=True, rhs_transposed=False)
  return dx is None and dw is None


# One jitted function per shape, however many layers call it (_backend.kernel_jit): each
# call site would otherwise lower and compile its own Mosaic kernel.
@_backend.kernel_jit(static_argnames=("out_dtype",))
def grouped_matmul(lhs, rhs, *, out_dtype):
  return gemm_mosaic.grouped_matmul(lhs, rhs, out_dtype=out_dtype)


# A Pallas mesh kernel has no batching rule: chunk products run as one grouped launch or the
# chunk tree; every config gives an element the same walk (shape_free). A differentiated
# call runs a padded plan's forward unpadded on the Triton kernel (gemm/row_parallel.py).
BACKEND = GemmBackend("mosaic", matmul, supported, fallback="triton", shape_free=True,
                      pads_k=True, training_of_padded="triton", grouped_matmul=grouped_matmul,
                      chunk_tree_matmul=gemm_mosaic.chunk_tree_matmul, takes_whole=takes_whole,
                      epilogues=True)
