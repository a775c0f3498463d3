"""RL objectives: policy ratio, KL estimators, group advantages, PPO/GRPO/GSPO losses, TIS.

Pure functions, jit- and grad-friendly. Conventions shared by every function:

* Shapes: log-probs, masks and segment ids are ``[..., T]`` (``T`` tokens per row,
  typically ``[B, T]``); per-sequence quantities are ``[...]`` (one per row).
* ``mask`` is bool (or 0/1): masked positions contribute exactly 0 to every loss
  and metric, receive zero gradient, and may hold any value (NaN included): the
  inputs are selected with ``where`` before any nonlinearity.
* All math is float32 (bf16/fp16 inputs are upcast). Advantages, rewards and
  old/reference log-probs carry no gradient.
* Denominators are global: token and sequence counts go through
  :mod:`jaxrl_kernels.reductions` with ``axis_names`` (the mesh axes the rows or
  tokens are split over, inside ``shard_map``), so a loss is the same however
  the batch is split. ``denominator=`` replaces the count by a number known from
  outside, e.g. the step total of a gradient-accumulation loop
  (:mod:`jaxrl_kernels.train`), so that micro-batch losses add up to the loss of
  one big batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_kernels.reductions import AxisNames, _axis_names, masked_count, masked_mean, masked_sum

KL_KINDS = ("k1", "k2", "k3")
Metrics = dict[str, jax.Array]


def _f32(x) -> jax.Array:
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32) if jnp.issubdtype(
      x.dtype, jnp.inexact) else jnp.float32)


def _check_like(fn: str, ref_name: str, ref, **others) -> tuple[int, ...]:
  shape = jnp.shape(ref)
  if len(shape) < 1:
    raise ValueError(f"{fn}: {ref_name} must have a token axis [..., T], got shape {shape}")
  for name, x in others.items():
    if x is not None and jnp.shape(x) != shape:
      raise ValueError(f"{fn}: {name} must have the shape of {ref_name} {shape}, got "
                       f"{jnp.shape(x)}")
  return shape


def _active(mask) -> jax.Array:
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def _log_ratio(logp, base, active) -> jax.Array:
  """``logp - base`` at active tokens, exactly 0 elsewhere (so exp() is finite there)."""
  d = _f32(logp) - lax.stop_gradient(_f32(base))
  return jnp.where(active, d, jnp.zeros((), d.dtype))


def _per_token(fn: str, x, shape: tuple[int, ...], name: str) -> jax.Array:
  """A per-sequence ``[...]`` or per-token ``[..., T]`` array as ``[..., T]``."""
  x = jnp.asarray(x)
  if x.shape == shape:
    return x
  if x.shape == shape[:-1]:
    return jnp.broadcast_to(x[..., None], shape)
  raise ValueError(f"{fn}: {name} must be per sequence {shape[:-1]} or per token {shape}, "
                   f"got {x.shape}")


def _masked_max(x, active, axis_names: AxisNames, *, sign: float) -> jax.Array:
  """max (sign=+1) or min (sign=-1) over active positions and devices; 1.0 if none."""
  fill = jnp.asarray(-jnp.inf, x.dtype)
  m = sign * jnp.max(jnp.where(active, sign * x, fill), initial=fill)
  names = _axis_names(axis_names)
  if names:
    m = lax.pmax(m, names) if sign > 0 else lax.pmin(m, names)
  return jnp.where(jnp.isfinite(m), m, jnp.ones((), x.dtype))


def _divide(total, count, denominator) -> jax.Array:
  denom = count if denominator is None else jnp.asarray(denominator, total.dtype)
  return total / jnp.maximum(denom, jnp.ones((), total.dtype))


def _reduce_tokens(per_token, active, *, token_level: bool, axis_names: AxisNames,
                   denominator) -> jax.Array:
  """Token-level: Σ_tokens x / N_tokens. Sequence-level: Σ_seq mean_t(x) / N_seq.

  Counts are global over ``axis_names`` unless ``denominator`` is given. For the
  sequence-level form each row must lie on one device (rows may be split over
  ``axis_names``, a row's tokens may not).
  """
  if token_level:
    total = masked_sum(per_token, active, axis_names=axis_names)
    return _divide(total, masked_count(active, axis_names=axis_names), denominator)
  n_row = masked_count(active, axis=-1)
  row_mean = masked_sum(per_token, active, axis=-1) / jnp.maximum(n_row, 1.0)
  has_tokens = n_row > 0
  total = masked_sum(row_mean, has_tokens, axis_names=axis_names)
  return _divide(total, masked_count(has_tokens, axis_names=axis_names), denominator)


def policy_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
  r"""Per-token importance ratio :math:`r_t = \exp(\log\pi_t - \log\pi^{old}_t)`.

  Args:
    logp: ``[..., T]`` log-probs of the policy being trained (differentiated).
    old_logp: ``[..., T]`` log-probs of the behaviour policy (no gradient).
    mask: ``[..., T]`` bool; masked tokens get ratio exactly 1.

  Returns:
    ``[..., T]`` float32.

  >>> policy_ratio(jnp.log(jnp.array([.5, .2])), jnp.log(jnp.array([.25, .1])),
  ...              jnp.array([True, False]))
  Array([2., 1.], dtype=float32)
  """
  _check_like("policy_ratio", "logp", logp, old_logp=old_logp, mask=mask)
  return jnp.exp(_log_ratio(logp, old_logp, _active(mask)))


def kl(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, kind: str = "k3") -> jax.Array:
  r"""Per-token estimator of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})` from samples of :math:`\pi`.

  With :math:`d_t = \log\pi_{ref,t} - \log\pi_t` (Schulman's estimators):

  * ``"k1"``: :math:`-d` (unbiased, high variance, can be negative),
  * ``"k2"``: :math:`d^2 / 2` (biased, low variance),
  * ``"k3"``: :math:`e^{d} - d - 1` (unbiased, >= 0; GRPO's choice).

  Args:
    logp: ``[..., T]`` log-probs of the trained policy (differentiated).
    ref_logp: ``[..., T]`` reference log-probs (no gradient).
    mask: ``[..., T]`` bool; masked tokens give exactly 0.
    kind: ``"k1"``, ``"k2"`` or ``"k3"``.

  Returns:
    ``[..., T]`` float32; reduce it with :func:`~jaxrl_kernels.reductions.masked_mean`.
  """
  if kind not in KL_KINDS:
    raise ValueError(f"kl: kind must be one of {KL_KINDS}, got {kind!r}")
  _check_like("kl", "logp", logp, ref_logp=ref_logp, mask=mask)
  active = _active(mask)
  d = -_log_ratio(logp, ref_logp, active)  # ref - logp, 0 at masked tokens
  if kind == "k1":
    out = -d
  elif kind == "k2":
    out = 0.5 * d * d
  else:
    out = jnp.expm1(d) - d  # expm1: accurate for the small d of nearby policies
  return jnp.where(active, out, jnp.zeros((), out.dtype))


def group_advantages(rewards: jax.Array, groups: int | jax.Array, *, normalize_std: bool = True,
                     eps: float = 1e-6, mask: jax.Array | None = None) -> jax.Array:
  r"""GRPO group-relative advantages :math:`A_i = (r_i - \mu_g) / (\sigma_g + \epsilon)`.

  :math:`\mu_g` and :math:`\sigma_g` are the mean and the sample standard deviation
  (``n - 1`` in the denominator, as in TRL and verl) of the rewards of sample
  ``i``'s group ``g`` over its valid samples. A group of one valid sample, or one
  whose rewards are all equal, gets advantages exactly 0 (never NaN).

  Args:
    rewards: ``[N]`` one scalar reward per sample (no gradient).
    groups: either ``samples_per_prompt`` (an int ``k``: samples ``[j k, (j+1) k)``
      form group ``j``; ``N % k == 0``) or ``group_ids``, an int array ``[N]`` of
      arbitrary ids (equal id = same prompt; need not be sorted or contiguous).
    normalize_std: divide by :math:`\sigma_g + \epsilon` (``False``: Dr. GRPO's
      mean-centering only).
    eps: added to :math:`\sigma_g`.
    mask: optional ``[N]`` bool; invalid samples are left out of the group
      statistics and get advantage 0. A group with no valid sample is empty and
      affects nothing.

  Returns:
    ``[N]`` float32 advantages. All samples of a group must be in ``rewards`` (on
    one device); compute advantages before sharding rows otherwise.

  >>> group_advantages(jnp.array([1., 0., 1., 1.]), 2)
  Array([ 0.70710576, -0.70710576,  0.        ,  0.        ], dtype=float32)
  """
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 1:
    raise ValueError(f"group_advantages: rewards must be 1-D [N], got shape {rewards.shape}")
  n = rewards.shape[0]
  if isinstance(groups, (int, np.integer)) and not isinstance(groups, bool):
    k = int(groups)
    if k < 1 or n % k:
      raise ValueError(f"group_advantages: samples_per_prompt={k} must be >= 1 and divide the "
                       f"number of rewards {n}")
    ids, num_groups = jnp.arange(n) // k, n // k
  else:
    ids = jnp.asarray(groups)
    if ids.shape != (n,) or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"group_advantages: groups must be an int samples_per_prompt or integer "
                       f"group_ids of shape ({n},), got {ids.dtype} {ids.shape}")
    # Arbitrary ids (e.g. prompt hashes) -> dense [0, n): at most n groups.
    ids = jnp.unique(ids, size=n, return_inverse=True, fill_value=0)[1].reshape(n)
    num_groups = n
  if not eps > 0:
    raise ValueError(f"group_advantages: eps must be > 0, got {eps}")
  valid = jnp.ones((n,), bool) if mask is None else _active(mask)
  if valid.shape != (n,):
    raise ValueError(f"group_advantages: mask must have shape ({n},), got {valid.shape}")
  r = jnp.where(valid, _f32(lax.stop_gradient(rewards)), 0.0)
  count = jax.ops.segment_sum(valid.astype(jnp.float32), ids, num_groups)
  mean = jax.ops.segment_sum(r, ids, num_groups) / jnp.maximum(count, 1.0)
  centered = jnp.where(valid, r - mean[ids], 0.0)
  if normalize_std:
    var = jax.ops.segment_sum(centered * centered, ids, num_groups) / jnp.maximum(count - 1, 1.0)
    centered = centered / (jnp.sqrt(var)[ids] + eps)
  return jnp.where(valid, centered, 0.0)


def ppo_clip_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                  *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                  token_level: bool = True, axis_names: AxisNames = (),
                  denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""PPO clipped surrogate loss (with DAPO's asymmetric clip and optional dual clip).

  Per active token, with :math:`r_t = e^{\log\pi_t - \log\pi^{old}_t}`:

  .. math::
     \ell_t = \max\big(-A_t r_t,\ -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{low}, 1+\epsilon_{high})\big)

  and with ``dual_clip = c > 1``, for :math:`A_t < 0`: :math:`\ell_t \leftarrow
  \min(\ell_t, -c A_t)` (Ye et al., 2020). The loss is

  * ``token_level=True``: :math:`\sum_t \ell_t / N_{tokens}` (DAPO token mean),
  * ``token_level=False``: :math:`\sum_s \mathrm{mean}_{t\in s} \ell_t / N_{seq}`
    (sequence mean; only rows with an active token count),

  with global counts over ``axis_names`` (or ``denominator`` instead of the
  count). Truncated importance sampling: pass ``advantages * tis_weights(...)``
  (weights are >= 0, so this equals weighting :math:`\ell_t`).

  Args:
    logp: ``[..., T]`` log-probs of the trained policy (differentiated).
    old_logp: ``[..., T]`` behaviour-policy log-probs (no gradient).
    advantages: ``[...]`` per sequence or ``[..., T]`` per token (no gradient).
    mask: ``[..., T]`` bool, active (response) tokens.
    clip_low, clip_high: :math:`\epsilon_{low} \in [0, 1)`, :math:`\epsilon_{high} \ge 0`.
    dual_clip: ``None`` or :math:`c > 1`.
    token_level: token mean (True) or sequence mean (False).
    axis_names: mesh axes the rows (and, for ``token_level=True``, tokens) are
      split over, inside ``shard_map``.
    denominator: replaces the global token (or sequence) count, e.g. the step
      total under gradient accumulation; values below 1 count as 1.

  Returns:
    ``(loss, metrics)``: float32 scalar loss; metrics (float32 scalars, token
    level, global over ``axis_names``): ``clipfrac`` (tokens where the clip is
    active), ``dual_clipfrac`` (with ``dual_clip``), ``approx_kl``
    (:math:`\mathrm{mean}(r - 1 - \log r)`), ``ratio_mean``, ``ratio_min``,
    ``ratio_max`` (1 with no active token), ``num_tokens``.
  """
  fn = "ppo_clip_loss"
  shape = _check_like(fn, "logp", logp, old_logp=old_logp, mask=mask)
  if not 0 <= clip_low < 1 or not clip_high >= 0:
    raise ValueError(f"{fn}: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                     f"clip_high={clip_high}")
  if dual_clip is not None and not dual_clip > 1:
    raise ValueError(f"{fn}: dual_clip must be None or > 1, got {dual_clip}")
  active = _active(mask)
  log_ratio = _log_ratio(logp, old_logp, active)
  ratio = jnp.exp(log_ratio)
  adv = lax.stop_gradient(_f32(_per_token(fn, advantages, shape, "advantages")))
  adv = jnp.where(active, adv, 0.0)
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  pg = jnp.maximum(pg1, pg2)
  metrics = {"clipfrac": masked_mean(pg2 > pg1, active, axis_names=axis_names)}
  if dual_clip is not None:
    pg3 = -adv * dual_clip
    dual = (adv < 0) & (pg > pg3)
    pg = jnp.where(dual, pg3, pg)
    metrics["dual_clipfrac"] = masked_mean(dual, active, axis_names=axis_names)
  loss = _reduce_tokens(pg, active, token_level=token_level, axis_names=axis_names,
                        denominator=denominator)
  metrics.update(_ratio_metrics(log_ratio, ratio, active, axis_names))
  return loss, metrics


def _ratio_metrics(log_ratio, ratio, active, axis_names) -> Metrics:
  log_ratio, ratio = lax.stop_gradient(log_ratio), lax.stop_gradient(ratio)
  return {
      "approx_kl": masked_mean(jnp.expm1(log_ratio) - log_ratio, active, axis_names=axis_names),
      "ratio_mean": masked_mean(ratio, active, axis_names=axis_names),
      "ratio_min": _masked_max(ratio, active, axis_names, sign=-1.0),
      "ratio_max": _masked_max(ratio, active, axis_names, sign=1.0),
      "num_tokens": masked_count(active, axis_names=axis_names),
  }


def grpo_loss(logp: jax.Array, old_logp: jax.Array, rewards: jax.Array, groups: int | jax.Array,
              mask: jax.Array, *, ref_logp: jax.Array | None = None, beta: float = 0.0,
              kl_kind: str = "k3", clip_low: float = 0.2, clip_high: float = 0.2,
              dual_clip: float | None = None, token_level: bool = True,
              normalize_std: bool = True, eps: float = 1e-6, axis_names: AxisNames = (),
              denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""GRPO: :func:`ppo_clip_loss` on :func:`group_advantages`, plus :math:`\beta\,\mathrm{KL}`.

  .. math::  L = L_{clip}(A) + \beta\, \mathrm{reduce}_t\, \mathrm{kl}_t(\pi, \pi_{ref})

  where the KL term is reduced exactly like the clipped term (token or sequence
  level, same global denominator). Rows with no active token are padding: they
  are left out of the group statistics.

  Args:
    logp, old_logp, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
    rewards: ``[B]`` one reward per row.
    groups: ``samples_per_prompt`` or ``group_ids [B]`` (see :func:`group_advantages`).
    ref_logp: ``[B, T]`` reference-policy log-probs; required when ``beta != 0``;
      when given, ``metrics["kl"]`` reports the (token-mean) KL.
    beta: KL coefficient.
    kl_kind: estimator for the KL term (see :func:`kl`).
    Other arguments: as in :func:`ppo_clip_loss` and :func:`group_advantages`.

  Returns:
    ``(loss, metrics)``: the metrics of :func:`ppo_clip_loss` plus ``pg_loss``
    and, with ``ref_logp``, ``kl``.
  """
  fn = "grpo_loss"
  shape = _check_like(fn, "logp", logp, old_logp=old_logp, mask=mask, ref_logp=ref_logp)
  if len(shape) != 2:
    raise ValueError(f"{fn}: logp must be [B, T], got shape {shape}")
  if beta != 0 and ref_logp is None:
    raise ValueError(f"{fn}: beta={beta} needs ref_logp")
  active = _active(mask)
  adv = group_advantages(rewards, groups, normalize_std=normalize_std, eps=eps,
                         mask=jnp.any(active, axis=-1))
  pg_loss, metrics = ppo_clip_loss(logp, old_logp, adv, active, clip_low=clip_low,
                                   clip_high=clip_high, dual_clip=dual_clip,
                                   token_level=token_level, axis_names=axis_names,
                                   denominator=denominator)
  metrics["pg_loss"] = pg_loss
  loss = pg_loss
  if ref_logp is not None:
    kl_t = kl(logp, ref_logp, active, kind=kl_kind)
    metrics["kl"] = masked_mean(lax.stop_gradient(kl_t), active, axis_names=axis_names)
    if beta != 0:
      loss = loss + beta * _reduce_tokens(kl_t, active, token_level=token_level,
                                          axis_names=axis_names, denominator=denominator)
  return loss, metrics


def gspo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
              segment_ids: jax.Array, *, clip_low: float = 3e-4, clip_high: float = 4e-4,
              axis_names: AxisNames = (),
              denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""GSPO (Zheng et al., 2025): a clipped objective on the sequence-level ratio.

  For each document :math:`s` of a packed batch, with :math:`n_s` its active tokens,

  .. math::
     \log s_s = \frac{1}{n_s} \sum_{t \in s} (\log\pi_t - \log\pi^{old}_t), \qquad
     \ell_s = \max\big(-A_s s_s,\ -A_s \mathrm{clip}(s_s, 1-\epsilon_{lo}, 1+\epsilon_{hi})\big)

  and :math:`L = \sum_t w_t\, \ell_{s(t)} / N_{docs}` with per-token weight
  :math:`w_t = m_t / n_{s(t)}` (each document's weights sum to 1), i.e. the mean
  of :math:`\ell_s` over documents with an active token, the count being global
  over ``axis_names`` (or ``denominator``).

  Segment ids index ``advantages``. Padding tokens past the last real document
  (ids ``>= S``, as produced by a search over document boundaries) are clamped
  onto the last document ``S - 1`` instead of indexing out of range; they must be
  masked and then contribute exactly 0. An *active* token with an id outside
  ``[0, S)`` makes the loss NaN (never a silent finite value).

  Args:
    logp, old_logp, mask: ``[..., T]`` as in :func:`ppo_clip_loss`.
    advantages: ``[S]`` one advantage per document (no gradient); ``S`` is static.
    segment_ids: ``[..., T]`` int, the document of each token, in ``[0, S)``,
      numbered over the whole (local) batch. A document must lie on one device.
    clip_low, clip_high: clip range of :math:`s_s` (GSPO uses 3e-4 / 4e-4).
    axis_names: mesh axes the documents are split over, inside ``shard_map``.
    denominator: replaces the global document count.

  Returns:
    ``(loss, metrics)``: ``clipfrac`` (fraction of documents clipped),
    ``seq_ratio_mean``, ``num_documents``, and the token-level ``approx_kl``,
    ``ratio_mean/min/max``, ``num_tokens`` of :func:`ppo_clip_loss`.
  """
  fn = "gspo_loss"
  shape = _check_like(fn, "logp", logp, old_logp=old_logp, mask=mask, segment_ids=segment_ids)
  advantages = jnp.asarray(advantages)
  if advantages.ndim != 1 or advantages.shape[0] < 1:
    raise ValueError(f"{fn}: advantages must be [S] with S >= 1 documents, got shape "
                     f"{advantages.shape}")
  segment_ids = jnp.asarray(segment_ids)
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"{fn}: segment_ids must be integers, got {segment_ids.dtype}")
  if not 0 <= clip_low < 1 or not clip_high >= 0:
    raise ValueError(f"{fn}: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                     f"clip_high={clip_high}")
  del shape
  num_docs = advantages.shape[0]
  active = _active(mask).reshape(-1)
  raw_ids = segment_ids.reshape(-1)
  ids = jnp.clip(raw_ids, 0, num_docs - 1)  # padding past the last document -> last document
  log_ratio = _log_ratio(jnp.reshape(logp, -1), jnp.reshape(old_logp, -1), active)
  n_doc = jax.ops.segment_sum(active.astype(jnp.float32), ids, num_docs)
  inv_n = 1.0 / jnp.maximum(n_doc, 1.0)
  seq_ratio = jnp.exp(jax.ops.segment_sum(log_ratio, ids, num_docs) * inv_n)
  adv = lax.stop_gradient(_f32(advantages))
  l1 = -adv * seq_ratio
  l2 = -adv * jnp.clip(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_doc = jnp.maximum(l1, l2)
  per_token = jnp.where(active, inv_n[ids] * per_doc[ids], 0.0)  # weight m_t / n_s
  has_doc = n_doc > 0
  loss = _divide(masked_sum(per_token, active, axis_names=axis_names),
                 masked_count(has_doc, axis_names=axis_names), denominator)
  # An active token outside every document (on any device) poisons the loss.
  stray = masked_count(active & (raw_ids != ids), axis_names=axis_names) > 0
  loss = jnp.where(stray, jnp.nan, loss)
  metrics = {
      "clipfrac": masked_mean(l2 > l1, has_doc, axis_names=axis_names),
      "seq_ratio_mean": masked_mean(lax.stop_gradient(seq_ratio), has_doc, axis_names=axis_names),
      "num_documents": masked_count(has_doc, axis_names=axis_names),
  }
  metrics.update(_ratio_metrics(log_ratio, jnp.exp(log_ratio), active, axis_names))
  return loss, metrics


def tis_weights(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array,
                threshold: float = 2.0) -> jax.Array:
  r"""Truncated importance-sampling weights for rollout/trainer mismatch.

  .. math::  w_t = \min\big(e^{\log\pi^{train}_t - \log\pi^{rollout}_t},\ C\big)

  (Yao et al., 2025), correcting for the rollout engine sampling from a slightly
  different distribution than the trainer computes. No gradient; 0 at masked
  tokens. Use as ``ppo_clip_loss(..., advantages=adv[:, None] * w, ...)``.

  Args:
    train_logp: ``[..., T]`` trainer log-probs of the behaviour policy.
    rollout_logp: ``[..., T]`` log-probs reported by the rollout engine.
    mask: ``[..., T]`` bool.
    threshold: the truncation :math:`C > 0`.

  Returns:
    ``[..., T]`` float32 weights in ``[0, C]``.
  """
  _check_like("tis_weights", "train_logp", train_logp, rollout_logp=rollout_logp, mask=mask)
  if not threshold > 0:
    raise ValueError(f"tis_weights: threshold must be > 0, got {threshold}")
  active = _active(mask)
  w = jnp.minimum(jnp.exp(_log_ratio(train_logp, rollout_logp, active)), threshold)
  return lax.stop_gradient(jnp.where(active, w, 0.0))
