"""causal_attention's Triton kernels on a CUDA GPU: accuracy of the forward (bf16 and fp32,
grouped-query heads) and of the gradients at realistic shapes.

Every invariance (decode = prefill up to T = 4096, batch, position, padding, packing,
chunked prefill, mode, run to run of the outputs and gradients) is tests/test_contract.py.

  python -m pytest -q -m gpu tests/attention/test_attention_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import nonfinite_cases as nonfinite
import numpy as np
import pytest
from helpers import TOL, rel_err
from helpers import attention_inputs as inputs

from jaxrl_kernels.attention import causal_attention

pytestmark = pytest.mark.gpu
IMPL = "triton"
B, T, HQ, HKV, D = 2, 1024, 8, 8, 128


def reference64(q, k, v, scale):
  """float64 causal attention on the host (default positions, Tq == S)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  t = q.shape[1]
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("hkv", [HKV, 2])
def test_forward_accuracy(hkv):
  q, k, v = inputs(0, B, T, HQ, hkv, D, jnp.bfloat16, spread=2)
  out = causal_attention(q, k, v, implementation=IMPL)
  assert rel_err(out, reference64(q, k, v, D ** -0.5)) <= TOL["bfloat16"][0]
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  out32 = causal_attention(q32[:, :256], k32[:, :256], v32[:, :256], implementation=IMPL)
  assert rel_err(out32, reference64(q32[:, :256], k32[:, :256], v32[:, :256], D ** -0.5)) <= 1e-5


def test_gradients_match_the_float32_reference():
  q, k, v = inputs(4, B, 512, HQ, 2, D, jnp.bfloat16, spread=2)
  f = jax.jit(lambda q, k, v: causal_attention(q, k, v, implementation=IMPL))
  _, vjp = jax.vjp(f, q, k, v)
  d_out = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)
  g1 = vjp(d_out)
  ref = lambda q, k, v: jnp.vdot(causal_attention(  # noqa: E731
      q, k, v, implementation="xla").astype(jnp.float32), d_out.astype(jnp.float32))
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  g_ref = jax.grad(ref, argnums=(0, 1, 2))(q32, k32, v32)
  for name, a, c in zip("qkv", g1, g_ref):
    assert rel_err(a, c) <= TOL["bfloat16"][1], name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(nonfinite.cases(5)))
def test_non_finite_scores_give_nan(case, dtype):
  """NaN or inf in q or a seen key, or an overflowing q . k: NaN outputs and gradients, as
  stock attention (tests/attention/nonfinite_cases.py); other rows keep their bits."""
  nonfinite.check_nan_propagates(IMPL, dtype, 5, 64, case)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_unseen_content_is_inert_and_layouts_give_nan(dtype):
  nonfinite.check_unseen_content_is_inert(IMPL, dtype, 5, 64)
  nonfinite.check_default_positions_and_decode(IMPL, dtype, 5, 64)
