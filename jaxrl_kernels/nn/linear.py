"""``DetLinear``: ``nnx.Linear``'s parameters and init, computed with ``det_matmul``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_kernels.gemm import det_matmul

_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()  # nnx.Linear's defaults
_DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


class DetLinear(nnx.Module):
  """A dense layer whose product is batch-invariant (``y = x @ kernel + bias``).

  Same parameters (``kernel [in, out]``, ``bias [out]``), initialisers and
  dtype handling as ``flax.nnx.Linear``, so checkpoints move between the two;
  the product runs on ``det_matmul``, so a row's output bits do not depend on
  the batch it is computed in.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype=None, param_dtype=jnp.float32,
               kernel_init=_DEFAULT_KERNEL_INIT,
               bias_init=_DEFAULT_BIAS_INIT,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.implementation = implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., in] -> [..., out]`` in ``dtype`` (default: the promoted x/kernel dtype)."""
    kernel = self.kernel[...]
    dtype = self.dtype or jnp.result_type(x.dtype, kernel.dtype)
    y = det_matmul(x.astype(dtype), kernel.astype(dtype), implementation=self.implementation)
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y
