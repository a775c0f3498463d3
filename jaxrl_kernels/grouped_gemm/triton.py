"""``implementation="triton"`` and ``"interpret"``: ``pallas/grouped_gemm_triton.py``.

The same Pallas kernels, compiled by Triton on a CUDA GPU or run by the Pallas
interpreter on the CPU. ``"mosaic"`` and ``"cuda"`` run the Triton kernels too
(there is no Hopper-specific grouped kernel yet), so one implementation name can be
passed to every op of a model.
"""

from __future__ import annotations

import functools

from jaxrl_kernels.grouped_gemm.base import GroupedGemmBackend
from jaxrl_kernels.pallas import grouped_gemm_triton


def _weight_grad(lhs, g, layout, *, num_experts, out_dtype, interpret):
  return grouped_gemm_triton.weight_grad(lhs, g, layout.tile_start, layout.tile_count,
                                         num_experts=num_experts, out_dtype=out_dtype,
                                         interpret=interpret)


TRITON = GroupedGemmBackend(
    "triton", functools.partial(grouped_gemm_triton.matmul, interpret=False),
    functools.partial(_weight_grad, interpret=False))
INTERPRET = GroupedGemmBackend(
    "interpret", functools.partial(grouped_gemm_triton.matmul, interpret=True),
    functools.partial(_weight_grad, interpret=True))
