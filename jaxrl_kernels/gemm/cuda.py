"""``implementation="cuda"``: the CUTLASS SM90 GEMM behind XLA's FFI (Hopper, bf16/fp16).

The binding and the tile choice live in ``custom_calls/gemm_ffi.py``; the K
tile is CUTLASS's ``kTileK``, equal to ``contract.GEMM_TILE_K`` (tested), so
the CUDA and Mosaic kernels give the same bits.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels.custom_calls import gemm_ffi
from jaxrl_kernels.gemm.base import GemmBackend


def supported(n: int, k: int, dtype) -> str | None:
  del n, k
  if jnp.dtype(dtype).name not in gemm_ffi.INPUT_DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not one of {gemm_ffi.INPUT_DTYPES}"
  return None


# The FFI call is vmapped sequentially (each chunk its own call); CUTLASS picks its tile
# by shape, so the backward runs one product per chunk (not shape_free).
BACKEND = GemmBackend("cuda", gemm_ffi.matmul_cuda, supported, vmaps_chunks=True)
