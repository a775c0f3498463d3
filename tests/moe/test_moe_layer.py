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


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_static_arguments_and_dtypes_are_checked_for_every_implementation(impl):
  """k outside [1, E], a k or normalize of the wrong type, and weights of another dtype than
  x: errors naming moe_mlp's argument, on the stock path too (lax.top_k would take k=0 and
  fail later, or take k=True as 1)."""
  rng = np.random.default_rng(0)
  router, gate_up, down = _layer(rng)
  x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)

  def run(x=x, router=router, gate_up=gate_up, down=down, k=2, normalize=True):
    return moe_mlp(x, router, gate_up, down, k=k, normalize=normalize, implementation=impl)
  for k in (0, 9, -1):
    with pytest.raises(ValueError, match=rf"moe_mlp: k must be in \[1, 8\].*got {k}"):
      run(k=k)
  for k in (True, 2.0, np.float32(2)):
    with pytest.raises(TypeError, match="moe_mlp: k must be an integer"):
      run(k=k)
  with pytest.raises(TypeError, match="moe_mlp: normalize must be a bool"):
    run(normalize="False")
  assert jax.jit(lambda x: run(x, k=np.int64(2)).y)(x).shape == x.shape
  for name in ("router", "gate_up", "down"):
    bad = {"router": router, "gate_up": gate_up, "down": down}[name].astype(jnp.bfloat16)
    with pytest.raises(TypeError, match=f"moe_mlp: {name} has dtype bfloat16 but x float32"):
      run(**{name: bad})
  with pytest.raises(TypeError, match="moe_mlp: x must have dtype in"):
    run(x=x.astype(jnp.int32))
  with pytest.raises(TypeError, match="route: k must be an integer"):
    route(jnp.zeros((2, 4), jnp.float32), True, normalize=True)


@pytest.mark.parametrize("impl", [*IMPLS, "xla"])
def test_an_empty_batch_gives_empty_results(impl):
  """No tokens: empty outputs of the right shapes and dtypes, zero gradients (the grouped
  GEMM's kernels and the gathers would index an empty buffer)."""
  rng = np.random.default_rng(0)
  router, gate_up, down = _layer(rng)
  x = jnp.zeros((2, 0, 64), jnp.float32)

  def f(x, router, gate_up, down):
    return moe_mlp(x, router, gate_up, down, k=2, normalize=True, implementation=impl)
  out = f(x, router, gate_up, down)
  assert out.y.shape == x.shape and out.y.dtype == x.dtype
  assert out.logits.shape == out.probs.shape == (0, 8) and out.experts.shape == (0, 2)
  assert out.experts.dtype == jnp.int32 and out.probs.dtype == jnp.float32
  grads = jax.grad(lambda *a: jnp.sum(f(*a).y), argnums=(0, 1, 2, 3))(x, router, gate_up, down)
  for arg, grad in zip((x, router, gate_up, down), grads, strict=True):
    assert grad.shape == arg.shape and not np.asarray(grad).any()


def test_masked_nonfinite_rows_never_reach_the_router_losses():
  """A NaN or inf router row at a masked position changes neither loss nor any other row's
  gradient, bitwise (a select, never a multiplication by zero), and gets zero gradient (the
  load-balancing loss's by ``probs``, the z-loss's by ``logits``); with nothing unmasked (or
  no tokens) both losses are 0, never NaN."""
  rng = np.random.default_rng(9)
  logits = rng.standard_normal((12, 8)).astype(np.float32) * 3
  mask = np.ones(12, bool)
  mask[[2, 7]] = False
  bad = logits.copy()
  bad[2] = np.nan
  bad[7, 3] = np.inf

  @jax.jit
  def losses(logits, mask):
    _, experts, probs = route(logits, 2, normalize=True)

    def lb(probs):
      return load_balancing_loss(probs, experts, mask, implementation="cpu")

    def z(logits):
      return router_z_loss(logits, mask, implementation="cpu")
    return [jax.value_and_grad(lb)(probs), jax.value_and_grad(z)(logits)]

  for (v0, g0), (v1, g1) in zip(losses(logits, mask), losses(bad, mask), strict=True):
    assert np.isfinite(float(v1))
    assert_bitwise_equal(v1, v0, "loss")
    assert_bitwise_equal(np.asarray(g1)[mask], np.asarray(g0)[mask], "unmasked rows' gradient")
    assert not np.asarray(g1)[~mask].any(), "a masked row got a gradient"
  for (v, g) in losses(bad, np.zeros(12, bool)):
    assert float(v) == 0.0 and not np.asarray(g).any()
  empty = jnp.zeros((0, 8), jnp.float32)
  _, experts, probs = route(empty, 2, normalize=True)
  assert float(load_balancing_loss(probs, experts, implementation="cpu")) == 0.0
  assert float(router_z_loss(empty, implementation="cpu")) == 0.0


