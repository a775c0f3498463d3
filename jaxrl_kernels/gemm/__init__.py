"""The batch-invariant deterministic GEMM: ``det_matmul`` and the 2-D entry point
``matmul2d`` that other ops' backward passes call."""

from jaxrl_kernels.gemm.api import det_matmul as det_matmul
from jaxrl_kernels.gemm.api import matmul2d as matmul2d
