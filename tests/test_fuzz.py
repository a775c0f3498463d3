"""Property-based fuzz suite over the public API: bad input never gives a silent wrong answer.

Every property draws shapes (0-sized and non-tile multiples), dtypes, masks (all False, all
True, ragged; bool, 0/1 numbers, lists), extreme values (±1e4, NaN/inf in masked and in
unmasked positions), traced vs concrete arguments and eager vs ``jit`` (vs ``shard_map``
where it applies), and asserts one of:

* a named error: ``ValueError``/``TypeError`` whose message names the offending argument;
* agreement with a float64 numpy reference (tolerances stated per property);
* NaN in an unmasked row stays in that row; nothing in a masked row reaches any output or
  gradient (bitwise: the result equals the one with clean masked rows).

Bounded for CI (``derandomize=True``, a few examples per property, shapes drawn from small
sets so that compiled kernels are reused). The module prints its counts at teardown
(``pytest -s``): cases tried, named errors seen, agreements checked.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fuzz
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels import rl
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.train import Trainer

COUNTS: collections.Counter = collections.Counter()
CLAMP = rl.LOG_RATIO_CLAMP
VOCAB_TILE = 128  # contract.VOCAB_TILE: the vocab tile TP shards are aligned to


@pytest.fixture(scope="module", autouse=True)
def _counts():
  yield
  print(f"\nfuzz: {COUNTS['cases']} cases tried, {COUNTS['named']} named errors, "
        f"{COUNTS['agree']} agreements with float64, {COUNTS['isolated']} isolation checks")


def case():
  COUNTS["cases"] += 1


def agree(out, ref, *, atol, rtol=0.0, what=""):
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (what, out.shape, ref.shape)
  bound = np.asarray(atol) + rtol * np.abs(ref)  # atol may be per row (broadcast)
  both_nan = np.isnan(out) & np.isnan(ref)
  ok = both_nan | (np.abs(out - ref) <= bound)
  assert np.all(ok), f"{what}: {int((~ok).sum())} of {ok.size} off; max err " \
      f"{np.max(np.where(ok, 0, np.abs(out - ref)))}"
  COUNTS["agree"] += 1


def named(fn, name: str, exc=(ValueError, TypeError)):
  """``fn()`` raises ``exc`` with ``name`` in its message."""
  with pytest.raises(exc) as e:
    fn()
  assert name in str(e.value), f"message does not name {name!r}: {e.value}"
  COUNTS["named"] += 1


def bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def same_bits(a, b, what=""):
  assert np.array_equal(bits(a), bits(b)), what
  COUNTS["isolated"] += 1


def make_mask(rng, shape, kind: str) -> np.ndarray:
  if kind == "none":
    return np.zeros(shape, bool)
  if kind == "all":
    return np.ones(shape, bool)
  return rng.random(shape) < 0.6


def mask_form(mask: np.ndarray, form: str):
  return {"bool": mask, "float": mask.astype(np.float32), "int": mask.astype(np.int32),
          "list": mask.tolist(), "jax": jnp.asarray(mask)}[form]


def with_garbage(x: np.ndarray, keep: np.ndarray, value) -> np.ndarray:
  x = np.array(x, copy=True)
  if value is not None:
    x[~np.broadcast_to(keep, x.shape)] = value
  return x


MASK_KINDS = st.sampled_from(["none", "all", "ragged", "ragged"])
MASK_FORMS = st.sampled_from(["bool", "float", "int", "list", "jax"])
GARBAGE = st.sampled_from([None, np.nan, np.inf, -np.inf, 1e30])
SEEDS = st.integers(0, 2**31 - 1)


def maybe_jit(f, use_jit: bool):
  return jax.jit(f) if use_jit else f


# ------------------------------------------------------------------------------------------
# float64 references (plain loops and numpy; no code shared with the library)


def ref_group_adv(rewards, ids, valid, normalize_std=True, eps=1e-6):
  r = np.asarray(rewards, np.float64)
  out = np.zeros(len(r))
  for g in set(np.asarray(ids).tolist()):
    idx = [i for i in range(len(r)) if ids[i] == g and valid[i]]
    if not idx:
      continue
    x = r[idx]
    a = x - x.mean()
    if normalize_std:
      a = a / ((x.std(ddof=1) if len(x) > 1 else 0.0) + eps)
    out[idx] = a
  return out


def ref_ppo(logp, old, adv, mask, cl, ch, dual, token_level):
  """Loss and d loss / d logp with the clamped log-ratio (float64)."""
  b, t = logp.shape
  val, grad = np.zeros((b, t)), np.zeros((b, t))
  for i, j in zip(*np.nonzero(mask), strict=True):
    d = float(logp[i, j]) - float(old[i, j])
    clamped = abs(d) > CLAMP
    r = np.exp(np.clip(d, -CLAMP, CLAMP))
    a = float(adv[i, j])
    p1, p2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
    v, g = (p1, 0.0 if clamped else -a * r) if p1 >= p2 else (p2, 0.0)
    if dual is not None and a < 0 and v > -a * dual:
      v, g = -a * dual, 0.0
    val[i, j], grad[i, j] = v, g
  if token_level:
    n = max(mask.sum(), 1)
    return val.sum() / n, grad / n
  rows = [i for i in range(b) if mask[i].any()]
  n = max(len(rows), 1)
  loss = sum(val[i].sum() / mask[i].sum() for i in rows) / n
  for i in range(b):
    grad[i] = grad[i] / max(mask[i].sum(), 1) / n
  return loss, grad


def ref_gspo(logp, old, adv, mask, seg, cl, ch):
  loss, docs = 0.0, 0
  for s in range(len(adv)):
    sel = mask & (np.minimum(seg, len(adv) - 1) == s)
    if not sel.any():
      continue
    docs += 1
    lr = np.clip((logp[sel].astype(np.float64) - old[sel]).mean(), -CLAMP, CLAMP)
    ratio, a = np.exp(lr), float(adv[s])
    loss += max(-a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch))
  return loss / max(docs, 1)


def ref_logp(h, w, b, t, temperature, layout):
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  z = h @ (w if layout == "hv" else w.T)
  if b is not None:
    z = z + np.asarray(b, np.float64)
  z = z / temperature
  m = z.max(-1, keepdims=True) if z.shape[-1] else 0.0
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  p = np.exp(z - lse[..., None])
  logp = np.take_along_axis(z, np.asarray(t)[..., None], -1)[..., 0] - lse
  ent = lse - (p * z).sum(-1)
  return logp, ent, np.abs(h) @ np.abs(w if layout == "hv" else w.T) / temperature


def ref_attention(q, k, v, qpos, kvlen, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  out = np.zeros(q.shape)
  for bi in range(b):
    for i in range(tq):
      for h in range(hq):
        keys = [j for j in range(k.shape[1]) if j <= qpos[bi, i] and j < kvlen[bi]]
        if not keys:
          continue
        kk, vv = k[bi, keys, h // (hq // hkv)], v[bi, keys, h // (hq // hkv)]
        s = scale * kk @ q[bi, i, h]
        p = np.exp(s - s.max())
        out[bi, i, h] = (p / p.sum()) @ vv
  return out


# ------------------------------------------------------------------------------------------
# rl


@fuzz(6)
@given(seed=SEEDS, b=st.sampled_from([0, 3]), t=st.sampled_from([1, 4]), mask_kind=MASK_KINDS,
       form=MASK_FORMS, garbage=GARBAGE, scale=st.sampled_from([0.3, 3.0, 1e4]),
       token_level=st.booleans(), per_token=st.booleans(),
       clips=st.sampled_from([(0.2, 0.2, None), (0.1, 0.28, 1.5), (0.0, 0.0, None)]),
       use_jit=st.booleans())
def test_ppo_clip_loss(seed, b, t, mask_kind, form, garbage, scale, token_level, per_token,
                       clips, use_jit):
  case()
  rng = np.random.default_rng(seed)
  cl, ch, dual = clips
  logp = (rng.normal(size=(b, t)) * scale - 1).astype(np.float32)
  old = (logp + rng.normal(size=(b, t)) * min(scale, 30.0)).astype(np.float32)
  mask = make_mask(rng, (b, t), mask_kind)
  adv = rng.normal(size=(b, t) if per_token else (b,)).astype(np.float32)
  adv_tok = adv if per_token else np.broadcast_to(adv[:, None], (b, t))
  f = maybe_jit(lambda x, o, a, m: rl.ppo_clip_loss(
      x, o, a, mask=m, clip_low=cl, clip_high=ch, dual_clip=dual, token_level=token_level),
      use_jit)
  m_in = mask_form(mask, form)
  if use_jit:  # jit takes arrays (a list [] cannot spell shape (0, T))
    m_in = jnp.asarray(m_in).reshape(mask.shape)
  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(
      jnp.asarray(with_garbage(logp, mask, garbage)), with_garbage(old, mask, garbage),
      with_garbage(adv, mask if per_token else mask.any(-1) | True, None), m_in)
  rloss, rgrad = ref_ppo(logp, old, adv_tok, mask, cl, ch, dual, token_level)
  big = max(abs(rloss), (float(np.abs(adv).mean()) if adv.size else 0.0)
            * np.exp(min(scale * 3, CLAMP)), 1e-3)
  agree(loss, rloss, atol=2e-5 * big, what="loss")
  g = np.asarray(g)
  assert np.all(np.isfinite(g)) and np.all(g[~mask] == 0)
  agree(g, rgrad, atol=2e-5 * big, what="grad")
  assert float(metrics["num_tokens"]) == mask.sum()
  assert all(np.isfinite(np.asarray(v)) for v in metrics.values())
  d = (logp.astype(np.float64) - old)[mask]
  assert float(metrics["log_ratio_clampfrac"]) == pytest.approx(
      float(np.mean(np.abs(d) > CLAMP)) if d.size else 0.0, abs=1e-6)


@fuzz(4)
@given(seed=SEEDS, b=st.sampled_from([1, 3]), t=st.just(4), mask_kind=MASK_KINDS,
       garbage=GARBAGE, beta=st.sampled_from([0.0, 0.1]), use_jit=st.booleans(),
       kind=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_ratio_tis_and_grpo(seed, b, t, mask_kind, garbage, beta, use_jit, kind):
  case()
  rng = np.random.default_rng(seed)
  logp = (rng.normal(size=(2 * b, t)) - 2).astype(np.float32)
  old = (logp + 0.3 * rng.normal(size=logp.shape)).astype(np.float32)
  mask = make_mask(rng, logp.shape, mask_kind)
  lg, og = with_garbage(logp, mask, garbage), with_garbage(old, mask, garbage)
  d = np.where(mask, old.astype(np.float64) - logp, 0.0)
  ratio = maybe_jit(lambda x, o, m: rl.policy_ratio(x, o, mask=m), use_jit)(lg, og, mask)
  agree(ratio, np.where(mask, np.exp(-d), 1.0), atol=1e-6, rtol=1e-5, what="ratio")
  k = maybe_jit(lambda x, o, m: rl.kl(x, o, mask=m, kind=kind), use_jit)(lg, og, mask)
  kref = {"k1": -d, "k2": 0.5 * d * d, "k3": np.expm1(d) - d}[kind]
  agree(k, kref, atol=1e-6, rtol=1e-5, what=kind)
  w = rl.tis_weights(lg, og, mask=mask, threshold=1.5)
  agree(w, np.where(mask, np.minimum(np.exp(-d), 1.5), 0.0), atol=1e-6, rtol=1e-5)
  rewards = rng.choice([0.0, 1.0, 0.5], size=2 * b).astype(np.float32)
  rewards_g = np.where(mask.any(-1), rewards, np.nan if garbage is not None else 0.0)
  f = maybe_jit(lambda x, o, r, m: rl.grpo_loss(x, o, r, 2, mask=m, ref_logp=o, beta=beta),
                use_jit)
  (loss, _), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lg), og,
                                                     rewards_g.astype(np.float32), mask)
  adv = ref_group_adv(rewards, np.arange(2 * b) // 2, mask.any(-1))
  pl, pg = ref_ppo(logp, old, np.broadcast_to(adv[:, None], logp.shape), mask, 0.2, 0.2, None,
                   True)
  k3 = np.where(mask, np.expm1(d) - d, 0.0)
  agree(loss, pl + beta * k3.sum() / max(mask.sum(), 1), atol=1e-5 * (1 + np.abs(adv).max()))
  g = np.asarray(g)
  assert np.all(np.isfinite(g)) and np.all(g[~mask] == 0)


@fuzz(6)
@given(seed=SEEDS, groups=st.sampled_from([1, 3]), k=st.sampled_from([1, 3, 64]),
       ids_form=st.sampled_from(["int", "ids"]), mask_kind=MASK_KINDS,
       normalize_std=st.booleans(), garbage=GARBAGE, use_jit=st.booleans())
def test_group_advantages(seed, groups, k, ids_form, mask_kind, normalize_std, garbage,
                          use_jit):
  case()
  rng = np.random.default_rng(seed)
  n = groups * k
  # Few distinct values: zero-variance groups and ties are common.
  rewards = rng.choice(np.float32([0.9, 0.1, 1 / 3, -2.5, 1e4]), size=n)
  rewards[: k] = rewards[0]  # group 0 (samples_per_prompt form) is zero-variance
  valid = make_mask(rng, (n,), mask_kind)
  ids = np.arange(n) // k
  if ids_form == "ids":
    perm = rng.permutation(n)
    ids, rewards, valid = ids[perm] * 1000 + 7, rewards[perm], valid[perm]
  groups_arg = k if ids_form == "int" else ids
  f = maybe_jit(lambda r, m: rl.group_advantages(r, groups_arg, mask=m,
                                                 normalize_std=normalize_std), use_jit)
  out = np.asarray(f(with_garbage(rewards, valid, garbage), valid))
  ref = ref_group_adv(rewards, ids, valid, normalize_std)
  agree(out, ref, atol=2e-5 * (1 if normalize_std else 1e4), rtol=1e-5)
  for g in set(ids.tolist()):  # all-equal valid rewards: exactly 0, not rounding noise
    sel = (ids == g) & valid
    if sel.any() and np.all(rewards[sel] == rewards[sel][0]):
      assert np.all(out[sel] == 0)
  assert np.all(out[~valid] == 0)


@fuzz(4)
@given(seed=SEEDS, docs=st.sampled_from([(1,), (3, 2, 4)]), n_pad=st.sampled_from([0, 2]),
       pad_id=st.sampled_from([None, 10**6]), garbage=GARBAGE,
       scale=st.sampled_from([0.02, 50.0]), use_jit=st.booleans())
def test_gspo_loss(seed, docs, n_pad, pad_id, garbage, scale, use_jit):
  case()
  rng = np.random.default_rng(seed)
  seg = np.concatenate([np.full(n, i) for i, n in enumerate(docs)])
  pad = (np.arange(len(docs), len(docs) + n_pad) if pad_id is None
         else np.full(n_pad, pad_id))
  seg = np.concatenate([seg, pad]).astype(np.int32)
  t = len(seg)
  mask = np.concatenate([rng.random(t - n_pad) < 0.7, np.zeros(n_pad, bool)])
  logp = (rng.normal(size=t) - 2).astype(np.float32)
  old = (logp + scale * rng.normal(size=t)).astype(np.float32)
  adv = rng.normal(size=len(docs)).astype(np.float32)
  has = np.array([(mask & (seg == s)).any() for s in range(len(docs))])
  adv_g = with_garbage(adv, has, garbage)
  f = maybe_jit(lambda x, o, a, s, m: rl.gspo_loss(x, o, a, s, mask=m, clip_low=3e-3,
                                                   clip_high=4e-3), use_jit)
  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(
      jnp.asarray(with_garbage(logp, mask, garbage)), with_garbage(old, mask, garbage), adv_g,
      seg, mask)
  ref = ref_gspo(logp, old, adv, mask, seg, 3e-3, 4e-3)
  agree(loss, ref, atol=1e-5 * max(1.0, abs(ref)) * (np.exp(CLAMP) if scale > 1 else 1.0))
  g = np.asarray(g)
  assert np.all(np.isfinite(g)) and np.all(g[~mask] == 0)
  assert float(metrics["num_documents"]) == has.sum()


def _bad_rl_calls():
  lp = np.zeros((2, 3), np.float32)
  m = np.ones((2, 3), bool)
  return [
      ("mask", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=np.ones((2, 4), bool))),
      ("mask", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=[[1, 0, 2], [1, 1, 1]])),
      ("mask", lambda: rl.kl(lp, lp, mask=[[0.5, 1, 1], [1, 1, 1]])),
      ("mask", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), m)),
      ("mask", lambda: rl.grpo_loss(lp, lp, np.ones(2), 1, m)),
      ("clip_low", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=m, clip_low=True)),
      ("clip_high", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=m, clip_high=[0.2])),
      ("dual_clip", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=m, dual_clip=0.9)),
      ("advantages", lambda: rl.ppo_clip_loss(lp, lp, np.ones(3), mask=m)),
      ("old_logp", lambda: rl.ppo_clip_loss(lp, lp[:, :2], np.ones(2), mask=m)),
      ("rewards", lambda: rl.grpo_loss(lp, lp, np.ones(3), 1, mask=m)),
      ("groups", lambda: rl.grpo_loss(lp, lp, np.ones(2), 2.0, mask=m)),
      ("samples_per_prompt", lambda: rl.grpo_loss(lp, lp, np.ones(2), 3, mask=m)),
      ("kind", lambda: rl.kl(lp, lp, mask=m, kind="k9")),
      ("threshold", lambda: rl.tis_weights(lp, lp, mask=m, threshold=np.array([1.0, 2.0]))),
      ("segment_ids", lambda: rl.gspo_loss(lp, lp, np.ones(2), np.full((2, 3), 0.0), mask=m)),
      ("segment_ids", lambda: rl.gspo_loss(lp, lp, np.ones(2), np.full((2, 3), 2**40),
                                           mask=m)),
      ("eps", lambda: rl.group_advantages(np.ones(2), 1, eps=-1.0)),
      ("token_level", lambda: rl.ppo_clip_loss(lp, lp, np.ones(2), mask=m, token_level=0)),
      ("logp", lambda: rl.ppo_clip_loss(lp.astype(np.complex64), lp, np.ones(2), mask=m)),
      ("mask", lambda: jk.masked_mean(lp, np.ones((2, 3), np.complex64))),
      ("axis", lambda: jk.masked_sum(lp, m, axis=5)),
      ("targets", lambda: jk.logprob_drift(lp, lp, np.zeros((2, 3), np.float32))),
      ("mask", lambda: jk.logprob_drift(lp, lp, np.zeros((2, 3), int), [[1, 3, 1], [1, 1, 1]])),
      ("micro_batches", lambda: Trainer(lambda *a: 0.0, None, lambda b: 1, micro_batches=1.0)),
  ]


@fuzz(25)
@given(i=st.integers(0, len(_bad_rl_calls()) - 1))
def test_bad_input_to_rl_reductions_diagnostics_train_is_named(i):
  case()
  name, call = _bad_rl_calls()[i]
  named(call, name)


@fuzz(15)
@given(seed=SEEDS, shape=st.sampled_from([(0,), (5,), (3, 4), (2, 3, 2)]),
       mask_kind=MASK_KINDS, weights=st.booleans(), garbage=GARBAGE,
       split=st.sampled_from([1, 2, 4]))
def test_reductions(seed, shape, mask_kind, weights, garbage, split):
  case()
  rng = np.random.default_rng(seed)
  v = (rng.normal(size=shape) * 1e4).astype(np.float32)
  m = make_mask(rng, shape, mask_kind)
  w = np.where(m, rng.random(shape) + 0.5, 0.0).astype(np.float32) if weights else m
  vg = with_garbage(v, m, garbage)
  wsum = np.asarray(w, np.float64).sum()
  ref_sum = (np.where(m, v, 0.0).astype(np.float64) * w).sum()
  scale = 1e-6 * max(1.0, np.abs(v).sum() * 2)
  agree(jk.masked_sum(vg, w), ref_sum, atol=scale)
  agree(jk.masked_count(w), wsum, atol=1e-5 * max(wsum, 1))
  agree(jk.masked_mean(vg, w), ref_sum / max(wsum, 1e-6), atol=scale / max(wsum, 1e-6))
  g = np.asarray(jax.grad(lambda x: jk.masked_mean(x, w))(jnp.asarray(vg)))
  assert np.all(np.isfinite(g)) and np.all(g[~m] == 0)
  if len(shape) and shape[0] % split == 0 and shape[0] and len(jax.devices()) >= split:
    mesh = Mesh(np.array(jax.devices()[:split]), ("x",))
    f = shard_map(lambda a, b: jk.masked_mean(a, b, axis_names="x"), mesh=mesh,
                  in_specs=(P("x"), P("x")), out_specs=P())
    agree(jax.jit(f)(vg, w), ref_sum / max(wsum, 1e-6), atol=scale / max(wsum, 1e-6))


@fuzz(15)
@given(seed=SEEDS, shape=st.sampled_from([(0,), (4,), (2, 5)]), mask_kind=MASK_KINDS,
       form=MASK_FORMS, garbage=GARBAGE)
def test_logprob_drift(seed, shape, mask_kind, form, garbage):
  case()
  rng = np.random.default_rng(seed)
  ref = (rng.normal(size=shape) - 3).astype(np.float32)
  cand = (ref + rng.normal(size=shape) * 1e-3).astype(np.float32)
  tg = rng.integers(0, 50, size=shape)
  m = make_mask(rng, shape, mask_kind)
  rep = jk.logprob_drift(with_garbage(cand, m, garbage), ref, tg, mask_form(m, form))
  d = (cand.astype(np.float64) - ref)[m]
  assert rep.num_active == m.sum() and rep.num_nonfinite == 0
  agree(rep.max_abs_error, np.abs(d).max() if d.size else 0.0, atol=1e-9)
  COUNTS["isolated"] += 1


@fuzz(15)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=6),
       docs_per_step=st.integers(0, 8), micro=st.integers(1, 3))
def test_trainer_pull(counts, docs_per_step, micro):
  case()
  t = Trainer(lambda *a: 0.0, None, count_documents=lambda b: b, docs_per_step=docs_per_step,
              micro_batches=micro)
  pulled, total = t.pull(iter(counts))
  assert total == sum(pulled)
  if docs_per_step == 0:
    assert pulled == counts[:micro]
  else:  # the fewest leading micro-batches that reach the target (or all of them)
    need = next((i + 1 for i in range(len(counts)) if sum(counts[: i + 1]) >= docs_per_step),
                len(counts))
    assert len(pulled) == need
  COUNTS["agree"] += 1


# ------------------------------------------------------------------------------------------
# kernels: det_matmul, linear_logp (+ TP), check_targets, pad_vocab, causal_attention


@fuzz(12)
@given(seed=SEEDS, m=st.sampled_from([0, 1, 3, 9]), k=st.sampled_from([1, 7, 70]),
       n=st.sampled_from([1, 17]), dtype=st.sampled_from(["float32", "bfloat16"]),
       transpose_b=st.booleans(), use_jit=st.booleans(), nan_row=st.booleans())
def test_det_matmul(seed, m, k, n, dtype, transpose_b, use_jit, nan_row):
  case()
  rng = np.random.default_rng(seed)
  a = (rng.normal(size=(m, k)) * 2.0 ** rng.integers(-8, 8, size=(m, 1))).astype(np.float32)
  b = rng.normal(size=(n, k) if transpose_b else (k, n)).astype(np.float32)
  a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
  f = maybe_jit(lambda x, y: jk.det_matmul(x, y, transpose_b=transpose_b,
                                           out_dtype=jnp.float32), use_jit)
  out = np.asarray(f(a, b))
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  b64 = b64.T if transpose_b else b64
  agree(out, a64 @ b64, atol=1e-5, rtol=0, what="det_matmul") if k < 2 else agree(
      out, a64 @ b64, atol=float(np.max(np.abs(a64) @ np.abs(b64), initial=0)) * 1e-6 + 1e-30)
  if nan_row and m > 1:  # NaN in one row stays in that row; the others keep their bits
    a_bad = a.at[0, 0].set(jnp.nan)
    out_bad = np.asarray(f(a_bad, b))
    assert np.all(np.isnan(out_bad[0]))
    same_bits(out_bad[1:], out[1:], "det_matmul rows 1..")


@fuzz(12)
@given(bad=st.sampled_from(["out_dtype", "k", "rank", "int", "transpose_b", "impl"]))
def test_det_matmul_bad_input_is_named(bad):
  case()
  a, b = jnp.ones((2, 4)), jnp.ones((4, 3))
  call, name = {
      "out_dtype": (lambda: jk.det_matmul(a, b, out_dtype="nonsense"), "out_dtype"),
      "k": (lambda: jk.det_matmul(a, jnp.ones((5, 3))), "det_matmul"),
      "rank": (lambda: jk.det_matmul(a, jnp.ones((4,))), "det_matmul"),
      "int": (lambda: jk.det_matmul(a.astype(jnp.int32), b.astype(jnp.int32)), "det_matmul"),
      "transpose_b": (lambda: jk.det_matmul(a, b, transpose_b=1), "transpose_b"),
      "impl": (lambda: jk.det_matmul(a, b, implementation="gpu!"), "implementation"),
  }[bad]
  named(call, name)


def _lm_case(rng, t, h, v, dtype, layout, with_bias):
  x = (rng.normal(size=(t, h))).astype(np.float32)
  w = (rng.normal(size=(h, v) if layout == "hv" else (v, h)) * 0.5).astype(np.float32)
  bias = rng.normal(size=v).astype(np.float32) if with_bias else None
  tg = rng.integers(0, v, size=t).astype(np.int32)
  x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  return x, w, (None if bias is None else jnp.asarray(bias, dtype)), tg


@fuzz(3)
@given(seed=SEEDS, t=st.sampled_from([1, 5]), h=st.sampled_from([8, 20]),
       v=st.sampled_from([3, 130]), dtype=st.sampled_from(["float32", "bfloat16"]),
       layout=st.sampled_from(["hv", "vh"]), with_bias=st.booleans(), mask_kind=MASK_KINDS,
       temperature=st.sampled_from([1.0, 0.7]), use_jit=st.booleans())
def test_linear_logp_agrees_and_masked_rows_are_inert(seed, t, h, v, dtype, layout, with_bias,
                                                      mask_kind, temperature, use_jit):
  case()
  rng = np.random.default_rng(seed)
  x, w, bias, tg = _lm_case(rng, t, h, v, dtype, layout, with_bias)
  mask = make_mask(rng, (t,), mask_kind)

  def f(hh, ww):
    lp, ent = jk.linear_logp(hh, ww, tg, bias=bias, mask=mask, temperature=temperature,
                             return_entropy=True, weight_layout=layout)
    return jnp.sum(lp) + 0.5 * jnp.sum(ent), (lp, ent)

  f = maybe_jit(f, use_jit)
  (_, (lp, ent)), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
  rl_, re_, scale = ref_logp(x, w, bias, tg, temperature, layout)
  tol = (1e-5 if dtype == "float32" else 1e-2) * (1 + scale.max(-1))
  agree(np.where(mask, lp, 0.0), np.where(mask, rl_, 0.0), atol=tol, what="logp")
  agree(np.where(mask, ent, 0.0), np.where(mask, re_, 0.0), atol=tol, what="entropy")
  assert np.all(np.asarray(lp)[~mask] == 0)
  assert np.all(np.asarray(dh, np.float32)[~mask] == 0)
  # Defect 3: garbage in a masked row reaches no output and no gradient (dW included).
  if (~mask).any():
    x_bad = x.at[np.flatnonzero(~mask)[0]].set(jnp.nan)
    (_, (lp2, _)), (dh2, dw2) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x_bad, w)
    same_bits(lp2, lp, "logp with a NaN masked row")
    assert np.all(np.isfinite(np.asarray(dw2, np.float32))), "dW poisoned by a masked row"
    assert np.all(np.isfinite(np.asarray(dh2, np.float32)))


@fuzz(4)
@given(seed=SEEDS, t=st.sampled_from([0, 3]), v=st.sampled_from([5, 130]))
def test_linear_logp_zero_sized(seed, t, v):
  """H = 0 (logits all 0: logp = -log V) and T = 0 give results, not a crash."""
  case()
  rng = np.random.default_rng(seed)
  x = jnp.zeros((t, 0), jnp.float32)
  w = jnp.zeros((0, v), jnp.float32)
  tg = rng.integers(0, v, size=t).astype(np.int32)
  lp = jk.linear_logp(x, w, tg)
  agree(lp, np.full(t, -np.log(v)), atol=1e-6)


def _bad_lm_calls():
  h, w = jnp.ones((3, 8)), jnp.ones((8, 16))
  t = np.array([1, 2, 3])
  return [
      ("targets", lambda: jk.linear_logp(h, w, np.array([1, 2, 2**32 + 5]))),
      ("targets", lambda: jk.linear_logp(h, w, np.array([0.5, 1.0, 3.7]))),
      ("targets", lambda: jk.linear_logp(h, w, np.array([1, 2, 16]))),
      ("mask", lambda: jk.linear_logp(h, w, t, mask=[1, 0, 2])),
      ("mask", lambda: jk.linear_logp(h, w, t, mask=np.ones(4, bool))),
      ("temperature", lambda: jk.linear_logp(h, w, t, temperature=True)),
      ("temperature", lambda: jk.linear_logp(h, w, t, temperature=np.array([1.0, 2.0]))),
      ("temperature", lambda: jk.linear_logp(h, w, t, temperature=0.0)),
      ("weight_layout", lambda: jk.linear_logp(h, w, t, weight_layout="HV")),
      ("fp32_head", lambda: jk.linear_logp(h, w, t, fp32_head=1)),
      ("return_entropy", lambda: jk.linear_logp(h, w, t, return_entropy="yes")),
      ("hidden", lambda: jk.linear_logp(jnp.ones((3, 7)), w, t)),
      ("bias", lambda: jk.linear_logp(h, w, t, bias=jnp.ones(15))),
      ("implementation", lambda: jk.linear_logp(h, w, t, implementation="fast")),
      ("weight_layout", lambda: jk.pad_vocab(w, 2, weight_layout="HV")),
      ("tp", lambda: jk.pad_vocab(w, 0)),
      ("tp", lambda: jk.pad_vocab(w, 2.0)),
      ("targets", lambda: jk.check_targets([0.5, 3.7], 8)),
      ("vocab_size", lambda: jk.check_targets([1, 3], 8.0)),
      ("targets", lambda: jk.check_targets([1, 9], 8)),
      ("targets", lambda: jk.check_targets([1, 2**32 + 300], 2**31 - 1)),
  ]


@fuzz(25)
@given(i=st.integers(0, len(_bad_lm_calls()) - 1))
def test_bad_input_to_linear_logp_pad_vocab_check_targets_is_named(i):
  case()
  name, call = _bad_lm_calls()[i]
  named(call, name)


@fuzz(10)
@given(seed=SEEDS, v=st.integers(1, 300), tp=st.sampled_from([1, 2, 3, 8]),
       layout=st.sampled_from(["hv", "vh"]), with_bias=st.booleans())
def test_pad_vocab(seed, v, tp, layout, with_bias):
  case()
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(4, v) if layout == "hv" else (v, 4)).astype(np.float32)
  b = rng.normal(size=v).astype(np.float32)
  out = jk.pad_vocab(w, tp, weight_layout=layout, bias=b if with_bias else None)
  wp, bp = out if with_bias else (out, None)
  axis = 1 if layout == "hv" else 0
  vp = wp.shape[axis]
  # tp == 1: no padding; else tp shards of a whole number of VOCAB_TILE columns.
  assert vp == (v if tp == 1 else tp * (-(-v // (tp * VOCAB_TILE)) * VOCAB_TILE))
  np.testing.assert_array_equal(np.take(np.asarray(wp), np.arange(v), axis), w)
  assert np.all(np.take(np.asarray(wp), np.arange(v, vp), axis) == 0)
  if with_bias:
    assert bp.shape == (vp,) and np.all(np.asarray(bp)[v:] == 0)
  COUNTS["agree"] += 1


@fuzz(2)
@given(seed=SEEDS, tp=st.sampled_from([2, 4]), layout=st.sampled_from(["hv", "vh"]),
       mask_kind=MASK_KINDS, use_jit=st.booleans())
def test_vocab_parallel_logp_matches_unsharded(seed, tp, layout, mask_kind, use_jit):
  """Eager and jitted shard_map over a TP mesh: bitwise the unsharded result."""
  case()
  if len(jax.devices()) < tp:
    pytest.skip(f"needs {tp} devices")
  rng = np.random.default_rng(seed)
  v = 100 * tp + 30  # every shard holds real vocabulary (an all-padding shard is an error)
  x, w, _, tg = _lm_case(rng, 6, 8, v, "float32", layout, False)
  mask = make_mask(rng, (6,), mask_kind)
  mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
  spec = P(None, "tp") if layout == "hv" else P("tp", None)
  wp = jk.pad_vocab(w, tp, weight_layout=layout)
  f = maybe_jit(lambda hh, ww: jk.vocab_parallel_logp(
      hh, ww, tg, mesh=mesh, weight_spec=spec, vocab_size=v, mask=mask, weight_layout=layout),
      use_jit)
  lp = f(x, wp)
  ref = jk.linear_logp(x, w, tg, mask=mask, weight_layout=layout)
  same_bits(lp, ref, "vocab_parallel_logp vs linear_logp")
  rl_, _, scale = ref_logp(x, w, None, tg, 1.0, layout)
  agree(np.where(mask, lp, 0), np.where(mask, rl_, 0), atol=1e-5 * (1 + scale.max()))


def test_vocab_parallel_bad_layout_names_weight_layout():
  case()
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  w = jk.pad_vocab(jnp.ones((8, 10)), 2)
  named(lambda: jk.vocab_parallel_logp(jnp.ones((3, 8)), w, np.array([1, 2, 3]), mesh=mesh,
                                       weight_spec=P(None, "tp"), vocab_size=10,
                                       weight_layout="bad"), "weight_layout")


@pytest.mark.parametrize("implementation", [
    None,
    pytest.param("interpret", marks=pytest.mark.xfail(strict=True, reason=(
        "Pallas kernels: pallas_call out_shape has no manual_axis_type, so under a "
        "check_vma=True shard_map it raises ValueError; fix: set the out_shape's "
        "manual axis type from the inputs' vma (jax.typeof(x).vma)"))),
])
def test_ops_inside_a_user_shard_map_eagerly(implementation):
  """An op called inside the user's own (eager) shard_map works and keeps its bits."""
  case()
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  rng = np.random.default_rng(0)
  x, w, _, tg = _lm_case(rng, 4, 8, 12, "float32", "hv", False)
  f = shard_map(lambda hh, tt: jk.linear_logp(hh, w, tt, implementation=implementation),
                mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))
  same_bits(f(x, tg), jk.linear_logp(x, w, tg, implementation=implementation),
            "linear_logp in shard_map")
  g = shard_map(lambda a: jk.det_matmul(a, jnp.asarray(w), implementation=implementation),
                mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  same_bits(g(x), jk.det_matmul(x, jnp.asarray(w), implementation=implementation),
            "det_matmul in shard_map")


@fuzz(5)
@given(seed=SEEDS, b=st.sampled_from([1, 2]), s=st.sampled_from([1, 5]),
       heads=st.sampled_from([(2, 1), (2, 2)]), prefill=st.booleans(), pad_query=st.booleans(),
       garbage=st.sampled_from([None, np.nan, np.inf]))
def test_causal_attention(seed, b, s, heads, prefill, pad_query, garbage):
  case()
  rng = np.random.default_rng(seed)
  hq, hkv = heads
  d = 16
  tq = s if prefill else 1
  q = rng.normal(size=(b, tq, hq, d)).astype(np.float32)
  k = rng.normal(size=(b, s, hkv, d)).astype(np.float32)
  v = rng.normal(size=(b, s, hkv, d)).astype(np.float32)
  kvlen = rng.integers(1, s + 1, size=b).astype(np.int32)
  qpos = np.broadcast_to(np.arange(s - tq, s), (b, tq)).astype(np.int32)
  qpos = np.minimum(qpos, kvlen[:, None] - 1)
  if pad_query:
    qpos = qpos.copy()
    qpos[0, 0] = -1  # a padding query: sees no key, outputs 0
  keep = np.arange(s)[None, :, None, None] < kvlen[:, None, None, None]
  kg = with_garbage(k, np.broadcast_to(keep, k.shape), garbage)
  vg = with_garbage(v, np.broadcast_to(keep, v.shape), garbage)
  out = jk.causal_attention(jnp.asarray(q), jnp.asarray(kg), jnp.asarray(vg),
                            q_positions=jnp.asarray(qpos), kv_lengths=jnp.asarray(kvlen))
  ref = ref_attention(q, k, v, qpos, kvlen, 1 / np.sqrt(d))
  agree(out, ref, atol=2e-5)
  if pad_query:
    assert np.all(np.asarray(out)[0, 0] == 0)


@pytest.mark.parametrize("scale", [
    True,
    0.0,
    np.array([1.0, 2.0]),
    float("nan"),
    "0.25",
])
def test_causal_attention_bad_scale_is_named(scale):
  case()
  q = jnp.ones((1, 3, 2, 16))
  named(lambda: jk.causal_attention(q, q, q, scale=scale), "scale")


def test_pad_vocab_output_is_accepted_by_vocab_parallel_logp_for_a_small_vocab():
  case()
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  rng = np.random.default_rng(3)
  x, w, _, tg = _lm_case(rng, 4, 8, 12, "float32", "hv", False)
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  lp = jk.vocab_parallel_logp(x, jk.pad_vocab(w, 2), tg, mesh=mesh, weight_spec=P(None, "tp"),
                              vocab_size=12)
  same_bits(lp, jk.linear_logp(x, w, tg), "small vocab over TP = 2")
