"""``rl.linear_policy_loss`` / ``linear_objective``: the policy loss fused into the LM head.

Claims: the per-token ``logp`` / ``entropy`` are bitwise ``linear_logp``'s; the loss, the
metrics and the gradients of ``jax.grad(loss)`` equal the unfused composition
``policy_loss(linear_logp(...))`` to float rounding (the same kernels get the same per-token
cotangents; the objective's XLA code is compiled into another program); dH rows are
batch-invariant and dW deterministic run to run; the float64 truth is met; ``jax.checkpoint``,
a scaled loss and data-parallel ``shard_map`` compose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err

import jaxrl_kernels as jk
from jaxrl_kernels import rl
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.linear_logp.objective import CHECKPOINT_NAME, linear_objective
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

B, T, H, V = 3, 11, 48, 300


def _inputs(dtype, *, seed=0, b=B, t=T, h=H, v=V):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, t, h)) * 2.0 ** rng.integers(-4, 5, (b, t, 1))
  hidden = jnp.asarray(x, dtype)
  weight = jnp.asarray(rng.standard_normal((h, v)) * 0.2, dtype)
  bias = jnp.asarray(rng.standard_normal(v) * 0.5, dtype)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.asarray(np.arange(t)[None] < rng.integers(2, t + 1, (b, 1)))
  logp = jk.linear_logp(hidden, weight, targets)
  old = logp + jnp.asarray(rng.standard_normal((b, t)) * 0.3, jnp.float32)
  ref = logp + jnp.asarray(rng.standard_normal((b, t)) * 0.3, jnp.float32)
  adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
  return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, old=old,
              ref=ref, adv=adv)


def _fused(d, impl, *, use_bias, temperature, **kw):
  def f(hidden, weight, bias):
    return rl.linear_policy_loss(hidden, weight, d["targets"], old_logp=d["old"],
                                 advantages=d["adv"], mask=d["mask"],
                                 bias=bias if use_bias else None, temperature=temperature,
                                 implementation=impl, **kw)
  return f


def _unfused(d, impl, *, use_bias, temperature, **kw):
  def f(hidden, weight, bias):
    logp, ent = jk.linear_logp(hidden, weight, d["targets"], mask=d["mask"],
                               bias=bias if use_bias else None, temperature=temperature,
                               return_entropy=True, implementation=impl)
    loss, metrics = rl.policy_loss(logp, d["old"], d["adv"], entropy=ent, mask=d["mask"], **kw)
    return loss, dict(metrics, logp=logp, entropy=ent)
  return f


def _value_and_grads(f, d):
  g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  return g(d["hidden"], d["weight"], d["bias"])


CASES = [  # implementation, dtype, bias, temperature, objective kwargs
    ("cpu", "float32", True, 0.7, dict(beta=0.05, entropy_coef=0.01, dual_clip=3.0)),
    ("cpu", "bfloat16", False, 1.0, dict(beta=0.04, kl_kind="k2", token_level=False)),
    ("cpu", "float32", False, 1.3, dict(entropy_coef=0.0, clip_high=0.28, denominator=7.0)),
    ("cpu", "float32", True, 1.0, dict(objective="gspo", entropy_coef=0.02)),
    # The interpreted kernels: in CI through the golden digest (tests/golden_cases.py).
    pytest.param("interpret", "float32", True, 0.7, dict(beta=0.05, entropy_coef=0.01),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("impl,dtype,use_bias,temperature,kw", CASES)
def test_fused_matches_the_unfused_composition(impl, dtype, use_bias, temperature, kw):
  d = _inputs(dtype)
  kw = dict(kw)
  if kw.get("objective") == "gspo":
    kw["segment_ids"] = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    kw["ref_logp"] = d["ref"]
  elif "beta" in kw:
    kw["ref_logp"] = d["ref"]
  fused = _fused(d, impl, use_bias=use_bias, temperature=temperature, **kw)
  unfused = _unfused(d, impl, use_bias=use_bias, temperature=temperature, **kw)
  (loss_f, m_f), g_f = _value_and_grads(fused, d)
  (loss_u, m_u), g_u = _value_and_grads(unfused, d)
  assert np.isfinite(float(loss_f))
  assert abs(float(loss_f) - float(loss_u)) <= 1e-6 * max(1.0, abs(float(loss_u)))
  assert sorted(m_f) == sorted(m_u)
  # Per token: the head's own bits. Scalars: XLA sums (float rounding between programs).
  assert_bitwise_equal(m_f["logp"], m_u["logp"], "logp")
  assert_bitwise_equal(m_f["entropy"], m_u["entropy"], "entropy")
  for name in m_u:
    np.testing.assert_allclose(np.asarray(m_f[name]), np.asarray(m_u[name]), rtol=1e-6,
                               atol=1e-7, err_msg=name)
  grad_tol = 1e-6 if dtype == "float32" else 8e-3  # a 16-bit dW may round the other way
  for name, a, b in zip(("dhidden", "dweight", "dbias"), g_f, g_u):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert rel_err(a, np.asarray(b, np.float64)) <= grad_tol, name
  assert float(jnp.max(jnp.abs(g_f[0].astype(jnp.float32)))) > 0
  # Without a gradient (evaluation): the same loss and log-probs, one pass.
  loss_p, m_p = jax.jit(fused)(d["hidden"], d["weight"], d["bias"])
  assert abs(float(loss_p) - float(loss_f)) <= 1e-6 * max(1.0, abs(float(loss_f)))
  assert_bitwise_equal(m_p["logp"], m_f["logp"], "primal logp")
  # The per-token logp is linear_logp's (the sampler's), masked tokens 0.
  lp = jk.linear_logp(d["hidden"], d["weight"], d["targets"], mask=d["mask"],
                      bias=d["bias"] if use_bias else None, temperature=temperature,
                      implementation=impl)
  assert_bitwise_equal(m_f["logp"], lp, "logp vs linear_logp")


def test_gradient_meets_the_float64_truth():
  d = _inputs("float32", seed=1)
  kw = dict(ref_logp=d["ref"], beta=0.05, entropy_coef=0.01)
  fused = _fused(d, "cpu", use_bias=True, temperature=0.7, **kw)
  (loss, m), (dh, dw, db) = _value_and_grads(fused, d)
  ref = linear_logp_reference(d["hidden"], d["weight"], d["targets"], bias=d["bias"],
                              temperature=0.7, mask=d["mask"])
  assert rel_err(m["logp"], ref["logp"]) <= TOL["float32"][0]
  assert rel_err(m["entropy"], ref["entropy"]) <= TOL["float32"][0]
  # The objective's per-token cotangents at the float64 log-probs, then the head in float64.
  lp64, ent64 = (jnp.asarray(ref[k], jnp.float32) for k in ("logp", "entropy"))
  g_logp, g_ent = jax.grad(lambda lp, en: rl.policy_loss(lp, d["old"], d["adv"], entropy=en,
                                                         mask=d["mask"], **kw)[0],
                           argnums=(0, 1))(lp64, ent64)
  ref = linear_logp_reference(d["hidden"], d["weight"], d["targets"], bias=d["bias"],
                              temperature=0.7, mask=d["mask"], g_logp=g_logp, g_ent=g_ent)
  loss64 = rl.policy_loss(lp64, d["old"], d["adv"], entropy=ent64, mask=d["mask"], **kw)[0]
  assert abs(float(loss) - float(loss64)) <= 1e-5 * max(1.0, abs(float(loss64)))
  grad_tol = TOL["float32"][1]
  assert rel_err(dh, ref["dh"]) <= grad_tol
  assert rel_err(dw, ref["dw"]) <= grad_tol
  assert rel_err(db, ref["db"]) <= grad_tol


def test_dh_rows_batch_invariant_dw_deterministic_and_the_stock_control():
  d = _inputs("float32", seed=2, b=1, t=150)
  adv = jnp.linspace(-1.0, 1.0, 150, dtype=jnp.float32)[None]  # per token

  def grads(n):
    def f(hidden, weight):
      return rl.linear_policy_loss(hidden, weight, d["targets"][:, :n], old_logp=d["old"][:, :n],
                                   advantages=adv[:, :n], mask=d["mask"][:, :n],
                                   denominator=64.0, entropy_coef=0.01, temperature=0.7,
                                   implementation="cpu")[0]
    return jax.jit(jax.grad(f, argnums=(0, 1)))(d["hidden"][:, :n], d["weight"])

  dh, dw = grads(150)
  for n in (1, 37, 129):
    assert_bitwise_equal(grads(n)[0], dh[:, :n], f"dh rows at {n} tokens")
  for _ in range(3):
    assert_bitwise_equal(grads(150)[1], dw, "dW run to run")
  # Control: the materialized XLA head's log-probs change bits with the batch.
  f = jax.jit(lambda h, w, t: jk.linear_logp(h, w, t, implementation="xla"))
  h2, t2 = d["hidden"][0], d["targets"][0]
  full = np.asarray(f(h2, d["weight"], t2))
  changed = [m for m in (1, 3, 7, 50, 129)
             if not np.array_equal(bits(f(h2[:m], d["weight"], t2[:m])), bits(full[:m]))]
  assert changed, "the materialized XLA path gave the same bits at every batch size here"


def test_a_scaled_loss_scales_the_gradient_and_checkpoint_composes():
  d = _inputs("float32", seed=3)
  kw = dict(ref_logp=d["ref"], beta=0.05, entropy_coef=0.01)
  fused = _fused(d, "cpu", use_bias=False, temperature=1.0, **kw)
  unfused = _unfused(d, "cpu", use_bias=False, temperature=1.0, **kw)
  args = (d["hidden"], d["weight"], d["bias"])
  g1 = jax.jit(jax.grad(lambda *a: fused(*a)[0], argnums=(0, 1)))(*args)
  for scale in (0.5, 4.0, 3.0):  # powers of two scale exactly
    g = jax.jit(jax.grad(lambda *a, s=scale: s * fused(*a)[0], argnums=(0, 1)))(*args)
    for name, a, b in zip(("dhidden", "dweight"), g, g1):
      want = np.asarray(b, np.float32) * np.float32(scale)
      if scale == 3.0:
        assert rel_err(a, want.astype(np.float64)) <= 1e-6, name
      else:
        assert_bitwise_equal(a, want, f"{name} at loss scale {scale}")
  gu = jax.jit(jax.grad(lambda *a: unfused(*a)[0], argnums=(0, 1)))(*args)
  assert rel_err(g1[0], np.asarray(gu[0], np.float64)) <= 1e-6
  # jax.checkpoint around the head: the same gradients, recomputed or saved by name.
  policy = jax.checkpoint_policies.save_only_these_names(CHECKPOINT_NAME)
  for remat in (jax.checkpoint(lambda *a: fused(*a)[0]),
                jax.checkpoint(lambda *a: fused(*a)[0], policy=policy)):
    gr = jax.jit(jax.grad(remat, argnums=(0, 1)))(*args)
    for name, a, b in zip(("dhidden", "dweight"), gr, g1):
      assert_bitwise_equal(a, b, f"{name} under jax.checkpoint")


def test_data_parallel_shard_map_gives_the_unsharded_rows():
  """Rows split over two devices with global token counts (``axis_names``): the per-token
  cotangents are the unsharded ones exactly (integer counts), so dH rows are bitwise the
  unsharded rows; the loss is a sum over devices (float rounding)."""
  d = _inputs("float32", seed=4, b=4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  spec = jax.sharding.PartitionSpec("data")

  def loss(hidden, weight, targets, old, adv, mask, axis_names):
    return rl.linear_policy_loss(hidden, weight, targets, old_logp=old, advantages=adv,
                                 mask=mask, entropy_coef=0.01, axis_names=axis_names,
                                 implementation="cpu")[0]

  def sharded(hidden, weight):
    f = shard_map(lambda h, w, t, o, a, m: loss(h, w, t, o, a, m, ("data",)), mesh=mesh,
                  in_specs=(spec, jax.sharding.PartitionSpec(), spec, spec, spec, spec),
                  out_specs=jax.sharding.PartitionSpec(), check_vma=False)
    return f(hidden, weight, d["targets"], d["old"], d["adv"], d["mask"])

  args = (d["hidden"], d["weight"])
  l_s, (dh_s, dw_s) = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(*args)
  l_u, (dh_u, dw_u) = jax.jit(jax.value_and_grad(
      lambda h, w: loss(h, w, d["targets"], d["old"], d["adv"], d["mask"], ()),
      argnums=(0, 1)))(*args)
  assert abs(float(l_s) - float(l_u)) <= 1e-6 * max(1.0, abs(float(l_u)))
  assert_bitwise_equal(dh_s, dh_u, "dH rows, 2-way data parallel")
  assert rel_err(dw_s, np.asarray(dw_u, np.float64)) <= 1e-6


def test_masked_rows_are_inert_and_an_active_nan_is_not_hidden():
  d = _inputs("float32", seed=5)
  kw = dict(entropy_coef=0.01)
  fused = _fused(d, "cpu", use_bias=False, temperature=1.0, **kw)
  (loss, _), (dh, _, _) = _value_and_grads(fused, d)
  masked = ~np.asarray(d["mask"])
  poisoned = jnp.where(jnp.asarray(masked)[..., None], jnp.nan, d["hidden"])
  (loss_p, _), (dh_p, dw_p, _) = _value_and_grads(fused, dict(d, hidden=poisoned))
  assert_bitwise_equal(loss_p, loss, "loss with NaN in masked rows")
  assert_bitwise_equal(dh_p, dh, "dH with NaN in masked rows")
  assert np.all(np.asarray(dh_p)[masked] == 0) and np.all(np.isfinite(np.asarray(dw_p)))
  active = np.argwhere(np.asarray(d["mask"]))[0]
  bad = d["hidden"].at[active[0], active[1], 0].set(jnp.nan)
  (loss_n, m_n), _ = _value_and_grads(fused, dict(d, hidden=bad))
  assert np.isnan(float(loss_n)) and np.isnan(float(m_n["logp"][tuple(active)]))


def test_the_stock_head_computes_the_unfused_composition():
  """``LMHead.policy_loss`` on ``implementation="xla"`` (no fused objective there): the
  unfused ``policy_loss(linear_logp(...))``, with the fused head's metric names, its loss
  and gradients equal to the fused head's to float rounding, and ``config`` not applying."""
  from flax import nnx

  from jaxrl_kernels.linear_logp import BackwardConfig
  from jaxrl_kernels.nn.lm_head import LMHead

  d = _inputs("float32", seed=7)
  kw = dict(old_logp=d["old"], advantages=d["adv"], ref_logp=d["ref"], beta=0.05,
            entropy_coef=0.01)
  results = {}
  for impl in ("cpu", "xla"):
    head = LMHead(H, V, implementation=impl, rngs=nnx.Rngs(0))
    head.kernel.set_value(d["weight"])

    def loss(hidden, head=head):
      return head.policy_loss(hidden, d["targets"], d["mask"], config=BackwardConfig(), **kw)

    (value, metrics), dh = jax.value_and_grad(loss, has_aux=True)(d["hidden"])
    results[impl] = value, metrics, dh
  (l_f, m_f, dh_f), (l_s, m_s, dh_s) = results["cpu"], results["xla"]
  assert sorted(m_f) == sorted(m_s)
  value_tol, grad_tol = TOL["float32"]
  assert rel_err(l_s, l_f) <= value_tol, (float(l_s), float(l_f))
  assert rel_err(dh_s, dh_f) <= grad_tol
  for name in ("logp", "entropy"):
    assert rel_err(m_s[name], m_f[name]) <= value_tol, name
  lp, ent = jk.linear_logp(d["hidden"], d["weight"], d["targets"], mask=d["mask"],
                           return_entropy=True, implementation="xla")
  unfused = rl.policy_loss(lp, entropy=ent, mask=d["mask"], **kw)[0]
  assert rel_err(l_s, unfused) <= value_tol


