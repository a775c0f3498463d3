"""The batch-invariant deterministic GEMM: ``det_matmul``, the 2-D entry point
``matmul2d`` that other ops' backward passes call, and ``row_parallel_matmul`` (the
canonical K order of row-parallel layers, the same bits at every TP degree)."""

from jaxrl_kernels.gemm.api import det_matmul as det_matmul
from jaxrl_kernels.gemm.api import matmul2d as matmul2d
from jaxrl_kernels.gemm.row_parallel import ChunkedWeight as ChunkedWeight
from jaxrl_kernels.gemm.row_parallel import chunk_weight as chunk_weight
from jaxrl_kernels.gemm.row_parallel import row_parallel_matmul as row_parallel_matmul
from jaxrl_kernels.gemm.row_parallel import row_parallel_partials as row_parallel_partials
