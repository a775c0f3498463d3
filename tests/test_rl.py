"""RL objectives against plain float64 numpy references (loops, no shared code).

Accuracy: CONTRACT §2 float32 (forward rel 1e-5, gradients rel 1e-4). Split
invariance of the losses across devices: float32 tolerance (the sums go through
``psum``; the token/document counts inside are exact).
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, rel_err
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxrl_kernels.rl as rl_module
from jaxrl_kernels import rl
from jaxrl_kernels._compat import shard_map

FWD, GRAD = TOL["float32"]


# ------------------------------------------------------------------------------------------
# numpy references (float64)


def ref_group_adv(rewards, ids, normalize_std=True, eps=1e-6, valid=None):
  rewards = np.asarray(rewards, np.float64)
  valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid)
  out = np.zeros(len(rewards))
  for g in set(np.asarray(ids).tolist()):
    idx = [i for i in range(len(rewards)) if ids[i] == g and valid[i]]
    if not idx:
      continue
    r = rewards[idx]
    a = r - r.mean()
    if normalize_std:
      std = r.std(ddof=1) if len(r) > 1 else 0.0
      a = a / (std + eps)
    out[idx] = a
  return out


def ref_ppo(logp, old, adv, mask, cl=0.2, ch=0.2, dual=None, token_level=True, denom=None):
  """Loss, per-token d loss / d logp, clipfrac, approx_kl (float64)."""
  logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
  mask = np.asarray(mask, bool)
  adv = np.asarray(adv, np.float64)
  if adv.shape != logp.shape:
    adv = np.broadcast_to(adv[:, None], logp.shape)
  b, t = logp.shape
  loss_tok = np.zeros((b, t))
  dtok = np.zeros((b, t))
  clipped = []
  kls = []
  for i in range(b):
    for j in range(t):
      if not mask[i, j]:
        continue
      r = np.exp(logp[i, j] - old[i, j])
      a = adv[i, j]
      p1, p2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
      val, grad = (p1, -a * r) if p1 >= p2 else (p2, 0.0)
      if dual is not None and a < 0 and val > -a * dual:
        val, grad = -a * dual, 0.0
      loss_tok[i, j], dtok[i, j] = val, grad
      clipped.append(p2 > p1)
      kls.append(r - 1 - np.log(r))
  n_tok = mask.sum()
  # The count is at least 1 (no tokens: loss 0); a given denominator is used as it is.
  if token_level:
    n = max(n_tok, 1) if denom is None else denom
    loss = loss_tok.sum() / n
    grad = dtok / n
  else:
    rows = [i for i in range(b) if mask[i].any()]
    n = max(len(rows), 1) if denom is None else denom
    loss = sum(loss_tok[i].sum() / mask[i].sum() for i in rows) / n
    grad = np.zeros((b, t))
    for i in rows:
      grad[i] = dtok[i] / mask[i].sum() / n
  clipfrac = np.mean(clipped) if clipped else 0.0
  approx_kl = np.mean(kls) if kls else 0.0
  return loss, grad, clipfrac, approx_kl


def ref_gspo(logp, old, adv, mask, seg, cl, ch):
  """Loss and d loss / d logp, looping over documents (float64)."""
  logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
  mask, seg = np.asarray(mask, bool), np.asarray(seg)
  loss, grad, docs = 0.0, np.zeros(logp.shape), 0
  for s in range(len(adv)):
    sel = mask & (seg == s)
    n = sel.sum()
    if n == 0:
      continue
    docs += 1
    ratio = np.exp((logp[sel] - old[sel]).sum() / n)
    a = float(adv[s])
    l1, l2 = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
    loss += max(l1, l2)
    grad[sel] = (-a * ratio / n) if l1 >= l2 else 0.0
  return loss / max(docs, 1), grad / max(docs, 1)


def _batch(seed=0, b=6, t=9, spread=0.3):
  rng = np.random.default_rng(seed)
  logp = (rng.normal(size=(b, t)) * 0.5 - 2).astype(np.float32)
  old = (logp + spread * rng.normal(size=(b, t))).astype(np.float32)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[2] = 0  # an all-masked row
  mask = np.arange(t)[None, :] < lengths[:, None]
  return logp, old, mask


# ------------------------------------------------------------------------------------------


def test_doctests():
  res = doctest.testmod(rl_module, extraglobs={"jnp": jnp}, verbose=False)
  assert res.attempted > 0 and res.failed == 0


def test_policy_ratio_and_kl_match_reference():
  logp, old, mask = _batch(1)
  # Garbage at masked positions must not leak.
  logp_g = np.where(mask, logp, np.nan).astype(np.float32)
  ratio = np.asarray(rl.policy_ratio(logp_g, old, mask=mask))
  ref = np.where(mask, np.exp(logp.astype(np.float64) - old), 1.0)
  assert rel_err(ratio, ref) <= FWD and np.all(ratio[~mask] == 1.0)
  d = np.where(mask, old.astype(np.float64) - logp, 0.0)  # d = ref - logp
  refs = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - d - 1}
  for kind, r in refs.items():
    out = np.asarray(rl.kl(logp_g, old, mask=mask, kind=kind))
    assert np.all(np.isfinite(out)) and np.all(out[~mask] == 0.0)
    assert rel_err(out, r) <= FWD, kind
  assert np.all(np.asarray(rl.kl(logp, old, mask=mask)) >= 0)  # k3 is the default and >= 0
  with pytest.raises(ValueError, match="kind must be one of"):
    rl.kl(logp, old, mask=mask, kind="k4")
  with pytest.raises(ValueError, match=r"old_logp must have the shape of logp \(6, 9\)"):
    rl.policy_ratio(logp, old[:, :3], mask=mask)


def test_kl_gradients():
  logp, old, mask = _batch(2)
  for kind, dref in {"k1": lambda d: np.ones_like(d), "k2": lambda d: -d,
                     "k3": lambda d: 1 - np.exp(d)}.items():
    g = jax.grad(lambda x, kind=kind: jnp.sum(rl.kl(x, old, mask=mask, kind=kind)))(
        jnp.asarray(logp))
    d = old.astype(np.float64) - logp
    assert rel_err(g, np.where(mask, dref(d), 0.0)) <= GRAD, kind


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_samples_per_prompt(normalize_std):
  rng = np.random.default_rng(3)
  rewards = rng.normal(size=12).astype(np.float32)
  rewards[4:8] = 0.5  # a zero-variance group
  out = np.asarray(rl.group_advantages(rewards, 4, normalize_std=normalize_std))
  ref = ref_group_adv(rewards, np.arange(12) // 4, normalize_std)
  np.testing.assert_allclose(out, ref, rtol=FWD, atol=1e-6)
  np.testing.assert_array_equal(out[4:8], 0.0)


def test_group_advantages_arbitrary_ids_empty_groups_and_singletons():
  rewards = np.array([1.0, 3.0, 2.0, 7.0, 4.0, 4.0, 9.0, 5.0], np.float32)
  ids = np.array([900, 12, 900, 5, 12, 12, 77, 5])  # unsorted, sparse ids
  valid = np.array([1, 1, 1, 0, 1, 1, 1, 0], bool)  # group 5 has no valid sample: empty
  f = jax.jit(lambda r, g, v: rl.group_advantages(r, g, mask=v))
  out = np.asarray(f(rewards, ids, valid))
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref_group_adv(rewards, ids, valid=valid), rtol=FWD, atol=1e-6)
  assert out[3] == 0 and out[7] == 0  # the empty group
  assert out[6] == 0  # a group of one sample has std 0 -> advantage 0


def test_group_advantages_errors():
  with pytest.raises(ValueError, match="samples_per_prompt=5 must be >= 1 and divide"):
    rl.group_advantages(jnp.ones(8), 5)
  with pytest.raises(TypeError, match="group_advantages: groups must have an integer dtype"):
    rl.group_advantages(jnp.ones(8), jnp.ones(8))
  with pytest.raises(ValueError, match=r"integer group_ids of shape \(8,\)"):
    rl.group_advantages(jnp.ones(8), jnp.ones(7, jnp.int32))
  with pytest.raises(ValueError, match="rewards must be 1-D"):
    rl.group_advantages(jnp.ones((2, 4)), 2)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.1, 0.28, 1.3)])
def test_ppo_clip_loss_matches_reference(token_level, per_token_adv, clips):
  cl, ch, dual = clips
  logp, old, mask = _batch(4)
  rng = np.random.default_rng(5)
  adv = rng.normal(size=logp.shape if per_token_adv else logp.shape[:1]).astype(np.float32) * 2
  logp_g = np.where(mask, logp, np.nan).astype(np.float32)
  f = lambda x: rl.ppo_clip_loss(x, old, adv, mask=mask, clip_low=cl, clip_high=ch, dual_clip=dual,
                                 token_level=token_level)
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp_g))
  rloss, rgrad, rclip, rkl = ref_ppo(logp, old, adv, mask, cl, ch, dual, token_level)
  assert rel_err(loss, rloss) <= FWD
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0.0)
  assert rel_err(grad, rgrad) <= GRAD
  assert abs(float(metrics["clipfrac"]) - rclip) <= 1e-6
  assert 0 < rclip < 1  # the inputs exercise both branches
  assert rel_err(metrics["approx_kl"], rkl) <= FWD
  r = np.exp(logp.astype(np.float64) - old)[mask]
  assert rel_err(metrics["ratio_mean"], r.mean()) <= FWD
  assert rel_err(metrics["ratio_max"], r.max()) <= FWD
  assert rel_err(metrics["ratio_min"], r.min()) <= FWD
  assert float(metrics["num_tokens"]) == mask.sum()
  if dual is not None:
    assert float(metrics["dual_clipfrac"]) > 0


def test_ppo_denominator_and_all_masked_batch():
  logp, old, mask = _batch(6)
  adv = np.linspace(-1, 1, logp.shape[0]).astype(np.float32)
  loss, _ = rl.ppo_clip_loss(logp, old, adv, mask=mask, denominator=40.0)
  assert rel_err(loss, ref_ppo(logp, old, adv, mask, denom=40.0)[0]) <= FWD
  none = np.zeros_like(mask)
  for token_level in (True, False):
    loss, metrics = rl.ppo_clip_loss(np.full_like(logp, np.nan), old, adv, mask=none,
                                     token_level=token_level)
    assert float(loss) == 0.0
    assert all(np.isfinite(np.asarray(v)) for v in metrics.values())
    assert float(metrics["ratio_max"]) == 1.0 and float(metrics["ratio_min"]) == 1.0
  loss, _ = rl.ppo_clip_loss(np.zeros((0, 5)), np.zeros((0, 5)), np.zeros(0),
                             mask=np.zeros((0, 5)))
  assert float(loss) == 0.0


def test_ppo_errors():
  logp, old, mask = _batch(7)
  with pytest.raises(ValueError, match=r"advantages must be per sequence \(6,\) or per token"):
    rl.ppo_clip_loss(logp, old, np.ones(5), mask=mask)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    rl.ppo_clip_loss(logp, old, np.ones(6), mask=mask, dual_clip=0.5)
  with pytest.raises(ValueError, match="clip_low=1.5"):
    rl.ppo_clip_loss(logp, old, np.ones(6), mask=mask, clip_low=1.5)


@pytest.mark.parametrize("token_level", [True, False])
def test_grpo_loss_is_ppo_on_group_advantages_plus_beta_kl(token_level):
  logp, old, mask = _batch(8, b=8)
  rng = np.random.default_rng(9)
  ref_logp = (logp + 0.2 * rng.normal(size=logp.shape)).astype(np.float32)
  rewards = rng.normal(size=8).astype(np.float32)
  rewards[4:6] = 1.0  # zero-variance group
  beta = 0.05
  f = lambda x: rl.grpo_loss(x, old, rewards, 2, mask=mask, ref_logp=ref_logp, beta=beta,
                             token_level=token_level)
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
  valid = mask.any(-1)  # row 2 is all-masked: padding, left out of its group
  adv = ref_group_adv(rewards, np.arange(8) // 2, valid=valid)
  pl, pg, _, _ = ref_ppo(logp, old, adv, mask, token_level=token_level)
  d = ref_logp.astype(np.float64) - logp
  k3, dk3 = np.where(mask, np.exp(d) - d - 1, 0), np.where(mask, 1 - np.exp(d), 0)
  if token_level:
    kl_term, kl_grad = k3.sum() / mask.sum(), dk3 / mask.sum()
  else:
    rows = valid.sum()
    n = np.maximum(mask.sum(-1, keepdims=True), 1)
    kl_term, kl_grad = (k3 / n).sum() / rows, dk3 / n / rows
  assert rel_err(loss, pl + beta * kl_term) <= FWD
  assert rel_err(metrics["pg_loss"], pl) <= FWD
  assert rel_err(metrics["kl"], k3.sum() / mask.sum()) <= FWD
  assert rel_err(grad, pg + beta * kl_grad) <= GRAD
  with pytest.raises(ValueError, match="beta=0.1 needs ref_logp"):
    rl.grpo_loss(logp, old, rewards, 2, mask=mask, beta=0.1)


def _packed(seed=10, t=24, docs=(5, 7, 3, 6), pad_id=None):
  """One packed row: documents of the given lengths, then padding; prompt tokens masked."""
  rng = np.random.default_rng(seed)
  seg = np.concatenate([np.full(n, i) for i, n in enumerate(docs)])
  n_pad = t - len(seg)
  # Padding past the last document: the id a boundary search gives (len(docs)) and beyond.
  pad = np.arange(len(docs), len(docs) + n_pad) if pad_id is None else np.full(n_pad, pad_id)
  seg = np.concatenate([seg, pad]).astype(np.int32)
  mask = np.concatenate([rng.random(len(seg) - n_pad) < 0.8, np.zeros(n_pad, bool)])
  logp = (rng.normal(size=t) * 0.5 - 2).astype(np.float32)
  old = (logp + 0.02 * rng.normal(size=t)).astype(np.float32)
  adv = rng.normal(size=len(docs)).astype(np.float32)
  return logp, old, adv, mask, seg


@pytest.mark.parametrize("pad_id", [None, 4, 1000])
def test_gspo_matches_reference_with_padding_past_last_document(pad_id):
  logp, old, adv, mask, seg = _packed(pad_id=pad_id)
  logp_g = np.where(mask, logp, np.nan).astype(np.float32)
  cl, ch = 3e-3, 4e-3  # some documents clipped, some not
  f = lambda x: rl.gspo_loss(x, old, adv, seg, mask=mask, clip_low=cl, clip_high=ch)
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp_g))
  rloss, rgrad = ref_gspo(logp, old, adv, mask, seg, cl, ch)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  assert rel_err(loss, rloss) <= FWD
  assert rel_err(grad, rgrad) <= GRAD
  assert float(metrics["num_documents"]) == 4
  assert 0 < float(metrics["clipfrac"]) < 1


def test_gspo_packed_rows_2d_and_empty_document():
  rows = [_packed(seed=s, t=20, docs=(6, 4, 5)) for s in (11, 12)]
  logp = np.stack([r[0] for r in rows])
  old = np.stack([r[1] for r in rows])
  adv = np.concatenate([r[2] for r in rows] + [np.ones(1, np.float32)])  # doc 6: no token
  mask = np.stack([r[3] for r in rows])
  seg = np.stack([rows[0][4], np.where(rows[1][4] < 3, rows[1][4] + 3, 6)])
  mask[0, :6] = False  # document 0 fully masked (a prompt-only document): not counted
  loss, metrics = rl.gspo_loss(logp, old, adv, seg, mask=mask)
  assert rel_err(loss, ref_gspo(logp, old, adv, mask, seg, 3e-4, 4e-4)[0]) <= FWD
  assert float(metrics["num_documents"]) == 5
  with pytest.raises(ValueError, match=r"advantages must be \[S\]"):
    rl.gspo_loss(logp, old, adv[:, None], seg, mask=mask)


def test_gspo_active_token_outside_every_document_is_nan():
  logp, old, adv, mask, seg = _packed()
  mask = mask.copy()
  mask[-1] = True  # an active padding token with id >= S
  loss, _ = rl.gspo_loss(logp, old, adv, seg, mask=mask)
  assert np.isnan(float(loss))


def test_tis_weights_and_their_use_as_advantage_scale():
  logp, old, mask = _batch(13, spread=1.0)
  w = np.asarray(rl.tis_weights(logp, old, mask=mask, threshold=2.0))
  ref = np.where(mask, np.minimum(np.exp(logp.astype(np.float64) - old), 2.0), 0)
  assert rel_err(w, ref) <= FWD and w.max() == 2.0  # some weights truncated
  g = jax.grad(lambda x: jnp.sum(rl.tis_weights(x, old, mask=mask)))(jnp.asarray(logp))
  assert np.all(np.asarray(g) == 0)
  adv = np.linspace(-1, 1, 6).astype(np.float32)
  loss, _ = rl.ppo_clip_loss(logp, old, adv[:, None] * w, mask=mask)
  # Reference: each token's clipped loss weighted by w.
  pertok = np.zeros(mask.shape)
  for i, j in zip(*np.nonzero(mask)):
    r = np.exp(np.float64(logp[i, j]) - old[i, j])
    pertok[i, j] = ref[i, j] * max(-adv[i] * r, -adv[i] * np.clip(r, 0.8, 1.2))
  assert rel_err(loss, pertok.sum() / mask.sum()) <= FWD
  with pytest.raises(ValueError, match="threshold must be > 0"):
    rl.tis_weights(logp, old, mask=mask, threshold=0.0)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_losses_invariant_to_device_split(d):
  logp, old, mask = _batch(14, b=8)
  adv = np.linspace(-1, 1, 8).astype(np.float32)
  if len(jax.devices()) < d:
    pytest.skip(f"needs {d} devices, JAX sees {len(jax.devices())}")
  mesh = Mesh(np.array(jax.devices()[:d]), ("data",))
  for token_level in (True, False):
    f = lambda a, b, c, m, tl=token_level: rl.ppo_clip_loss(a, b, c, mask=m, token_level=tl,
                                                           axis_names="data")
    sharded = jax.jit(shard_map(f, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P()))
    loss, metrics = sharded(logp, old, adv, mask)
    ref_loss, ref_metrics = rl.ppo_clip_loss(logp, old, adv, mask=mask, token_level=token_level)
    assert rel_err(loss, ref_loss) <= FWD
    for k in ref_metrics:
      assert rel_err(metrics[k], ref_metrics[k]) <= FWD, k
    assert float(metrics["num_tokens"]) == mask.sum()  # exact count
  # GSPO with documents numbered per device.
  rows = [_packed(seed=s, t=16, docs=(5, 6)) for s in range(8)]
  lp, ol, msk = (np.stack([r[i] for r in rows]) for i in (0, 1, 3))
  adv_docs = np.stack([r[2] for r in rows])  # [8 rows, 2 docs]
  seg = np.stack([r[4] for r in rows])
  glob = np.where(seg < 2, seg + 2 * np.arange(8)[:, None], 10**6)  # padding: far past S
  ref_loss, _ = rl.gspo_loss(lp, ol, adv_docs.reshape(-1), glob, mask=msk)
  per = 8 // d

  def local(a, b, c, m, s):
    s = jnp.where(s < 2, s + 2 * jnp.arange(per)[:, None], 10**6)  # local document numbering
    return rl.gspo_loss(a, b, c.reshape(-1), s, mask=m, axis_names="data")[0]

  out = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P()))(
      lp, ol, adv_docs, msk, seg)
  assert rel_err(out, ref_loss) <= FWD


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.booleans())
@example(21932780, 4, False)
def test_ppo_property_random_masks(seed, b, token_level):
  rng = np.random.default_rng(seed)
  t = 7
  logp = (rng.normal(size=(b, t)) * 0.3 - 1).astype(np.float32)
  old = (logp + 0.3 * rng.normal(size=(b, t))).astype(np.float32)
  mask = rng.random((b, t)) < rng.random()
  adv = rng.normal(size=b).astype(np.float32)
  loss, _ = rl.ppo_clip_loss(logp, old, adv, mask=mask, token_level=token_level)
  rloss = ref_ppo(logp, old, adv, mask, token_level=token_level)[0]
  assert np.isfinite(float(loss))
  # The loss is a mean of O(|adv|) terms that can cancel: float32 rounding scales with the
  # terms, not with the (possibly tiny) result. CI once drew seed=21932780, b=4,
  # token_level=False: |loss| 5.7e-4, float32 error 1.1e-8.
  scale = max(abs(rloss), float(np.mean(np.abs(adv))), 1e-3)
  assert abs(float(loss) - rloss) <= FWD * scale


# ------------------------------------------------------------------------------------------
# Bad input never gives a silent wrong answer (masked garbage, zero-variance groups, ratio
# overflow, misleading messages, traced hyper-parameters, the keyword-only mask).


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _garbage(x, mask, value):
  """``x`` with ``value`` (NaN, ±inf, 1e30) at the masked positions."""
  x = np.asarray(x, np.float32).copy()
  x[~np.broadcast_to(mask, x.shape)] = value
  return x


def _loss_cases(logp, old, mask, b):
  """(name, f(logp, old, extra, mask) -> scalar or array, extra for clean, extra masked rows)."""
  rng = np.random.default_rng(30)
  adv_tok = rng.normal(size=logp.shape).astype(np.float32)
  adv_seq = rng.normal(size=b).astype(np.float32)
  ref = (logp + 0.2 * rng.normal(size=logp.shape)).astype(np.float32)
  return [
      ("policy_ratio", lambda x, o, e, m: rl.policy_ratio(x, o, mask=m), None),
      ("kl_k1", lambda x, o, e, m: rl.kl(x, o, mask=m, kind="k1"), None),
      ("kl_k2", lambda x, o, e, m: rl.kl(x, o, mask=m, kind="k2"), None),
      ("kl_k3", lambda x, o, e, m: rl.kl(x, o, mask=m), None),
      ("tis_weights", lambda x, o, e, m: rl.tis_weights(x, o, mask=m), None),
      ("ppo_token_adv", lambda x, o, e, m: rl.ppo_clip_loss(x, o, e, mask=m, dual_clip=2.0),
       adv_tok),
      ("ppo_seq_level", lambda x, o, e, m: rl.ppo_clip_loss(x, o, e, mask=m, token_level=False),
       adv_tok),
      ("grpo_beta_kl", lambda x, o, e, m: rl.grpo_loss(x, o, np.arange(b, dtype=np.float32) % 3,
                                                     2, mask=m, ref_logp=e, beta=0.1), ref),
  ] + [("ppo_seq_adv", lambda x, o, e, m: rl.ppo_clip_loss(x, o, adv_seq, mask=m), None)]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e30])
def test_masked_garbage_reaches_no_output_and_no_gradient(value):
  logp, old, mask = _batch(31, b=6, t=7, spread=0.4)
  for name, f, extra in _loss_cases(logp, old, mask, 6):
    def scalar(x, o, e, m, f=f):
      out = f(x, o, e, m)
      out = out[0] if isinstance(out, tuple) else out
      return jnp.sum(out), out

    clean = jax.value_and_grad(scalar, has_aux=True)(jnp.asarray(logp), old, extra, mask)
    e_bad = None if extra is None else _garbage(extra, mask, value)
    dirty = jax.value_and_grad(scalar, has_aux=True)(
        jnp.asarray(_garbage(logp, mask, value)), _garbage(old, mask, value), e_bad, mask)
    (_, out_c), g_c = clean
    (_, out_d), g_d = dirty
    assert np.all(np.isfinite(out_d)) and np.all(np.isfinite(g_d)), name
    assert np.all(np.asarray(g_d)[~mask] == 0), name
    # Selected, not multiplied: bit for bit the result with clean masked positions.
    assert np.array_equal(_bits(out_c), _bits(out_d)), name
    assert np.array_equal(_bits(g_c), _bits(g_d)), name


def test_masked_garbage_in_advantages_rewards_and_documents():
  logp, old, mask = _batch(32, b=6, t=7)
  rng = np.random.default_rng(33)
  adv = rng.normal(size=(6, 7)).astype(np.float32)
  clean = rl.ppo_clip_loss(logp, old, adv, mask=mask)[0]
  for value in (np.nan, np.inf):
    dirty, metrics = rl.ppo_clip_loss(logp, old, _garbage(adv, mask, value), mask=mask)
    assert _bits(dirty) == _bits(clean)
    assert all(np.isfinite(np.asarray(m)) for m in metrics.values())
  # GRPO: row 2 is all masked (padding); its reward may be NaN without touching anything.
  rewards = rng.normal(size=6).astype(np.float32)
  f = lambda x, r: rl.grpo_loss(x, old, r, 2, mask=mask)[0]  # noqa: E731
  l_c, g_c = jax.value_and_grad(f)(jnp.asarray(logp), rewards)
  bad = rewards.copy()
  bad[2] = np.nan
  l_d, g_d = jax.value_and_grad(f)(jnp.asarray(logp), bad)
  assert _bits(l_c) == _bits(l_d) and np.array_equal(_bits(g_c), _bits(g_d))
  # group_advantages: masked rewards of any value.
  a_c = rl.group_advantages(rewards, 3, mask=[1, 1, 0, 1, 0, 1])
  a_d = rl.group_advantages(np.where([1, 1, 0, 1, 0, 1], rewards, np.inf), 3,
                            mask=[1, 1, 0, 1, 0, 1])
  assert np.array_equal(_bits(a_c), _bits(a_d)) and np.all(np.asarray(a_d)[[2, 4]] == 0)
  # GSPO: a document without an active token may carry a NaN advantage.
  lp, ol, adv_docs, msk, seg = _packed()
  msk[seg == 1] = False
  g = lambda x, a: rl.gspo_loss(x, ol, a, seg, mask=msk)[0]  # noqa: E731
  l_c, g_c = jax.value_and_grad(g)(jnp.asarray(lp), adv_docs)
  adv_bad = adv_docs.copy()
  adv_bad[1] = np.nan
  l_d, g_d = jax.value_and_grad(g)(jnp.asarray(_garbage(lp, msk, np.nan)), adv_bad)
  assert _bits(l_c) == _bits(l_d) and np.array_equal(_bits(g_c), _bits(g_d))


def test_unmasked_nan_stays_in_its_row():
  logp, old, mask = _batch(34, b=6, t=7)
  logp = logp.copy()
  i, j = np.argwhere(mask)[0]
  logp[i, j] = np.nan
  ratio = np.asarray(rl.policy_ratio(logp, old, mask=mask))
  assert np.isnan(ratio[i, j]) and np.isfinite(np.delete(ratio.reshape(-1), i * 7 + j)).all()
  loss, _ = rl.ppo_clip_loss(logp, old, np.ones(6), mask=mask)
  assert np.isnan(float(loss))  # a NaN the user must see, never a silent finite value
  adv = np.asarray(rl.group_advantages(np.array([1, np.nan, 2, 3], np.float32), 2))
  assert np.isnan(adv[:2]).all() and np.isfinite(adv[2:]).all()


GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 31, 64)
VALUES = (0.9, 0.1, 1 / 3, 0.7, -2.5, 1e-7, 1e6, 0.0, 123.456, -1e-3)


def test_zero_variance_groups_are_exactly_zero_for_every_size_and_value():
  nonzero_naive = 0
  for k in GROUP_SIZES:
    for groups in (k, np.repeat([7, 3], k)):
      for normalize_std in (True, False):
        # Jitted as a training step runs it: one compilation for all the values.
        f = jax.jit(lambda r, g=groups, n=normalize_std: rl.group_advantages(
            r, g, normalize_std=n))
        for value in VALUES:
          a = np.asarray(f(jnp.full((2 * k,), value, jnp.float32)))
          assert np.all(a == 0), (k, value, groups, normalize_std)
    for value in VALUES:
      # Control: centering on the float32 mean leaves rounding noise, which the std
      # normalisation then blows up (the issue's -0.348 for 64 x 0.9).
      r = np.full((2 * k,), value, np.float32)
      naive = r - np.mean(r, dtype=np.float32)
      nonzero_naive += bool(np.any(naive != 0))
  assert nonzero_naive > 0
  a = rl.group_advantages(jnp.full((64,), 0.9), 64)
  assert np.all(np.asarray(a) == 0)


def test_near_equal_rewards_are_robust():
  base = np.float32(0.9)
  for k in (2, 8, 64):
    r = np.full(k, base, np.float32)
    r[-1] = np.nextafter(base, np.float32(2))  # one ulp apart
    a = np.asarray(rl.group_advantages(r, k))
    ref = ref_group_adv(r, np.zeros(k, int))
    assert np.all(np.isfinite(a)) and np.max(np.abs(a)) < 1e-1  # eps dominates a 6e-8 std
    np.testing.assert_allclose(a, ref, rtol=1e-3, atol=1e-6)
  r = (1000.0 + np.arange(8) * 1e-3).astype(np.float32)  # large offset, small spread
  np.testing.assert_allclose(rl.group_advantages(r, 8), ref_group_adv(r, np.zeros(8, int)),
                             rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("delta", [89.0, 100.0, -100.0, 1e4, -1e4])
def test_ratio_overflow_is_clamped_and_reported(delta):
  with np.errstate(over="ignore"):
    assert not np.isfinite(np.exp(np.float32(89.0)))  # control: the unclamped ratio overflows
  logp = np.array([[-1.0 + delta, -1.0, -2.0]], np.float32)
  old = np.array([[-1.0, -1.0, -2.1]], np.float32)
  mask = np.array([[True, True, True]])
  for a in (0.0, 1.0, -1.0):
    for dual in (None, 3.0):
      f = lambda x, a=a, dual=dual: rl.ppo_clip_loss(x, old, np.full(1, a, np.float32),  # noqa
                                                     mask=mask, dual_clip=dual)
      (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
      assert np.isfinite(float(loss)) and np.all(np.isfinite(g)), (a, dual)
      assert all(np.all(np.isfinite(np.asarray(m))) for m in metrics.values())
      assert float(metrics["log_ratio_clampfrac"]) == pytest.approx(1 / 3)
      assert float(metrics["ratio_max" if delta > 0 else "ratio_min"]) == pytest.approx(
          np.exp(np.sign(delta) * rl.LOG_RATIO_CLAMP), rel=1e-6)
      assert float(g[0, 0]) == 0.0  # beyond the clamp the ratio is constant
  seg = np.array([[0, 0, 1]])
  for a in (0.0, 1.0):
    h = lambda x, a=a: rl.gspo_loss(x, old, np.array([a, a], np.float32), seg, mask=mask)  # noqa
    (loss, metrics), g = jax.value_and_grad(h, has_aux=True)(jnp.asarray(logp))
    assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
    assert float(metrics["seq_log_ratio_clampfrac"]) == (0.5 if abs(delta) / 2 > 20 else 0.0)
  for kind in ("k1", "k2", "k3"):
    g = jax.grad(lambda x, kind=kind: jnp.sum(rl.kl(x, old, mask=mask, kind=kind)))(
        jnp.asarray(logp))
    assert np.all(np.isfinite(rl.kl(logp, old, mask=mask, kind=kind))) and np.all(np.isfinite(g))
  assert float(rl.tis_weights(logp, old, mask=mask)[0, 0]) == (2.0 if delta > 0 else
                                                               pytest.approx(np.exp(-20.0)))


def test_denominator_must_be_positive_and_is_never_clamped():
  """A non-positive denominator is refused by name (concrete: ValueError; traced: checkify);
  one below 1 is used as given: the loss is total / denominator, not total / 1."""
  logp, old, mask = _batch(7)
  adv = np.linspace(-1, 1, logp.shape[0]).astype(np.float32)
  for den in (0.0, -3.0):
    with pytest.raises(ValueError, match=r"ppo_clip_loss: denominator must be > 0, got "
                                         r"denominator="):
      rl.ppo_clip_loss(logp, old, adv, mask=mask, denominator=den)
  ppo = lambda den: rl.ppo_clip_loss(logp, old, adv, mask=mask, denominator=den)[0]  # noqa
  err, _ = checkify.checkify(jax.jit(ppo))(0.0)
  assert "ppo_clip_loss: denominator must be > 0" in err.get()
  half, one = float(ppo(0.5)), float(ppo(1.0))
  assert one != 0.0 and half == 2.0 * one  # an exact power-of-two scale
  assert rel_err(half, ref_ppo(logp, old, adv, mask, denom=0.5)[0]) <= FWD


def test_grpo_rewards_shape_error_names_rewards():
  logp, old, mask = _batch(35, b=4)
  with pytest.raises(ValueError, match=r"grpo_loss: rewards must hold one reward per row of logp "
                                       r"\(4, 9\): shape \(4,\), got \(3,\)"):
    rl.grpo_loss(logp, old, np.ones(3), 1, mask=mask)


def test_traced_hyper_parameters_are_supported():
  logp, old, mask = _batch(36)
  adv = np.linspace(-1, 1, 6).astype(np.float32)

  def ppo(cl, ch, dual, den):
    return rl.ppo_clip_loss(logp, old, adv, mask=mask, clip_low=cl, clip_high=ch,
                            dual_clip=dual, denominator=den)[0]

  # Traced under jit vs Python floats: the same math (XLA may fuse differently: float32 rtol).
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # noqa: E731
  args = (0.1, 0.28, 1.5, 40.0)
  close(jax.jit(ppo)(*args), ppo(*args))
  tis = lambda c: rl.tis_weights(logp, old, mask=mask, threshold=c)  # noqa: E731
  close(jax.jit(tis)(1.5), tis(1.5))
  grpo = lambda beta, eps: rl.grpo_loss(logp, old, np.arange(6.0), 3, mask=mask,  # noqa: E731
                                        ref_logp=old, beta=beta, eps=eps)[0]
  close(jax.jit(grpo)(0.1, 1e-6), grpo(0.1, 1e-6))
  gspo = lambda cl: rl.gspo_loss(logp, old, np.ones(6), np.arange(6)[:, None] + 0 * mask,  # noqa
                                 mask=mask, clip_low=cl)[0]
  close(jax.jit(gspo)(0.1), gspo(0.1))
  # A traced value out of range: caught under checkify, like every other traced check.
  err, _ = checkify.checkify(jax.jit(ppo))(1.5, 0.28, 1.5, 40.0)
  assert "ppo_clip_loss: clip_low must be >= 0 and < 1" in err.get()
  err, _ = checkify.checkify(jax.jit(tis))(-1.0)
  assert "tis_weights: threshold must be > 0" in err.get()


def test_hyper_parameter_errors_name_the_argument():
  logp, old, mask = _batch(37)
  adv = np.ones(6, np.float32)
  cases = [
      (dict(clip_low=True), TypeError, "ppo_clip_loss: clip_low must be a real number"),
      (dict(clip_high=np.array([0.1, 0.2])), TypeError, "clip_high must be a scalar"),
      (dict(clip_high=float("nan")), ValueError, "clip_high must be finite"),
      (dict(token_level=1), TypeError, "token_level must be a Python bool"),
      (dict(denominator="10"), TypeError, "denominator must be a real number"),
  ]
  for kwargs, exc, msg in cases:
    with pytest.raises(exc, match=msg):
      rl.ppo_clip_loss(logp, old, adv, mask=mask, **kwargs)
  with pytest.raises(ValueError, match=r"kl: kind must be one of \('k1', 'k2', 'k3'\)"):
    rl.kl(logp, old, kind="K3")
  with pytest.raises(ValueError, match=r"grpo_loss: kl_kind must be one of"):
    rl.grpo_loss(logp, old, np.ones(6), 2, mask=mask, kl_kind="k5")
  with pytest.raises(TypeError, match="group_advantages: normalize_std must be a Python bool"):
    rl.group_advantages(np.ones(4), 2, normalize_std="yes")
  with pytest.raises(ValueError, match="group_advantages: eps must be > 0"):
    rl.group_advantages(np.ones(4), 2, eps=0.0)
  with pytest.raises(TypeError, match="group_advantages: groups must be an int"):
    rl.group_advantages(np.ones(4), 2.0)
  with pytest.raises(TypeError, match="ppo_clip_loss: logp must be a real array"):
    rl.ppo_clip_loss(logp.astype(np.complex64), old, adv, mask=mask)
  with pytest.raises(TypeError, match="gspo_loss: segment_ids must have an integer dtype"):
    rl.gspo_loss(logp, old, adv, np.zeros(logp.shape), mask=mask)
  with pytest.raises(ValueError, match="gspo_loss: segment_ids must fit int32"):
    rl.gspo_loss(logp, old, adv, np.full(logp.shape, 2**33), mask=mask)


def test_mask_is_keyword_only_and_accepts_exact_0_1_everywhere():
  logp, old, mask = _batch(38)
  adv = np.linspace(-1, 1, 6).astype(np.float32)
  calls = {
      "policy_ratio": lambda m: rl.policy_ratio(logp, old, mask=m),
      "kl": lambda m: rl.kl(logp, old, mask=m),
      "tis_weights": lambda m: rl.tis_weights(logp, old, mask=m),
      "ppo_clip_loss": lambda m: rl.ppo_clip_loss(logp, old, adv, mask=m)[0],
      "grpo_loss": lambda m: rl.grpo_loss(logp, old, adv, 2, mask=m)[0],
      "gspo_loss": lambda m: rl.gspo_loss(logp, old, adv, np.arange(6)[:, None] + 0 * mask,
                                          mask=m)[0],
  }
  for name, call in calls.items():
    ref = _bits(call(mask))
    for form in (mask.astype(np.float32), mask.astype(np.int8), mask.tolist(),
                 jnp.asarray(mask, jnp.bfloat16)):
      assert np.array_equal(_bits(call(form)), ref), name
    assert np.array_equal(_bits(jax.jit(call)(mask.astype(np.float32))), ref), name
    bad = mask.astype(np.float32)
    bad[0, 0] = 0.5
    with pytest.raises(ValueError, match=rf"{name}: mask must be bool or hold only 0 and 1, got "
                                         r"0.5 at index \(0, 0\)"):
      call(bad)
    with pytest.raises(ValueError, match=rf"{name}: mask must have shape \(6, 9\), got \(6, 8\)"):
      call(mask[:, :8])
  assert np.array_equal(_bits(rl.ppo_clip_loss(logp, old, adv)[0]),
                        _bits(rl.ppo_clip_loss(logp, old, adv, mask=np.ones_like(mask))[0]))
  positional = [
      ("policy_ratio", lambda: rl.policy_ratio(logp, old, mask)),
      ("kl", lambda: rl.kl(logp, old, mask)),
      ("tis_weights", lambda: rl.tis_weights(logp, old, mask)),
      ("ppo_clip_loss", lambda: rl.ppo_clip_loss(logp, old, adv, mask)),
      ("grpo_loss", lambda: rl.grpo_loss(logp, old, adv, 2, mask)),
      ("gspo_loss", lambda: rl.gspo_loss(logp, old, adv, mask, np.zeros((6, 9), int))),
  ]
  for name, call in positional:
    with pytest.raises(TypeError, match=rf"^{name}: takes .* mask and every option after it are "
                                        rf"keyword-only: {name}\(.*, mask=mask, \.\.\.\)$"):
      call()