def test_router_losses_check_their_arguments():
  """Shapes that would broadcast silently (a mask of one entry, experts of other tokens)
  and expert ids outside [0, E) at unmasked tokens: errors naming the argument; traced, an
  out-of-range id gives a NaN loss, never a finite one."""
  rng = np.random.default_rng(10)
  logits = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
  _, experts, probs = route(logits, 2, normalize=True)
  mask = jnp.asarray([True, True, False, True, True, True])
  with pytest.raises(ValueError, match=r"load_balancing_loss: mask must have shape \(6,\)"):
    load_balancing_loss(probs, experts, jnp.ones((1,), bool))
  with pytest.raises(ValueError, match=r"load_balancing_loss: experts must have shape \(6, k\)"):
    load_balancing_loss(probs, experts[:5])
  with pytest.raises(ValueError, match="load_balancing_loss: probs must be"):
    load_balancing_loss(probs[0], experts)
  with pytest.raises(ValueError, match=r"router_z_loss: mask must have shape \(6,\)"):
    router_z_loss(logits, jnp.ones((6, 1), bool))
  wrong = experts.at[3, 1].set(4)
  with pytest.raises(ValueError, match=r"experts must lie in \[0, 4\), got 4 at index \(3, 1\)"):
    load_balancing_loss(probs, wrong, mask, implementation="cpu")
  traced = jax.jit(lambda p, e: load_balancing_loss(p, e, mask, implementation="cpu"))
  assert np.isnan(float(traced(probs, wrong)))
  assert_bitwise_equal(traced(probs, experts.at[2, 1].set(4)), traced(probs, experts),
                       "an id at a masked token")


@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_values_reach_only_the_tokens_that_use_them(impl):
  """A NaN token and NaN/inf weights of an expert no token picks (the layout's trailing
  tiles are that expert's, E - 1): every other token's experts, weights, output and input
  gradient keep their bits, and every other expert's weight gradient too."""
  rng = np.random.default_rng(11)
  router, gate_up, down = _layer(rng, h=32, i=16)
  router = router.at[:, 7].set(-100.0)  # expert 7 is never among the top 2
  x = jnp.asarray(np.abs(rng.standard_normal((40, 32))), jnp.float32)
  g = jnp.asarray(rng.standard_normal((40, 32)), jnp.float32)

  @jax.jit
  def run(x, gate_up, down):
    def f(x, router, gate_up, down):
      return moe_mlp(x, router, gate_up, down, k=2, normalize=True, implementation=impl)
    out = f(x, router, gate_up, down)
    grads = jax.grad(lambda *a: jnp.sum(f(*a).y * g), argnums=(0, 2, 3))(x, router, gate_up,
                                                                          down)
    return out, grads

  (out0, (dx0, dgu0, dd0)) = run(x, gate_up, down)
  assert not (np.asarray(out0.experts) == 7).any()
  out, (dx, dgu, dd) = run(x.at[5].set(jnp.nan), gate_up.at[7].set(jnp.nan),
                           down.at[7].set(jnp.inf))
  keep = np.arange(40) != 5
  np.testing.assert_array_equal(np.asarray(out.experts)[keep], np.asarray(out0.experts)[keep])
  assert np.isnan(np.asarray(out.y[5])).all()
  for name, a, b in (("y", out.y, out0.y), ("probs", out.probs, out0.probs), ("dx", dx, dx0)):
    assert_bitwise_equal(np.asarray(a)[keep], np.asarray(b)[keep], name)
  # The NaN token's experts, now (NaN gradients) and before (they lose its rows).
  hit = set(np.asarray(out.experts)[5].tolist()) | set(np.asarray(out0.experts)[5].tolist())
  assert len(hit) < 7
  for e in sorted(set(range(7)) - hit):
    assert_bitwise_equal(dgu[e], dgu0[e], f"d gate_up[{e}]")
    assert_bitwise_equal(dd[e], dd0[e], f"d down[{e}]")
  assert not np.asarray(dgu[7]).any() and not np.asarray(dd[7]).any()


def test_router_row_sums_are_not_fused_into_the_exponentials():
  """The router softmax (forward and backward) and the z-loss materialize their guarded
  exponentials before the fixed tree over the experts: fused, every leaf of the tree
  recomputed them and XLA's GPU compile of that fusion took ~50 s at 128 experts
  (docs/moe.md, "Compile time"). The barrier is what keeps it out."""
  logits = jnp.zeros((4, 128), jnp.float32)
  programs = {
      "router_probs": jax.jit(router_probs).lower(logits),
      "router_probs backward": jax.jit(jax.grad(lambda x: jnp.sum(router_probs(x) * x))).lower(
          logits),
      "router_z_loss": jax.jit(lambda x: router_z_loss(x, implementation="cpu")).lower(logits),
  }
  for name, lowered in programs.items():
    assert "optimization_barrier" in lowered.as_text(), f"{name}: no barrier before the tree"
