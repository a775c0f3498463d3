"""causal_attention's Mosaic kernel (Hopper, TMA + wgmma): what only this backend has to
prove.

Forward accuracy against float64 at shapes that are not multiples of its tiles, its
logsumexp residual driving the Triton backward (gradients within tolerance), and its place
in the dispatch table (the Hopper default for bf16/fp16 at head dims 64 and 128, Triton
otherwise, clear errors). Every invariance (decode = prefill up to T = 4096, padding,
packing and NaN garbage, batch, chunking, mode, run to run) is tests/test_contract.py.

  python -m pytest -q -m gpu tests/attention/test_attention_mosaic_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err
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
