"""Bad and extreme input to linear_logp, its TP form and its sampler side: a named error or
the right answer, never a silent wrong value (one test per defect of the robustness probe)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.linear_logp import (
  check_targets,
  head_logits,
  linear_logp,
  logp_from_stats,
  pad_vocab,
  vocab_parallel_logp,
)
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

T, H, V = 12, 24, 200
IMPLS = ["cpu", "interpret", "xla"]


def _case(seed=0, t=T, h=H, v=V):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (t, h), jnp.float32)
  w = jax.random.normal(k[1], (h, v), jnp.float32) / np.sqrt(h) * 3
  tg = jax.random.randint(k[2], (t,), 0, v)
  b = jax.random.normal(k[3], (v,), jnp.float32)
  return x, w, tg, b


def test_ids_that_do_not_fit_int32_are_refused_before_any_cast():
  x, w, _, _ = _case(t=4)
  with pytest.raises(ValueError, match=r"targets must fit int32, got 4294967301 at index \(?3"):
    linear_logp(x, w, np.array([1, 2, 3, 2**32 + 5]), implementation="interpret")
  with pytest.raises(ValueError, match="4294967596"):
    check_targets(np.array([2**32 + 300]), V)


def test_check_targets_refuses_float_ids_and_float_vocab_size():
  with pytest.raises(TypeError, match="targets must have an integer dtype"):
    check_targets(np.array([0.5, 3.7]), V)
  with pytest.raises(TypeError, match="vocab_size must be an integer"):
    check_targets(np.array([0, 3]), 4.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_in_a_masked_row_reaches_no_output_and_no_gradient(impl, bad):
  """Before: with hidden[1] = NaN and mask[1] = False, all of dW and db were NaN."""
  x, w, tg, b = _case()
  mask = np.ones(T, bool)
  mask[1] = False
  gl = jnp.linspace(-1.0, 1.0, T)

  def run(x):
    def loss(x, w, b):
      lp, ent = linear_logp(x, w, tg, bias=b, mask=mask, return_entropy=True,
                            implementation=impl)
      return jnp.sum(lp * gl) + jnp.sum(ent), (lp, ent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)

  (_, (lp, ent)), (dx, dw, db) = run(x.at[1].set(bad))
  (_, (lp0, ent0)), (dx0, dw0, db0) = run(x.at[1].set(0.0))
  for name, a in (("logp", lp), ("entropy", ent), ("dH", dx), ("dW", dw), ("db", db)):
    assert np.all(np.isfinite(np.asarray(a))), name
  assert float(lp[1]) == 0 and float(ent[1]) == 0 and np.all(np.asarray(dx[1]) == 0)
  for name, a, a0 in (("logp", lp, lp0), ("dW", dw, dw0), ("db", db, db0), ("dH", dx, dx0)):
    assert_bitwise_equal(a, a0, f"{name}: masked row's content")


def test_nan_in_a_masked_row_under_tensor_parallelism():
  x, w, tg, b = _case(seed=1)
  mask = np.ones(T, bool)
  mask[2] = False
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  fn = functools.partial(vocab_parallel_logp, mesh=mesh, weight_spec=P(None, "tp"),
                         vocab_size=V, implementation="cpu")
  wp, bp = pad_vocab(w, 2, bias=b)

  def loss(x, w, b):
    return jnp.sum(fn(x, w, tg, mask=mask, bias=b))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.at[2].set(jnp.nan), wp, bp)
  ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.at[2].set(0.0), wp, bp)
  for name, g, r in zip(("dH", "dW", "db"), grads, ref):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert_bitwise_equal(g, r, f"TP {name}: masked row's content")


def test_sampler_path_masks_a_nan_row():
  x, w, tg, _ = _case(seed=2)
  mask = np.ones(T, bool)
  mask[0] = False
  z, stats = head_logits(x.at[0].set(jnp.nan), w, return_stats=True, implementation="cpu")
  lp = logp_from_stats(z, stats, tg, mask=mask)
  assert float(lp[0]) == 0 and np.all(np.isfinite(np.asarray(lp)))


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_hidden_size_gives_the_bias_softmax(impl):
  """H = 0: the logits are bias / temperature (the empty sum); before, interpret raised
  ZeroDivisionError and "xla" ignored the bias."""
  _, _, tg, b = _case(t=5)
  x = jnp.zeros((5, 0), jnp.float32)
  w = jnp.zeros((0, V), jnp.float32)
  lp, ent = linear_logp(x, w, tg, bias=b, temperature=0.5, return_entropy=True,
                        implementation=impl)
  ref = linear_logp_reference(np.zeros((5, 1)), np.zeros((1, V)), tg, bias=b, temperature=0.5,
                              g_logp=np.ones(5))
  np.testing.assert_allclose(np.asarray(lp), ref["logp"], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), ref["entropy"], rtol=1e-5)
  dx, db = jax.grad(lambda x, b: jnp.sum(linear_logp(x, w, tg, bias=b, temperature=0.5,
                                                     implementation=impl)), argnums=(0, 1))(x, b)
  assert dx.shape == (5, 0)
  np.testing.assert_allclose(np.asarray(db), ref["db"], rtol=1e-4, atol=1e-6)


def test_layout_strings_are_validated_everywhere():
  x, w, tg, _ = _case()
  with pytest.raises(ValueError, match="pad_vocab: weight_layout must be one of"):
    pad_vocab(w, 8, weight_layout="HV")
  with pytest.raises(ValueError, match="linear_logp: weight_layout must be one of"):
    linear_logp(x, w, tg, weight_layout="HV")
  with pytest.raises(ValueError, match="head_logits: weight_layout must be one of"):
    head_logits(x, w, weight_layout="VH")


def test_masks_as_lists_and_0_1_numbers():
  x, w, tg, _ = _case(seed=3)
  m = [True] * T
  m[4] = False
  ref = linear_logp(x, w, tg, mask=jnp.asarray(m), implementation="interpret")
  assert_bitwise_equal(linear_logp(x, w, tg, mask=m, implementation="interpret"), ref,
                       "list mask")
  for dtype in (np.float32, np.int32):
    mk = np.asarray(m, dtype)
    assert_bitwise_equal(linear_logp(x, w, tg, mask=mk, implementation="interpret"), ref,
                         f"{dtype.__name__} 0/1 mask")
  with pytest.raises(ValueError, match=r"mask must be bool or hold only 0 and 1, got 0\.5"):
    linear_logp(x, w, tg, mask=np.full(T, 0.5, np.float32), implementation="interpret")


@pytest.mark.parametrize("temperature,exc,match", [
    (np.array([1.0, 2.0]), TypeError, r"temperature must be a scalar, got an array of shape"),
    (True, TypeError, "temperature must be a real number"),
    (np.float32(np.nan), ValueError, "temperature must be finite"),
])
def test_bad_temperatures_are_named(temperature, exc, match):
  x, w, tg, _ = _case()
  with pytest.raises(exc, match=match):
    linear_logp(x, w, tg, temperature=temperature, implementation="interpret")
  with pytest.raises(exc, match=match):
    head_logits(x, w, temperature=temperature, implementation="interpret")


def test_forward_mode_autodiff_is_refused_by_name():
  x, w, tg, _ = _case()
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: linear_logp(x, w, tg, implementation="cpu"), (x,), (x,))
  assert "Forward-mode autodiff" in linear_logp.__doc__


@pytest.mark.parametrize("impl", ["interpret", "cpu", "xla"])
def test_sampler_side_functions_refuse_to_be_differentiated(impl):
  """head_logits(return_stats=True), logp_from_stats and logits_logp have no gradient:
  differentiating through them raises, naming the function (their outputs once carried
  stop_gradient: a silent zero, or for logp_from_stats a partial derivative); a derivative
  with respect to something else still runs."""
  from jaxrl_kernels.linear_logp import logits_logp

  h = jax.random.normal(jax.random.key(0), (4, 16))
  w = jax.random.normal(jax.random.key(1), (16, 40))
  t = jnp.arange(4)
  with pytest.raises(TypeError, match="head_logits: return_stats=True has no gradient"):
    jax.grad(lambda h: jnp.sum(head_logits(h, w, return_stats=True, implementation=impl)[0]))(h)
  z, stats = head_logits(h, w, return_stats=True, implementation=impl)
  with pytest.raises(TypeError, match="logp_from_stats: logits has no gradient"):
    jax.grad(lambda z: jnp.sum(logp_from_stats(z, stats, t)))(z)
  if impl != "xla":
    with pytest.raises(TypeError, match="logits_logp: logits has no gradient"):
      jax.grad(lambda z: jnp.sum(logits_logp(z, t, implementation=impl)))(z)
    lp = logits_logp(z, t, implementation=impl)
    g = jax.grad(lambda a: a * jnp.sum(logits_logp(z, t, implementation=impl)))(1.0)
    assert float(g) == float(jnp.sum(lp))
  # the differentiable head still differentiates
  dh = jax.grad(lambda h: jnp.sum(head_logits(h, w, implementation=impl)))(h)
  assert np.allclose(np.asarray(dh), np.broadcast_to(np.asarray(w).sum(1), (4, 16)), rtol=1e-5)


@pytest.mark.parametrize("impl,dtype,tol", [
    ("cpu", jnp.float32, 2e-5), ("interpret", jnp.float32, 2e-5),
    pytest.param("triton", jnp.bfloat16, 2e-2, marks=pytest.mark.gpu),
    pytest.param("mosaic", jnp.bfloat16, 2e-2, marks=pytest.mark.hopper)])
def test_a_bias_masking_whole_vocab_tiles_gives_the_log_probs(impl, dtype, tol):
  """A ``-inf`` bias over a whole vocabulary tile (128 ids) and over single ids of other
  tiles (masking tokens): log-probs, entropy and every gradient equal the float64 softmax
  over the unmasked ids (of the inputs as given, bf16 on the GPU kernels), where the
  kernels gave NaN (a tile's ``exp(-inf - -inf)``, and ``0 * -inf`` in the entropy
  terms). A target on a masked id gets ``-inf``, as from the reference softmax; the sampler
  side (``head_logits`` statistics) gives the trainer's bits."""
  t, h, v = 9, 16, 300
  x, w, _, b = _case(seed=5, t=t, h=h, v=v)
  x, w = x.astype(dtype), w.astype(dtype)
  masked = np.zeros(v, bool)
  masked[128:256] = True
  masked[[3, 77, 260]] = True
  b = jnp.where(jnp.asarray(masked), -jnp.inf, b)
  keep = np.flatnonzero(~masked)
  tg = jnp.asarray(keep[np.arange(t) * 7 % keep.size])
  g_logp = jax.random.normal(jax.random.key(11), (t,), jnp.float32)
  g_ent = jax.random.normal(jax.random.key(12), (t,), jnp.float32)

  def loss(x, w, b):
    lp, ent = linear_logp(x, w, tg, bias=b, return_entropy=True, implementation=impl)
    return jnp.sum(lp * g_logp + ent * g_ent), (lp, ent)

  (_, (lp, ent)), (dx, dw, db) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x, w, b)
  remap = np.full(v, -1)
  remap[keep] = np.arange(keep.size)
  ref = linear_logp_reference(np.asarray(x, np.float64), np.asarray(w, np.float64)[:, keep],
                              remap[np.asarray(tg)],
                              bias=np.asarray(b)[keep], g_logp=np.asarray(g_logp),
                              g_ent=np.asarray(g_ent))
  want_dw = np.zeros((h, v))
  want_dw[:, keep] = ref["dw"]
  want_db = np.zeros(v)
  want_db[keep] = ref["db"]
  for got, want, name in ((lp, ref["logp"], "logp"), (ent, ref["entropy"], "entropy"),
                          (dx, ref["dh"], "dh"), (dw, want_dw, "dw"), (db, want_db, "db")):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), name
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=name)
  on_masked = linear_logp(x, w, jnp.full((t,), 130), bias=b, implementation=impl)
  assert np.all(np.asarray(on_masked) == -np.inf)
  z, stats = head_logits(x, w, bias=b, return_stats=True, implementation=impl)
  assert_bitwise_equal(logp_from_stats(z, stats, tg), lp, "sampler side == trainer")
  assert_bitwise_equal(stats.entropy, ent, "sampler entropy == trainer")
