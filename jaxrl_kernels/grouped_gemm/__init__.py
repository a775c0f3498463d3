"""The grouped (per-expert) GEMM of mixture-of-experts layers: ``grouped_matmul`` on the
tile-aligned group layout (``group_layout``)."""

from jaxrl_kernels.grouped_gemm.api import grouped_matmul as grouped_matmul
from jaxrl_kernels.grouped_gemm.layout import GroupLayout as GroupLayout
from jaxrl_kernels.grouped_gemm.layout import group_layout as group_layout
