"""causal_attention with implementation="mosaic" (Hopper, TMA + wgmma): accuracy, decode =
prefill, padding and NaN garbage, bitwise, at shapes that are not multiples of the tiles
(batch, chunking, mode and run to run: tests/test_contract.py).

  PYTHONPATH=$PWD python -m pytest -q -m gpu tests/attention/test_attention_mosaic_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err
from helpers import attention_inputs as inputs

from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.attention.reference import attention_reference as reference64
from jaxrl_kernels.pallas import attention_mosaic

pytestmark = pytest.mark.hopper
IMPL = "mosaic"
HQ, D = 4, 128


def arange_pos(b, t):
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def attn(q, k, v, pos=None, kvl=None, impl=IMPL):
  return causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=impl)


def nan_cache(x, keep, s_cache):
  """x [B, T, H, D] in a cache of s_cache rows holding NaN past ``keep`` rows."""
  pad = jnp.pad(x, ((0, 0), (0, s_cache - x.shape[1]), (0, 0), (0, 0)),
                constant_values=jnp.nan)
  return jnp.where(jnp.arange(s_cache)[None, :, None, None] < keep, pad, jnp.nan)


@pytest.mark.parametrize("dtype,d,hkv,t", [
    (jnp.bfloat16, 128, HQ, 1000), (jnp.bfloat16, 64, 2, 777), (jnp.float16, 128, 1, 300),
    (jnp.float16, 64, HQ, 1024)])
def test_forward_accuracy(dtype, d, hkv, t):
  q, k, v = inputs(0, 2, t, HQ, hkv, d, dtype, spread=2)
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  out = attn(q, k, v, pos, kvl)
  ref = reference64(q, k, v, pos, kvl, d ** -0.5)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel_err(out, ref) <= TOL[jnp.dtype(dtype).name][0]


def test_lse_matches_triton_and_gradients():
  """The Mosaic forward's residuals drive the Triton backward: gradients within tolerance."""
  q, k, v = inputs(1, 2, 300, HQ, 2, D, jnp.bfloat16, spread=2)
  pos = arange_pos(2, 300)
  kvl = jnp.array([300, 211], jnp.int32)
  args = (q, k, v, pos, kvl)
  _, lse_m = attention_mosaic.forward(*args, scale=D ** -0.5)
  from jaxrl_kernels.pallas import attention_triton
  _, lse_t = attention_triton.forward(*args, scale=D ** -0.5, interpret=False)
  assert lse_m.shape == lse_t.shape == (2, HQ, 300)
  np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse_t), rtol=1e-4, atol=1e-3)
  d_out = jax.random.normal(jax.random.key(2), q.shape, jnp.bfloat16)
  out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, pos, kvl), q, k, v)
  grads = vjp(d_out)
  ref_out, ref_grads = reference64(q, k, v, pos, kvl, D ** -0.5, d_out)
  assert rel_err(out, ref_out) <= TOL["bfloat16"][0]
  for name, g, r in zip("qkv", grads, ref_grads):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert rel_err(g, r) <= TOL["bfloat16"][1], name


@pytest.mark.parametrize("dtype,d,hkv", [(jnp.bfloat16, 128, HQ), (jnp.bfloat16, 64, 2),
                                         (jnp.float16, 128, 1)])
def test_decode_equals_prefill_bitwise(dtype, d, hkv):
  t = 300
  q, k, v = inputs(3, 2, t, HQ, hkv, d, dtype)
  prefill = attn(q, k, v)
  for p in (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, t - 1):
    kc, vc = nan_cache(k, p + 1, t + 100), nan_cache(v, p + 1, t + 100)
    dec = attn(q[:, p:p + 1], kc, vc, jnp.full((2, 1), p, jnp.int32),
               jnp.full((2,), p + 1, jnp.int32))
    assert_bitwise_equal(dec[:, 0], prefill[:, p], f"position {p}")


def test_decode_equals_prefill_bitwise_4096():
  t = 4096
  q, k, v = inputs(4, 1, t, 2, 2, D, jnp.bfloat16)
  prefill = attn(q, k, v)
  for p in (0, 2047, 2048, 3333, t - 1):
    dec = attn(q[:, p:p + 1], nan_cache(k, p + 1, t + 64), nan_cache(v, p + 1, t + 64),
               jnp.full((1, 1), p, jnp.int32), jnp.full((1,), p + 1, jnp.int32))
    assert_bitwise_equal(dec[:, 0], prefill[:, p], f"position {p}")


def test_padding_packing_and_nan_garbage_bitwise():
  t = 260
  q, k, v = inputs(6, 2, t, HQ, HQ, D, jnp.bfloat16)
  prefill = attn(q, k, v)
  # Left padding: 37 queries at position -1 before the real ones; keys by position.
  pad = 37
  ql = jnp.pad(q, ((0, 0), (pad, 0), (0, 0), (0, 0)))
  pos = jnp.concatenate([jnp.full((2, pad), -1, jnp.int32), arange_pos(2, t)], 1)
  left = attn(ql, k, v, pos)
  assert_bitwise_equal(left[:, pad:], prefill, "left-padded")
  assert not np.any(bits(left[:, :pad])), "padding rows must be +0"
  # Packed / permuted: each query's place in its block must not matter.
  perm = np.random.default_rng(0).permutation(t)
  packed = attn(q[:, perm], k, v, arange_pos(2, t)[:, perm])
  assert_bitwise_equal(packed, prefill[:, perm], "permuted positions")
  # kv_lengths < S with NaN (K and V) past kv_len: finite and the same bits.
  n = 200
  kn, vn = nan_cache(k[:, :n], n, t + 77), nan_cache(v[:, :n], n, t + 77)
  short = attn(q[:, :n], kn, vn, arange_pos(2, n), jnp.full((2,), n, jnp.int32))
  assert np.all(np.isfinite(np.asarray(short, np.float32)))
  assert_bitwise_equal(short, prefill[:, :n], "NaN past kv_len")
  # Queries past kv_len see keys up to kv_len - 1 only.
  cut = attn(q, nan_cache(k[:, :n], n, t), nan_cache(v[:, :n], n, t), arange_pos(2, t),
             jnp.full((2,), n, jnp.int32))
  assert np.all(np.isfinite(np.asarray(cut, np.float32)))
  assert_bitwise_equal(cut[:, :n], prefill[:, :n], "rows below kv_len")
  for i in (n, n + 1, t - 1):
    assert_bitwise_equal(cut[:, i], attn(q[:, i:i + 1], k[:, :n], v[:, :n],
                                         jnp.full((2, 1), n - 1, jnp.int32))[:, 0], f"row {i}")


def test_default_and_routing():
  """Hopper default: mosaic for bf16 D=128, triton for a head dim mosaic does not take."""
  q, k, v = inputs(9, 1, 200, HQ, HQ, D, jnp.bfloat16)
  assert_bitwise_equal(attn(q, k, v, impl=None), attn(q, k, v, impl="mosaic"), "default")
  q, k, v = inputs(9, 1, 200, HQ, HQ, 96, jnp.bfloat16)
  assert_bitwise_equal(attn(q, k, v, impl=None), attn(q, k, v, impl="triton"), "D=96")
  with pytest.raises(ValueError, match="head dim 96"):
    attn(q, k, v, impl="mosaic")
  with pytest.raises(TypeError, match="mosaic"):
    attn(*(x.astype(jnp.float32) for x in (q, k, v)), impl="mosaic")
