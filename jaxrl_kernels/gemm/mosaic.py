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


BACKEND = GemmBackend("mosaic", matmul, supported)