def _not_scalar(logp, entropy, operands, cfg):
  return logp, {}


def test_bad_arguments_are_named():
  d = _inputs("float32", seed=6, b=1, t=4)
  base = dict(old_logp=d["old"], advantages=d["adv"], implementation="cpu")
  with pytest.raises(ValueError, match="implementation"):
    rl.linear_policy_loss(d["hidden"], d["weight"], d["targets"],
                          **dict(base, implementation="xla"))
  with pytest.raises(ValueError, match="beta=0.1 needs ref_logp"):
    rl.linear_policy_loss(d["hidden"], d["weight"], d["targets"], beta=0.1, **base)
  with pytest.raises(ValueError, match="objective='gspo' needs segment_ids"):
    rl.linear_policy_loss(d["hidden"], d["weight"], d["targets"], objective="gspo", **base)
  with pytest.raises(ValueError, match="objective must be one of"):
    rl.linear_policy_loss(d["hidden"], d["weight"], d["targets"], objective="dpo", **base)
  with pytest.raises(ValueError, match="targets"):
    rl.linear_policy_loss(d["hidden"], d["weight"], d["targets"] + V, **base)
  with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
    rl.policy_loss(d["old"], d["old"], d["adv"], entropy_coef=0.1)
  with pytest.raises(ValueError, match="float scalar loss"):
    linear_objective(d["hidden"], d["weight"], d["targets"], _not_scalar, None,
                     implementation="cpu")
  with pytest.raises(TypeError, match="objective must be a function"):
    linear_objective(d["hidden"], d["weight"], d["targets"], "ppo", None, implementation="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_triton_fused_loss_keeps_the_heads_bits(dtype):
  _gpu_case("triton", dtype)


@pytest.mark.hopper
def test_gpu_mosaic_fused_loss_keeps_the_heads_bits():
  _gpu_case("mosaic", "bfloat16")


def _gpu_case(impl, dtype):
  """On the GPU kernels: logp bitwise ``linear_logp``'s, gradients the unfused composition's
  to rounding, dH rows batch-invariant, dW run to run."""
  d = _inputs(dtype, seed=7, b=2, t=300, h=256, v=2000)
  kw = dict(ref_logp=d["ref"], beta=0.04, entropy_coef=0.01, denominator=128.0)
  fused = _fused(d, impl, use_bias=False, temperature=0.7, **kw)
  unfused = _unfused(d, impl, use_bias=False, temperature=0.7, **kw)
  (loss_f, m_f), g_f = _value_and_grads(fused, d)
  (loss_u, m_u), g_u = _value_and_grads(unfused, d)
  assert_bitwise_equal(m_f["logp"], m_u["logp"], "logp")
  assert_bitwise_equal(m_f["entropy"], m_u["entropy"], "entropy")
  assert abs(float(loss_f) - float(loss_u)) <= 1e-6 * max(1.0, abs(float(loss_u)))
  grad_tol = 1e-6 if dtype == "float32" else 8e-3
  for name, a, b in zip(("dhidden", "dweight"), g_f, g_u):
    assert rel_err(a, np.asarray(b, np.float64)) <= grad_tol, name
  # dH rows of the first sequence alone: the batch's rows, bitwise.
  one = jax.tree.map(lambda x: x[:1] if getattr(x, "ndim", 0) and x.shape[0] == 2 else x, d)
  _, g_one = _value_and_grads(_fused(one, impl, use_bias=False, temperature=0.7,
                                     **dict(kw, ref_logp=one["ref"])), one)
  assert_bitwise_equal(g_one[0], g_f[0][:1], "dH rows, batch of 1 vs 2")
  _, g_again = _value_and_grads(fused, d)
  assert_bitwise_equal(g_again[1], g_f[1], "dW run to run")
