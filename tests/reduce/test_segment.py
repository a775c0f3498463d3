"""``take_rows`` / ``segment_rows_add``: an embedding lookup whose gradient adds the tokens'
rows in a fixed order (XLA's GPU scatter-add uses atomics: run-to-run bits change)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, rel_err

from jaxrl_kernels.nn.norm import rms_norm
from jaxrl_kernels.reduce.segment import segment_rows_add, take_rows


def _case(seed=0, n=300, rows=17, d=24, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.standard_normal((rows, d)), dtype)
  ids = jnp.asarray(rng.integers(0, rows, n), jnp.int32)
  g = jnp.asarray(rng.standard_normal((n, d)) * 2.0 ** rng.integers(-10, 11, (n, 1)), jnp.float32)
  return table, ids, g


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_take_and_the_gradient_is_the_scatter_add(dtype):
  table, ids, g = _case(dtype=dtype)
  assert_bitwise_equal(take_rows(table, ids), jnp.take(table, ids, axis=0), "forward")
  grad = jax.grad(lambda t: jnp.sum(take_rows(t, ids).astype(jnp.float32) * g))(table)
  ref = np.zeros(table.shape, np.float64)
  np.add.at(ref, np.asarray(ids), np.asarray(g, np.float64))
  assert grad.dtype == table.dtype
  assert rel_err(grad, ref) <= (1e-6 if dtype == jnp.float32 else 4e-3)


def test_out_of_range_ids_are_dropped():
  table, ids, g = _case(seed=1)
  bad = ids.at[0].set(table.shape[0]).at[1].set(-1)
  out = segment_rows_add(jnp.zeros(table.shape), bad, g)
  ref = np.zeros(table.shape, np.float64)
  np.add.at(ref, np.asarray(ids[2:]), np.asarray(g[2:], np.float64))
  assert rel_err(out, ref) <= 1e-6


@pytest.mark.gpu
def test_gpu_embedding_and_norm_weight_gradients_repeat_bitwise():
  """On the GPU: the embedding gradient (many tokens per id) and rms_norm's weight gradient
  (a sum over 16384 rows) keep their bits over 10 runs; the stock scatter-add's run-to-run
  spread is reported beside them."""
  table, ids, g = _case(seed=3, n=16384, rows=64, d=256)
  ours = jax.jit(jax.grad(lambda t: jnp.sum(take_rows(t, ids) * g)))
  stock = jax.jit(jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * g)))
  x = jnp.asarray(np.random.default_rng(4).standard_normal((16384, 512)), jnp.bfloat16)
  w = jnp.ones((512,), jnp.float32)
  norm = jax.jit(jax.grad(lambda x, w: jnp.sum(
      rms_norm(x, w, eps=1e-6, implementation="triton").astype(jnp.float32) ** 2),
      argnums=1))
  first, first_w = ours(table), norm(x, w)
  stock_first = np.asarray(stock(table))
  stock_differ = 0
  for _ in range(10):
    assert_bitwise_equal(ours(table), first, "embedding gradient")
    assert_bitwise_equal(norm(x, w), first_w, "rms_norm weight gradient")
    stock_differ += int(not np.array_equal(np.asarray(stock(table)), stock_first))
  print(f"stock scatter-add: {stock_differ} of 10 runs differ from the first")
