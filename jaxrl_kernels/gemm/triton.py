"""``implementation="triton"`` and ``"interpret"``: ``pallas/gemm_triton.py``.

The same Pallas kernel, compiled by Triton on a CUDA GPU or run by the Pallas
interpreter on the CPU (the GPU kernel's semantics, for tests). Every shape
and float dtype; the K tile is ``contract.GEMM_TRITON_BLOCK_K`` by dtype.
"""

from __future__ import annotations

import functools

from jaxrl_kernels.gemm.base import GemmBackend
from jaxrl_kernels.pallas import gemm_triton

# A Pallas grid gains a chunk axis under vmap (the same program per chunk); one config per
# dtype gives every element the same walk at every shape.
TRITON = GemmBackend("triton", functools.partial(gemm_triton.matmul, interpret=False),
                     vmaps_chunks=True, shape_free=True)
INTERPRET = GemmBackend("interpret", functools.partial(gemm_triton.matmul, interpret=True),
                        vmaps_chunks=True, shape_free=True)
