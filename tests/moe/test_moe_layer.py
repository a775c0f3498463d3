"""Mixture-of-experts routing and layer: float64 references, ties, NaN, invariance bitwise
(with the stock path as the control that fails), gradients, router losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err

from jaxrl_kernels.moe import load_balancing_loss, moe_mlp, route, router_probs, router_z_loss

IMPLS = ("cpu", "interpret")


def _softmax64(logits):
  l64 = np.asarray(logits, np.float64)
  p = np.exp(l64 - l64.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _layer(rng, h=64, e=8, i=32, dtype="float32"):
  router = jnp.asarray(rng.standard_normal((h, e)) * 0.3, dtype)
  gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * i)) * 0.1, dtype)
  down = jnp.asarray(rng.standard_normal((e, i, h)) * 0.1, dtype)
  return router, gate_up, down


def _moe64(x, router, gate_up, down, k, normalize):
  """float64 reference of the layer (transformers' semantics, no intermediate rounding)."""
  x64 = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
  r, gu, dn = (np.asarray(a, np.float64) for a in (router, gate_up, down))
  p = _softmax64(x64 @ r)
  idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(p, idx, -1)
  if normalize:
    w = w / w.sum(-1, keepdims=True)
  y = np.zeros_like(x64)
  for t in range(x64.shape[0]):
    for j in range(k):
      a = x64[t] @ gu[idx[t, j]]
      g, u = a[0::2], a[1::2]
      y[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ dn[idx[t, j]])
  return y.reshape(np.shape(x))


def test_router_probs_and_its_gradient_match_float64():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((7, 12)) * 4, jnp.float32)
  g = rng.standard_normal((7, 12))
  p, vjp = jax.vjp(router_probs, logits)
  ref = _softmax64(logits)
  assert rel_err(p, ref) < 1e-6
  dref = ref * (g - (g * ref).sum(-1, keepdims=True))
  assert rel_err(vjp(jnp.asarray(g, jnp.float32))[0], dref) < 1e-6


@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_float64_and_ties_go_to_the_lowest_expert(normalize):
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((16, 10)).astype(np.float32)
  logits[3] = 0.5  # all tied: experts 0, 1, 2
  logits[4, [2, 7, 9]] = 9.0  # a three-way tie for the top: 2, 7, then 9
  w, e, p = route(jnp.asarray(logits), 3, normalize=normalize)
  ref_p = _softmax64(logits)
  ref_e = np.argsort(-ref_p, axis=-1, kind="stable")[:, :3]
  np.testing.assert_array_equal(e, ref_e)
  np.testing.assert_array_equal(e[3], [0, 1, 2])
  np.testing.assert_array_equal(e[4], [2, 7, 9])
  ref_w = np.take_along_axis(ref_p, ref_e, -1)
  if normalize:
    ref_w = ref_w / ref_w.sum(-1, keepdims=True)
  assert rel_err(w, ref_w) < 1e-6
  assert rel_err(p, ref_p) < 1e-6


