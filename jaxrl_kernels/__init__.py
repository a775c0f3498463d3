"""jaxrl_kernels: bitwise batch-invariant kernels for RL post-training in JAX."""

from jaxrl_kernels.gemm import det_matmul as det_matmul

__version__ = "0.1.0"
