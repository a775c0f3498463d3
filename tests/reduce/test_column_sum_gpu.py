"""The column form of det_sum's kernel and the fused RMSNorm weight gradient, compiled by
Triton at a Qwen2.5-0.5B training shape (16384 tokens x 896): bitwise det_sum over the rows
through the transposed row kernel and the XLA form, for every config, and run to run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, bits, wide_rows

from jaxrl_kernels.nn import rms_norm
from jaxrl_kernels.pallas import fixed_order, reduce_triton
from jaxrl_kernels.reduce import REDUCE_LANES, det_sum

T, N = 16384, 896
EPS = 1e-6


def _rows_xla(v):  # the XLA form of the row kernel's order, over v's rows (a transpose)
  return fixed_order.reduce_rows(v.T, op="sum", lanes=REDUCE_LANES, out_dtype=v.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_column_kernel_is_det_sum_over_rows_gpu(dtype):
  x = wide_rows(jax.random.key(0), N, T + 77, dtype).T  # rows: no multiple of the lanes
  cols = jax.jit(lambda x: det_sum(x, axis=0, implementation="triton"))
  got = cols(x)
  assert "kernel_cols" in str(jax.make_jaxpr(cols)(x))
  rows = jax.jit(lambda x: det_sum(x.T, axis=1, implementation="triton"))(x)
  assert_bitwise_equal(got, rows, "vs the transposed row kernel")
  assert_bitwise_equal(got, jax.jit(_rows_xla)(x), "vs the XLA form")
  for cfg in (dict(block_lanes=REDUCE_LANES), dict(block_cols=16, block_lanes=8, unroll=1),
              dict(block_cols=128, block_lanes=32, num_warps=8, num_stages=1)):
    c = reduce_triton.ColumnConfig(**cfg)
    out = jax.jit(lambda x, c=c: reduce_triton.reduce_cols(
        x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=False, config=c))(x)
    assert_bitwise_equal(out, got, f"{cfg}")
  for _ in range(20):
    assert_bitwise_equal(cols(x), got, "run to run")
  if dtype == "float32":  # control (a bf16 output's rounding can hide another order)
    stock = jax.jit(lambda x: jnp.sum(x, axis=0))(x)
    assert not np.array_equal(bits(stock), bits(got)), "XLA's column sum: another order"


def _norm_inputs(dtype):
  x = wide_rows(jax.random.key(1), N, T, dtype, spread=3).T
  g = wide_rows(jax.random.key(2), T, N, dtype, spread=6)
  w = (1 + 0.3 * jax.random.normal(jax.random.key(3), (N,))).astype(dtype)
  return g, x, w


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_norm_weight_gradient_gpu(dtype):
  g, x, w = _norm_inputs(dtype)

  @jax.jit
  def written(g, x):  # the products XLA writes, then det_sum through the transpose
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(EPS))
    prod = g.astype(jnp.float32) * (x32 * rstd)
    return (det_sum(prod.T, axis=1, implementation="triton"), _rows_xla(prod),
            rstd.reshape(-1))

  via_rows, via_xla, rstd = written(g, x)
  fused = jax.jit(lambda g, x, r: reduce_triton.product_reduce_cols(
      g, x, r, lanes=REDUCE_LANES, interpret=False))
  got = fused(g, x, rstd)
  assert_bitwise_equal(got, via_rows, "vs det_sum of the written products")
  assert_bitwise_equal(got, via_xla, "vs the XLA form")
  for _ in range(20):
    assert_bitwise_equal(fused(g, x, rstd), got, "run to run")

  # rms_norm's dw in a training program: its rstd is XLA's row mean compiled in that
  # program (the contract claims run-to-run bits for it, not batch invariance), so it is
  # checked against float64 and run to run; tests/test_golden.py pins its bits.
  grad = jax.jit(jax.grad(lambda w: jnp.sum(g.astype(jnp.float32) * rms_norm(
      x, w, eps=EPS, implementation="triton").astype(jnp.float32))))
  dw = grad(w)
  g64, x64 = np.asarray(g, np.float64), np.asarray(x, np.float64)
  terms = g64 * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
  err = np.abs(np.asarray(dw, np.float64) - terms.sum(0)) / np.abs(terms).sum(0)
  tol = 2e-5 if dtype == "float32" else 1e-2  # fp32: (128 + 7) rounding steps per sum
  assert err.max() < tol, f"rms_norm's dw vs float64: {err.max():.2e}"
  for _ in range(5):
    assert_bitwise_equal(grad(w), dw, "rms_norm's dw, run to run")