def test_route_keeps_nan_and_checks_k():
  logits = jnp.zeros((2, 4), jnp.float32).at[1, 2].set(jnp.nan)
  w, _, _ = route(logits, 2, normalize=True)
  assert np.isfinite(np.asarray(w[0])).all() and np.isnan(np.asarray(w[1])).all()
  with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
    route(logits, 5, normalize=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("normalize", [True, False])
def test_layer_matches_float64(impl, dtype, normalize):
  rng = np.random.default_rng(2)
  router, gate_up, down = _layer(rng, dtype=dtype)
  x = jnp.asarray(rng.standard_normal((3, 11, 64)), dtype)
  out = moe_mlp(x, router, gate_up, down, k=2, normalize=normalize, implementation=impl)
  assert out.y.shape == x.shape and out.y.dtype == x.dtype
  # bf16: the reference routes the bf16-rounded router logits, as the layer does.
  ref = _moe64(x, router, gate_up, down, 2, normalize)
  assert rel_err(out.y, ref) < TOL[dtype][0] * (1 if dtype == "float32" else 3)


def test_dropless_when_every_token_picks_one_expert():
  """No capacity: 300 tokens on one expert (several of its tiles), none dropped."""
  rng = np.random.default_rng(3)
  _, gate_up, down = _layer(rng)
  router = jnp.zeros((64, 8), jnp.float32).at[0, 5].set(10.0)
  x = jnp.asarray(rng.standard_normal((300, 64)), jnp.float32).at[:, 0].set(1.0)
  out = moe_mlp(x, router, gate_up, down, k=1, normalize=True, implementation="cpu")
  assert (np.asarray(out.experts) == 5).all()
  assert rel_err(out.y, _moe64(x, router, gate_up, down, 1, True)) < 1e-5


@pytest.mark.parametrize("impl,dtype", [
    ("cpu", "float32"), ("interpret", "float32"), ("cpu", "bfloat16"),
    pytest.param("interpret", "bfloat16", marks=pytest.mark.slow)])
def test_a_tokens_output_and_gradient_do_not_depend_on_the_batch(impl, dtype):
  """A few tokens alone, then among 1 and 70 others: the layer's
  output, router choice and input gradient of those tokens are bitwise equal."""
  rng = np.random.default_rng(4)
  router, gate_up, down = _layer(rng, dtype=dtype)
  probe = jnp.asarray(rng.standard_normal((5, 64)) * 2.0 ** rng.integers(-6, 7, (5, 1)), dtype)
  g = jnp.asarray(rng.standard_normal((5, 64)), dtype)

  def run(x):
    def f(x):
      return moe_mlp(x, router, gate_up, down, k=2, normalize=True, implementation=impl)
    out, vjp = jax.vjp(lambda x: f(x).y, x)
    return out, f(x).experts, vjp(jnp.zeros_like(out).at[-5:].set(g))[0]

  y0, e0, dx0 = run(probe)
  for others in (1, 70):
    x = jnp.concatenate([jnp.asarray(rng.standard_normal((others, 64)), dtype), probe])
    y, e, dx = run(x)
    np.testing.assert_array_equal(e[-5:], e0)
    assert_bitwise_equal(y[-5:], y0, f"{others} others")
    assert_bitwise_equal(dx[-5:], dx0, f"{others} others, dx")


def test_stock_layer_depends_on_the_batch():
  """The control: the stock path (XLA router product, softmax, top_k, ragged_dot, an
  unguarded combine) gives a token other bits alone than in its batch."""
  rng = np.random.default_rng(4)
  router, gate_up, down = _layer(rng, h=256, e=16, i=128)
  x = jnp.asarray(rng.standard_normal((200, 256)) * 2.0 ** rng.integers(-8, 9, (1, 256)),
                  jnp.float32)
  f = jax.jit(lambda x: moe_mlp(x, router, gate_up, down, k=2, normalize=True,
                                implementation="xla").y)
  full = bits(f(x))
  differs = sum(not np.array_equal(bits(f(x[r:r + 1])), full[r:r + 1]) for r in range(0, 200, 7))
  assert differs, "the stock MoE layer was batch-invariant here: the control shows nothing"


@pytest.mark.parametrize("normalize", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_gradients_agree_with_the_stock_autodiff(normalize):
  """The hand-written VJPs (router softmax, grouped GEMM, combine) against plain JAX
  autodiff of the stock path, to float32 rounding."""
  rng = np.random.default_rng(6)
  router, gate_up, down = _layer(rng)
  x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)

  def loss(impl):
    return lambda *a: jnp.sum(jnp.sin(moe_mlp(*a, k=2, normalize=normalize,
                                              implementation=impl).y))
  ours = jax.grad(loss("cpu"), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
  stock = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
  for name, a, b in zip(("x", "router", "gate_up", "down"), ours, stock, strict=True):
    assert rel_err(a, np.asarray(b)) < 1e-5, name
  again = jax.grad(loss("cpu"), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
  for a, b in zip(ours, again, strict=True):
    assert_bitwise_equal(a, b, "run to run")


def test_router_losses_match_float64():
  rng = np.random.default_rng(7)
  logits = jnp.asarray(rng.standard_normal((30, 8)) * 2, jnp.float32)
  mask = jnp.asarray(rng.random(30) < 0.7)
  _, experts, probs = route(logits, 2, normalize=True)
  p64, m = _softmax64(logits), np.asarray(mask, np.float64)
  onehot = (np.asarray(experts)[..., None] == np.arange(8)).astype(np.float64)
  f = (onehot * m[:, None, None]).sum(0) / m.sum()
  want = 8 * (f * ((p64 * m[:, None]).sum(0) / m.sum())[None]).sum()
  got = load_balancing_loss(probs, experts, mask, implementation="cpu")
  assert abs(float(got) - want) < 1e-6 * want
  l64 = np.asarray(logits, np.float64)
  lse = l64.max(-1) + np.log(np.exp(l64 - l64.max(-1, keepdims=True)).sum(-1))
  zwant = (lse ** 2 * m).sum() / m.sum()
  assert abs(float(router_z_loss(logits, mask, implementation="cpu")) - zwant) < 1e-6 * zwant
  assert_bitwise_equal(load_balancing_loss(probs, experts, mask, implementation="cpu"), got)


def test_layer_checks_shapes():
  rng = np.random.default_rng(0)
  router, gate_up, down = _layer(rng)
  with pytest.raises(ValueError, match="router"):
    moe_mlp(jnp.zeros((2, 32)), router, gate_up, down, k=2, normalize=True,
            implementation="cpu")
