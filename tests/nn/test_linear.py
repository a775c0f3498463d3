"""DetLinear: nnx.Linear's parameters, det_matmul's bits, flax's current Variable API."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import assert_bitwise_equal, wide_rows

from jaxrl_kernels import det_matmul
from jaxrl_kernels.nn import DetLinear


def test_same_parameters_and_init_as_nnx_linear():
  det = DetLinear(24, 40, rngs=nnx.Rngs(0))
  ref = nnx.Linear(24, 40, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(det.kernel[...]), np.asarray(ref.kernel[...]))
  np.testing.assert_array_equal(np.asarray(det.bias[...]), np.asarray(ref.bias[...]))
  x = jax.random.normal(jax.random.key(1), (5, 24))
  np.testing.assert_allclose(np.asarray(det(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)


def test_output_is_det_matmul_and_batch_invariant():
  layer = DetLinear(64, 48, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
  x = wide_rows(jax.random.key(3), 90, 64, jnp.bfloat16)
  out = layer(x)
  assert out.dtype == jnp.bfloat16
  expected = det_matmul(x, layer.kernel[...].astype(jnp.bfloat16))
  assert_bitwise_equal(out, expected, "DetLinear vs det_matmul")
  assert_bitwise_equal(layer(x[44:45]), out[44:45], "row 44 alone")


def test_gradients_reach_parameters():
  layer = DetLinear(16, 8, rngs=nnx.Rngs(4))
  x = jax.random.normal(jax.random.key(5), (6, 16))
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  ref = 2 * (x @ layer.kernel[...] + layer.bias[...])
  np.testing.assert_allclose(np.asarray(grads.kernel[...]), np.asarray(x.T @ ref), rtol=1e-4)
  np.testing.assert_allclose(np.asarray(grads.bias[...]), np.asarray(ref.sum(0)), rtol=1e-4)


def test_no_deprecated_flax_api():
  layer = DetLinear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(6))
  x = jax.random.normal(jax.random.key(7), (3, 16))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # e.g. flax's `Variable.value`
    layer(x)
    nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(layer)
