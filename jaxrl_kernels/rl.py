"""RL objectives: policy ratio, KL estimators, group advantages, PPO/GRPO/GSPO losses, TIS.

Pure functions, jit- and grad-friendly. Conventions shared by every function:

* Shapes: log-probs, masks and segment ids are ``[..., T]`` (``T`` tokens per row,
  typically ``[B, T]``); per-sequence quantities are ``[...]`` (one per row).
* ``mask`` is keyword-only everywhere (``None``: every token is active). It is bool,
  or integer/float holding exactly 0 and 1 (anything else is a ValueError, see
  :func:`jaxrl_kernels._validation.as_mask`). Masked positions contribute exactly 0
  to every loss and metric, receive exactly zero gradient, and may hold any value
  (NaN and inf included) in every input: the inputs are selected with ``where``
  before any arithmetic, never multiplied by the mask.
* Ratios are ``exp`` of a log-ratio clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``
  so that loss and gradient stay finite for every finite input; the losses report
  how often the clamp fired (``log_ratio_clampfrac``).
* All math is float32 (bf16/fp16 inputs are upcast). Advantages, rewards and
  old/reference log-probs carry no gradient.
* Hyper-parameters (``clip_low``, ``clip_high``, ``dual_clip``, ``beta``, ``eps``,
  ``threshold``, ``denominator``) may be Python numbers or traced float scalars
  (e.g. a schedule inside ``jit``). Concrete values are range-checked eagerly;
  traced ones with ``checkify.debug_check`` (active under ``checkify.checkify``).
* Denominators are global: token and sequence counts go through
  :mod:`jaxrl_kernels.reduce.masked` with ``axis_names`` (the mesh axes the rows or
  tokens are split over, inside ``shard_map``), so a loss is the same however
  the batch is split. ``denominator=`` replaces the count by a number known from
  outside, e.g. the step total of a gradient-accumulation loop
  (:mod:`jaxrl_kernels.train`), so that micro-batch losses add up to the loss of
  one big batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from jaxrl_kernels import _validation as val
from jaxrl_kernels.linear_logp.objective import linear_objective
from jaxrl_kernels.linear_logp.vocab_parallel_objective import vocab_parallel_linear_objective
from jaxrl_kernels.reduce.masked import (
    AxisNames,
    as_axis_names,
    masked_count,
    masked_mean,
    masked_sum,
)

KL_KINDS = ("k1", "k2", "k3")
Metrics = dict[str, jax.Array]

#: Bound on every log-ratio before ``exp``: ``exp(20) ~ 4.9e8`` is finite in float32 with
#: room for any sane advantage, while ``exp(89)`` overflows. verl clamps at the same value.
#: Beyond the bound the ratio is constant, so such tokens get zero gradient (as a clipped
#: PPO token does); ``metrics["log_ratio_clampfrac"]`` reports how often it happens.
LOG_RATIO_CLAMP = 20.0

_F = TypeVar("_F", bound=Callable[..., Any])


_keyword_mask = val.keyword_mask


def _real(fn: str, name: str, x, *, kinds: str = "iuf") -> jax.Array:
  """``x`` (list, numpy, jax) as a float32 array (float64 stays float64 under x64)."""
  if x is None:
    raise TypeError(f"{fn}: {name} must be an array, got None")
  if not isinstance(x, jax.Array | np.ndarray | jax.core.Tracer):
    try:
      x = np.asarray(x)
    except (TypeError, ValueError):
      raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}") from None
  kind = val.dtype_kind(x.dtype)
  if kind not in kinds:
    raise TypeError(f"{fn}: {name} must be a real array, got dtype {x.dtype}")
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32) if kind == "f" else jnp.float32)


def _tokens(fn: str, ref_name: str, ref, **others) -> tuple[tuple[int, ...], dict[str, Any]]:
  """Checks ``[..., T]`` token arrays of one shape; returns the shape and float32 arrays."""
  ref = _real(fn, ref_name, ref)
  shape = tuple(ref.shape)
  if len(shape) < 1:
    raise ValueError(f"{fn}: {ref_name} must have a token axis [..., T], got shape {shape}")
  out = {ref_name: ref}
  for name, x in others.items():
    if x is None:
      out[name] = None
      continue
    x = _real(fn, name, x)
    if tuple(x.shape) != shape:
      raise ValueError(f"{fn}: {name} must have the shape of {ref_name} {shape}, got "
                       f"{tuple(x.shape)}")
    out[name] = x
  return shape, out


def _mask(fn: str, mask, shape: tuple[int, ...]) -> jax.Array:
  if mask is None:
    return jnp.ones(shape, bool)
  return val.as_mask(fn, "mask", mask, shape)


def _hyper(fn: str, name: str, value, *, lo: float, lo_open: bool = False,
           hi: float | None = None):
  """A Python float checked to lie in ``[lo, hi)`` (``(lo, ...`` with ``lo_open``), or a
  traced float32 scalar whose range is debug-checked (see the module docstring)."""
  v = val.as_scalar(fn, name, value)
  if isinstance(v, float):
    ok = (v > lo if lo_open else v >= lo) and (hi is None or v < hi)
  else:
    ok = (v > lo if lo_open else v >= lo) & (True if hi is None else v < hi)
  bound = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi is None else f" and < {hi:g}")
  if isinstance(v, float):
    if not ok:
      raise ValueError(f"{fn}: {name} must be {bound}, got {name}={v}")
  else:
    checkify.debug_check(ok, f"{fn}: {name} must be {bound}")
  return v


def _denominator(fn: str, denominator):
  """``denominator=`` checked to be > 0 (a value below 1, e.g. a Dr.GRPO constant, is used
  as given: only the count of tokens is kept at least 1, so no tokens give a loss of 0)."""
  if denominator is None:
    return None
  return _hyper(fn, "denominator", denominator, lo=0.0, lo_open=True)


def _log_ratio(logp, base, active) -> jax.Array:
  """``logp - base`` at active tokens, exactly 0 elsewhere (so exp() is finite there)."""
  d = logp - lax.stop_gradient(base)
  return jnp.where(active, d, jnp.zeros((), d.dtype))


def _clamp(log_ratio) -> jax.Array:
  return jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _per_token(fn: str, x, shape: tuple[int, ...], name: str, active) -> jax.Array:
  """A per-sequence ``[...]`` or per-token ``[..., T]`` array as ``[..., T]``, 0 where masked."""
  x = lax.stop_gradient(_real(fn, name, x, kinds="biuf"))
  if x.shape == shape:
    pass
  elif x.shape == shape[:-1]:
    x = jnp.broadcast_to(x[..., None], shape)
  else:
    raise ValueError(f"{fn}: {name} must be per sequence {shape[:-1]} or per token {shape}, "
                     f"got {x.shape}")
  return jnp.where(active, x, jnp.zeros((), x.dtype))


def _masked_max(x, active, axis_names: AxisNames, *, sign: float) -> jax.Array:
  """max (sign=+1) or min (sign=-1) over active positions and devices; 1.0 if none."""
  fill = jnp.asarray(-jnp.inf, x.dtype)
  m = sign * jnp.max(jnp.where(active, sign * x, fill), initial=fill)
  names = as_axis_names(axis_names)
  if names:
    m = lax.pmax(m, names) if sign > 0 else lax.pmin(m, names)
  return jnp.where(jnp.isfinite(m), m, jnp.ones((), x.dtype))


def _divide(total, count, denominator) -> jax.Array:
  if denominator is not None:
    return total / jnp.asarray(denominator, total.dtype)
  return total / jnp.maximum(count, jnp.ones((), total.dtype))


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


@_keyword_mask
def policy_ratio(logp: jax.Array, old_logp: jax.Array, *,
                 mask: jax.Array | None = None) -> jax.Array:
  r"""Per-token importance ratio :math:`r_t = \exp(\mathrm{clamp}(\log\pi_t - \log\pi^{old}_t))`.

  The log-ratio is clamped to ``±LOG_RATIO_CLAMP`` (the ratio the losses use).

  Args:
    logp: ``[..., T]`` log-probs of the policy being trained (differentiated).
    old_logp: ``[..., T]`` log-probs of the behaviour policy (no gradient).
    mask: ``[..., T]`` bool (or 0/1); masked tokens get ratio exactly 1.

  Returns:
    ``[..., T]`` float32.

  >>> policy_ratio(jnp.log(jnp.array([.5, .2])), jnp.log(jnp.array([.25, .1])),
  ...              mask=jnp.array([True, False]))
  Array([2., 1.], dtype=float32)
  """
  fn = "policy_ratio"
  shape, a = _tokens(fn, "logp", logp, old_logp=old_logp)
  active = _mask(fn, mask, shape)
  return jnp.exp(_clamp(_log_ratio(a["logp"], a["old_logp"], active)))


@_keyword_mask
def kl(logp: jax.Array, ref_logp: jax.Array, *, mask: jax.Array | None = None,
       kind: str = "k3") -> jax.Array:
  r"""Per-token estimator of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})` from samples of :math:`\pi`.

  With :math:`d_t = \log\pi_{ref,t} - \log\pi_t` (Schulman's estimators):

  * ``"k1"``: :math:`-d` (unbiased, high variance, can be negative),
  * ``"k2"``: :math:`d^2 / 2` (biased, low variance),
  * ``"k3"``: :math:`e^{d} - d - 1` (unbiased, >= 0; GRPO's choice), with :math:`d`
    clamped to ``±LOG_RATIO_CLAMP`` so that it is finite for every finite input.

  Args:
    logp: ``[..., T]`` log-probs of the trained policy (differentiated).
    ref_logp: ``[..., T]`` reference log-probs (no gradient).
    mask: ``[..., T]`` bool (or 0/1); masked tokens give exactly 0.
    kind: ``"k1"``, ``"k2"`` or ``"k3"``.

  Returns:
    ``[..., T]`` float32; reduce it with :func:`~jaxrl_kernels.reduce.masked.masked_mean`.
  """
  fn = "kl"
  kind = val.check_choice(fn, "kind", kind, KL_KINDS)
  shape, a = _tokens(fn, "logp", logp, ref_logp=ref_logp)
  active = _mask(fn, mask, shape)
  d = -_log_ratio(a["logp"], a["ref_logp"], active)  # ref - logp, 0 at masked tokens
  if kind == "k1":
    out = -d
  elif kind == "k2":
    out = 0.5 * d * d
  else:
    d = _clamp(d)
    out = jnp.expm1(d) - d  # expm1: accurate for the small d of nearby policies
  return jnp.where(active, out, jnp.zeros((), out.dtype))


def group_advantages(rewards: jax.Array, groups: int | jax.Array, *,
                     mask: jax.Array | None = None, normalize_std: bool = True,
                     eps: float | jax.Array = 1e-6) -> jax.Array:
  r"""GRPO group-relative advantages :math:`A_i = (r_i - \mu_g) / (\sigma_g + \epsilon)`.

  :math:`\mu_g` and :math:`\sigma_g` are the mean and the sample standard deviation
  (``n - 1`` in the denominator, as in TRL and verl) of the rewards of sample
  ``i``'s group ``g`` over its valid samples.

  Numerics: the statistics are taken of :math:`r_i - r_{f(g)}`, the rewards minus the
  group's first valid reward (shift-invariant math, but no cancellation), with a
  two-pass mean. So a group whose rewards are all equal gets advantages **exactly 0**
  for every group size and value, and a group of one valid sample too (never NaN).
  ``eps`` bounds the division: near-equal rewards (``σ << eps``) give advantages of
  order ``(r - μ) / eps``, not ±1. A NaN/inf reward of a valid sample makes its
  group's advantages NaN (and no other group's); invalid samples may hold anything.

  Args:
    rewards: ``[N]`` one scalar reward per sample (no gradient).
    groups: either ``samples_per_prompt`` (an int ``k``: samples ``[j k, (j+1) k)``
      form group ``j``; ``N % k == 0``) or ``group_ids``, an int array ``[N]`` of
      arbitrary ids (equal id = same prompt; need not be sorted or contiguous).
    mask: optional ``[N]`` bool (or 0/1); invalid samples are left out of the group
      statistics and get advantage 0. A group with no valid sample is empty and
      affects nothing.
    normalize_std: divide by :math:`\sigma_g + \epsilon` (``False``: Dr. GRPO's
      mean-centering only).
    eps: added to :math:`\sigma_g`; > 0.

  Returns:
    ``[N]`` float32 advantages. All samples of a group must be in ``rewards`` (on
    one device); compute advantages before sharding rows otherwise.

  >>> group_advantages(jnp.array([1., 0., 1., 1.]), 2)
  Array([ 0.70710576, -0.70710576,  0.        ,  0.        ], dtype=float32)
  """
  fn = "group_advantages"
  rewards = _real(fn, "rewards", rewards, kinds="biuf")
  if rewards.ndim != 1:
    raise ValueError(f"{fn}: rewards must be 1-D [N], got shape {rewards.shape}")
  n = rewards.shape[0]
  if isinstance(groups, int | np.integer) and not isinstance(groups, bool | np.bool_):
    k = int(groups)
    if k < 1 or n % k:
      raise ValueError(f"{fn}: samples_per_prompt={k} must be >= 1 and divide the "
                       f"number of rewards {n}")
    ids, num_groups = jnp.arange(n) // k, n // k
  else:
    if isinstance(groups, bool | float | np.bool_ | np.floating):
      raise TypeError(f"{fn}: groups must be an int samples_per_prompt or integer group_ids "
                      f"of shape ({n},), got {groups!r}")
    g = val.as_ids(fn, "groups", groups)
    if g.shape != (n,):
      raise ValueError(f"{fn}: groups must be an int samples_per_prompt or integer group_ids "
                       f"of shape ({n},), got {g.dtype} {g.shape}")
    # Arbitrary ids (e.g. prompt hashes) -> dense [0, n): at most n groups.
    ids = jnp.unique(g, size=n, return_inverse=True, fill_value=0)[1].reshape(n)
    num_groups = n
  normalize_std = val.check_bool(fn, "normalize_std", normalize_std)
  eps = _hyper(fn, "eps", eps, lo=0.0, lo_open=True)
  valid = jnp.ones((n,), bool) if mask is None else val.as_mask(fn, "mask", mask, (n,))
  if n == 0:
    return jnp.zeros((0,), jnp.float32)
  r = jnp.where(valid, lax.stop_gradient(rewards), 0.0)
  # The group's first valid reward: subtracting it makes an all-equal group exactly 0.
  pos = jnp.where(valid, jnp.arange(n), n)
  first = jax.ops.segment_min(pos, ids, num_groups)
  x = jnp.where(valid, r - r[jnp.minimum(first, n - 1)][ids], 0.0)
  count = jax.ops.segment_sum(valid.astype(jnp.float32), ids, num_groups)
  mean = jax.ops.segment_sum(x, ids, num_groups) / jnp.maximum(count, 1.0)
  centered = jnp.where(valid, x - mean[ids], 0.0)
  if normalize_std:
    var = jax.ops.segment_sum(centered * centered, ids, num_groups) / jnp.maximum(count - 1, 1.0)
    centered = centered / (jnp.sqrt(var)[ids] + eps)
  return jnp.where(valid, centered, 0.0)


@_keyword_mask
def ppo_clip_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, *,
                  mask: jax.Array | None = None, clip_low: float | jax.Array = 0.2,
                  clip_high: float | jax.Array = 0.2, dual_clip: float | jax.Array | None = None,
                  token_level: bool = True, axis_names: AxisNames = (),
                  denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""PPO clipped surrogate loss (with DAPO's asymmetric clip and optional dual clip).

  Per active token, with :math:`r_t = e^{\mathrm{clamp}(\log\pi_t - \log\pi^{old}_t)}`
  (clamped to ``±LOG_RATIO_CLAMP``):

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
    mask: ``[..., T]`` bool (or 0/1), active (response) tokens; ``None``: all.
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
    ``ratio_max`` (1 with no active token), ``log_ratio_clampfrac`` (tokens whose
    log-ratio hit ``±LOG_RATIO_CLAMP``), ``num_tokens``.
  """
  fn = "ppo_clip_loss"
  shape, a = _tokens(fn, "logp", logp, old_logp=old_logp)
  active = _mask(fn, mask, shape)
  clip_low = _hyper(fn, "clip_low", clip_low, lo=0.0, hi=1.0)
  clip_high = _hyper(fn, "clip_high", clip_high, lo=0.0)
  if dual_clip is not None:
    dual_clip = _hyper(fn, "dual_clip", dual_clip, lo=1.0, lo_open=True)
  token_level = val.check_bool(fn, "token_level", token_level)
  denominator = _denominator(fn, denominator)
  adv = _per_token(fn, advantages, shape, "advantages", active)
  log_ratio = _log_ratio(a["logp"], a["old_logp"], active)
  pg, pg1, pg2, dual = _ppo_terms(log_ratio, adv, clip_low, clip_high, dual_clip)
  metrics = {"clipfrac": masked_mean(pg2 > pg1, active, axis_names=axis_names)}
  if dual_clip is not None:
    metrics["dual_clipfrac"] = masked_mean(dual, active, axis_names=axis_names)
  loss = _reduce_tokens(pg, active, token_level=token_level, axis_names=axis_names,
                        denominator=denominator)
  metrics.update(_ratio_metrics(log_ratio, active, axis_names))
  return loss, metrics


def _ppo_terms(log_ratio, adv, clip_low, clip_high, dual_clip):
  """Per token: the clipped surrogate ``pg``, its two sides and the dual-clip selection
  (None without ``dual_clip``). Element-wise: :func:`linear_policy_loss`'s three-GEMM
  path differentiates it token by token."""
  ratio = jnp.exp(_clamp(log_ratio))
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  pg = jnp.maximum(pg1, pg2)
  dual = None
  if dual_clip is not None:
    pg3 = -adv * dual_clip
    dual = (adv < 0) & (pg > pg3)
    pg = jnp.where(dual, pg3, pg)
  return pg, pg1, pg2, dual


def _ratio_metrics(log_ratio, active, axis_names) -> Metrics:
  log_ratio = lax.stop_gradient(log_ratio)
  clamped = _clamp(log_ratio)
  ratio = jnp.exp(clamped)
  return {
      "approx_kl": masked_mean(jnp.expm1(clamped) - clamped, active, axis_names=axis_names),
      "ratio_mean": masked_mean(ratio, active, axis_names=axis_names),
      "ratio_min": _masked_max(ratio, active, axis_names, sign=-1.0),
      "ratio_max": _masked_max(ratio, active, axis_names, sign=1.0),
      "log_ratio_clampfrac": masked_mean(jnp.abs(log_ratio) > LOG_RATIO_CLAMP, active,
                                         axis_names=axis_names),
      "num_tokens": masked_count(active, axis_names=axis_names),
  }


@_keyword_mask
def grpo_loss(logp: jax.Array, old_logp: jax.Array, rewards: jax.Array, groups: int | jax.Array,
              *, mask: jax.Array | None = None, ref_logp: jax.Array | None = None,
              beta: float | jax.Array = 0.0, kl_kind: str = "k3",
              clip_low: float | jax.Array = 0.2, clip_high: float | jax.Array = 0.2,
              dual_clip: float | jax.Array | None = None, token_level: bool = True,
              normalize_std: bool = True, eps: float | jax.Array = 1e-6,
              axis_names: AxisNames = (),
              denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""GRPO: :func:`ppo_clip_loss` on :func:`group_advantages`, plus :math:`\beta\,\mathrm{KL}`.

  .. math::  L = L_{clip}(A) + \beta\, \mathrm{reduce}_t\, \mathrm{kl}_t(\pi, \pi_{ref})

  where the KL term is reduced exactly like the clipped term (token or sequence
  level, same global denominator). Rows with no active token are padding: they
  are left out of the group statistics, and their rewards may hold anything.

  Args:
    logp, old_logp: ``[B, T]`` as in :func:`ppo_clip_loss`.
    rewards: ``[B]`` one reward per row.
    groups: ``samples_per_prompt`` or ``group_ids [B]`` (see :func:`group_advantages`).
    mask: ``[B, T]`` bool (or 0/1); ``None``: all tokens active.
    ref_logp: ``[B, T]`` reference-policy log-probs; required when ``beta`` is
      non-zero or traced; when given, ``metrics["kl"]`` reports the (token-mean) KL.
    beta: KL coefficient.
    kl_kind: estimator for the KL term (see :func:`kl`).
    Other arguments: as in :func:`ppo_clip_loss` and :func:`group_advantages`.

  Returns:
    ``(loss, metrics)``: the metrics of :func:`ppo_clip_loss` plus ``pg_loss``
    and, with ``ref_logp``, ``kl``.
  """
  fn = "grpo_loss"
  shape, a = _tokens(fn, "logp", logp, old_logp=old_logp, ref_logp=ref_logp)
  if len(shape) != 2:
    raise ValueError(f"{fn}: logp must be [B, T], got shape {shape}")
  rewards = _real(fn, "rewards", rewards, kinds="biuf")
  if tuple(rewards.shape) != shape[:1]:
    raise ValueError(f"{fn}: rewards must hold one reward per row of logp {shape}: shape "
                     f"{shape[:1]}, got {tuple(rewards.shape)}")
  kl_kind = val.check_choice(fn, "kl_kind", kl_kind, KL_KINDS)
  beta = val.as_scalar(fn, "beta", beta)
  if ref_logp is None and not (isinstance(beta, float) and beta == 0):
    raise ValueError(f"{fn}: beta={beta} needs ref_logp")
  active = _mask(fn, mask, shape)
  adv = group_advantages(rewards, groups, normalize_std=normalize_std, eps=eps,
                         mask=jnp.any(active, axis=-1))
  pg_loss, metrics = ppo_clip_loss(a["logp"], a["old_logp"], adv, mask=active,
                                   clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                                   token_level=token_level, axis_names=axis_names,
                                   denominator=denominator)
  metrics["pg_loss"] = pg_loss
  loss = pg_loss
  if ref_logp is not None:
    kl_t = kl(a["logp"], a["ref_logp"], mask=active, kind=kl_kind)
    metrics["kl"] = masked_mean(lax.stop_gradient(kl_t), active, axis_names=axis_names)
    if not (isinstance(beta, float) and beta == 0):
      loss = loss + beta * _reduce_tokens(kl_t, active, token_level=token_level,
                                          axis_names=axis_names,
                                          denominator=_denominator(fn, denominator))
  return loss, metrics


@_keyword_mask
def gspo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
              segment_ids: jax.Array, *, mask: jax.Array | None = None,
              clip_low: float | jax.Array = 3e-4, clip_high: float | jax.Array = 4e-4,
              axis_names: AxisNames = (),
              denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""GSPO (Zheng et al., 2025): a clipped objective on the sequence-level ratio.

  For each document :math:`s` of a packed batch, with :math:`n_s` its active tokens,

  .. math::
     \log s_s = \mathrm{clamp}\Big(\frac{1}{n_s} \sum_{t \in s}
                (\log\pi_t - \log\pi^{old}_t)\Big), \qquad
     \ell_s = \max\big(-A_s s_s,\ -A_s \mathrm{clip}(s_s, 1-\epsilon_{lo}, 1+\epsilon_{hi})\big)

  (the clamp to ``±LOG_RATIO_CLAMP`` keeps :math:`s_s` finite) and
  :math:`L = \sum_t w_t\, \ell_{s(t)} / N_{docs}` with per-token weight
  :math:`w_t = m_t / n_{s(t)}` (each document's weights sum to 1), i.e. the mean
  of :math:`\ell_s` over documents with an active token, the count being global
  over ``axis_names`` (or ``denominator``).

  Segment ids index ``advantages``. Padding tokens past the last real document
  (ids ``>= S``, as produced by a search over document boundaries) are clamped
  onto the last document ``S - 1`` instead of indexing out of range; they must be
  masked and then contribute exactly 0. An *active* token with an id outside
  ``[0, S)`` makes the loss NaN (never a silent finite value). Advantages of
  documents without an active token may hold anything.

  Args:
    logp, old_logp: ``[..., T]`` as in :func:`ppo_clip_loss`.
    advantages: ``[S]`` one advantage per document (no gradient); ``S`` is static.
    segment_ids: ``[..., T]`` int, the document of each token, in ``[0, S)``,
      numbered over the whole (local) batch. A document must lie on one device.
    mask: ``[..., T]`` bool (or 0/1); ``None``: all tokens active.
    clip_low, clip_high: clip range of :math:`s_s` (GSPO uses 3e-4 / 4e-4).
    axis_names: mesh axes the documents are split over, inside ``shard_map``.
    denominator: replaces the global document count.

  Returns:
    ``(loss, metrics)``: ``clipfrac`` (fraction of documents clipped),
    ``seq_ratio_mean``, ``seq_log_ratio_clampfrac`` (documents whose log-ratio hit the
    clamp), ``num_documents``, and the token-level ``approx_kl``,
    ``ratio_mean/min/max``, ``log_ratio_clampfrac``, ``num_tokens`` of
    :func:`ppo_clip_loss`.
  """
  fn = "gspo_loss"
  shape, a = _tokens(fn, "logp", logp, old_logp=old_logp)
  active = _mask(fn, mask, shape).reshape(-1)
  advantages = _real(fn, "advantages", advantages, kinds="biuf")
  if advantages.ndim != 1 or advantages.shape[0] < 1:
    raise ValueError(f"{fn}: advantages must be [S] with S >= 1 documents, got shape "
                     f"{advantages.shape}")
  segment_ids = val.as_ids(fn, "segment_ids", segment_ids)
  if tuple(segment_ids.shape) != shape:
    raise ValueError(f"{fn}: segment_ids must have the shape of logp {shape}, got "
                     f"{tuple(segment_ids.shape)}")
  clip_low = _hyper(fn, "clip_low", clip_low, lo=0.0, hi=1.0)
  clip_high = _hyper(fn, "clip_high", clip_high, lo=0.0)
  denominator = _denominator(fn, denominator)
  num_docs = advantages.shape[0]
  raw_ids = segment_ids.reshape(-1)
  ids = jnp.clip(raw_ids, 0, num_docs - 1)  # padding past the last document -> last document
  log_ratio = _log_ratio(a["logp"].reshape(-1), a["old_logp"].reshape(-1), active)
  n_doc = jax.ops.segment_sum(active.astype(jnp.float32), ids, num_docs)
  inv_n = 1.0 / jnp.maximum(n_doc, 1.0)
  has_doc = n_doc > 0
  seq_log_ratio = jax.ops.segment_sum(log_ratio, ids, num_docs) * inv_n
  seq_ratio = jnp.exp(_clamp(seq_log_ratio))
  adv = jnp.where(has_doc, lax.stop_gradient(advantages), 0.0)
  l1 = -adv * seq_ratio
  l2 = -adv * jnp.clip(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_doc = jnp.maximum(l1, l2)
  per_token = jnp.where(active, inv_n[ids] * per_doc[ids], 0.0)  # weight m_t / n_s
  loss = _divide(masked_sum(per_token, active, axis_names=axis_names),
                 masked_count(has_doc, axis_names=axis_names), denominator)
  # An active token outside every document (on any device) poisons the loss.
  stray = masked_count(active & (raw_ids != ids), axis_names=axis_names) > 0
  loss = jnp.where(stray, jnp.nan, loss)
  seq_log_ratio = lax.stop_gradient(seq_log_ratio)
  metrics = {
      "clipfrac": masked_mean(l2 > l1, has_doc, axis_names=axis_names),
      "seq_ratio_mean": masked_mean(lax.stop_gradient(seq_ratio), has_doc, axis_names=axis_names),
      "seq_log_ratio_clampfrac": masked_mean(jnp.abs(seq_log_ratio) > LOG_RATIO_CLAMP, has_doc,
                                             axis_names=axis_names),
      "num_documents": masked_count(has_doc, axis_names=axis_names),
  }
  metrics.update(_ratio_metrics(log_ratio, active, axis_names))
  return loss, metrics


@_keyword_mask
def tis_weights(train_logp: jax.Array, rollout_logp: jax.Array, *,
                mask: jax.Array | None = None, threshold: float | jax.Array = 2.0) -> jax.Array:
  r"""Truncated importance-sampling weights for rollout/trainer mismatch.

  .. math::  w_t = \min\big(e^{\mathrm{clamp}(\log\pi^{train}_t - \log\pi^{rollout}_t)},\ C\big)

  (Yao et al., 2025), correcting for the rollout engine sampling from a slightly
  different distribution than the trainer computes. No gradient; 0 at masked
  tokens. Use as ``ppo_clip_loss(..., advantages=adv[:, None] * w, ...)``.

  Args:
    train_logp: ``[..., T]`` trainer log-probs of the behaviour policy.
    rollout_logp: ``[..., T]`` log-probs reported by the rollout engine.
    mask: ``[..., T]`` bool (or 0/1); ``None``: all tokens active.
    threshold: the truncation :math:`C > 0`.

  Returns:
    ``[..., T]`` float32 weights in ``[0, C]``.
  """
  fn = "tis_weights"
  shape, a = _tokens(fn, "train_logp", train_logp, rollout_logp=rollout_logp)
  active = _mask(fn, mask, shape)
  threshold = _hyper(fn, "threshold", threshold, lo=0.0, lo_open=True)
  d = _clamp(_log_ratio(a["train_logp"], a["rollout_logp"], active))
  w = jnp.minimum(jnp.exp(d), threshold)
  return lax.stop_gradient(jnp.where(active, w, 0.0))


POLICY_OBJECTIVES = ("ppo", "gspo")


def _is_zero(x) -> bool:
  """A static (Python) zero: the term it weights is left out of the program."""
  return isinstance(x, int | float) and not isinstance(x, bool) and x == 0


@_keyword_mask
def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, *,
                entropy: jax.Array | None = None, mask: jax.Array | None = None,
                ref_logp: jax.Array | None = None, beta: float | jax.Array = 0.0,
                kl_kind: str = "k3", entropy_coef: float | jax.Array = 0.0,
                objective: str = "ppo", clip_low: float | jax.Array | None = None,
                clip_high: float | jax.Array | None = None,
                dual_clip: float | jax.Array | None = None, token_level: bool = True,
                segment_ids: jax.Array | None = None, axis_names: AxisNames = (),
                denominator: jax.Array | float | None = None) -> tuple[jax.Array, Metrics]:
  r"""A policy-gradient loss with a KL penalty and an entropy bonus, from per-token values.

  .. math::  L = L_{pg} + \beta\, \mathrm{reduce}_t\, \mathrm{kl}_t(\pi, \pi_{ref})
             - c_{ent}\, \mathrm{reduce}_t\, H_t

  with :math:`L_{pg}` :func:`ppo_clip_loss` (``objective="ppo"``: PPO, GRPO, DAPO, Dr.GRPO
  by the choice of advantages, clip range, ``token_level`` and ``denominator``) or
  :func:`gspo_loss` (``"gspo"``), and the KL and entropy terms reduced as the PPO term is
  (token or sequence level, the same global denominator; GSPO: token level). This is the
  objective :func:`linear_policy_loss` fuses into the LM head; given the head's ``logp`` and
  ``entropy`` (``linear_logp(..., return_entropy=True)``) it computes the same loss.

  Args:
    logp, old_logp, mask, token_level, axis_names, denominator: as in :func:`ppo_clip_loss`.
    advantages: ``"ppo"``: ``[...]`` per sequence or ``[..., T]`` per token; ``"gspo"``:
      ``[S]`` per document (with ``segment_ids``).
    entropy: ``[..., T]`` per-token entropies of the trained policy (differentiated);
      required when ``entropy_coef`` is not a static 0; reported as ``entropy_mean``.
    ref_logp, beta, kl_kind: the KL penalty, as in :func:`grpo_loss`.
    entropy_coef: :math:`c_{ent}` (a bonus: the loss decreases with the entropy).
    objective: ``"ppo"`` or ``"gspo"``.
    clip_low, clip_high: the clip range (default 0.2 / 0.2 for PPO, 3e-4 / 4e-4 for GSPO).
    dual_clip: PPO's dual clip, or None.
    segment_ids: ``"gspo"``: the document of each token (see :func:`gspo_loss`).

  Returns:
    ``(loss, metrics)``: the metrics of the policy term plus ``pg_loss``, with
    ``ref_logp`` ``kl`` (token mean), with ``entropy`` ``entropy_mean``.
  """
  fn = "policy_loss"
  objective = val.check_choice(fn, "objective", objective, POLICY_OBJECTIVES)
  kl_kind = val.check_choice(fn, "kl_kind", kl_kind, KL_KINDS)
  beta = val.as_scalar(fn, "beta", beta)
  entropy_coef = val.as_scalar(fn, "entropy_coef", entropy_coef)
  if ref_logp is None and not _is_zero(beta):
    raise ValueError(f"{fn}: beta={beta} needs ref_logp")
  if entropy is None and not _is_zero(entropy_coef):
    raise ValueError(f"{fn}: entropy_coef={entropy_coef} needs entropy")
  shape, a = _tokens(fn, "logp", logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy)
  active = _mask(fn, mask, shape)
  if objective == "ppo":
    if segment_ids is not None:
      raise ValueError(f"{fn}: segment_ids is a 'gspo' argument; objective='ppo'")
    pg, metrics = ppo_clip_loss(
        a["logp"], a["old_logp"], advantages, mask=active,
        clip_low=0.2 if clip_low is None else clip_low,
        clip_high=0.2 if clip_high is None else clip_high, dual_clip=dual_clip,
        token_level=token_level, axis_names=axis_names, denominator=denominator)
  else:
    if segment_ids is None:
      raise ValueError(f"{fn}: objective='gspo' needs segment_ids")
    if dual_clip is not None or not token_level:
      raise ValueError(f"{fn}: dual_clip and token_level=False are 'ppo' arguments; "
                       f"objective='gspo'")
    pg, metrics = gspo_loss(
        a["logp"], a["old_logp"], advantages, segment_ids, mask=active,
        clip_low=3e-4 if clip_low is None else clip_low,
        clip_high=4e-4 if clip_high is None else clip_high, axis_names=axis_names,
        denominator=denominator)
  metrics["pg_loss"] = pg
  loss = pg
  denominator = _denominator(fn, denominator)

  def reduce(x):
    return _reduce_tokens(x, active, token_level=token_level, axis_names=axis_names,
                          denominator=denominator)

  if ref_logp is not None:
    kl_t = kl(a["logp"], a["ref_logp"], mask=active, kind=kl_kind)
    metrics["kl"] = masked_mean(lax.stop_gradient(kl_t), active, axis_names=axis_names)
    if not _is_zero(beta):
      loss = loss + beta * reduce(kl_t)
  if entropy is not None:
    ent = jnp.where(active, a["entropy"], jnp.zeros((), a["entropy"].dtype))
    metrics["entropy_mean"] = masked_mean(lax.stop_gradient(ent), active,
                                          axis_names=axis_names)
    if not _is_zero(entropy_coef):
      loss = loss - entropy_coef * reduce(ent)
  return loss, metrics


_POLICY_ARRAYS = ("old_logp", "advantages", "mask", "ref_logp", "segment_ids")


def _policy_objective(logp, entropy, operands, cfg):
  """:func:`policy_loss` as :func:`linear_objective`'s objective: ``operands`` holds the
  arrays and the traced hyper-parameters, ``cfg`` the static ones (sorted name/value
  pairs)."""
  kw = dict(cfg)
  kw.update(operands)
  return policy_loss(logp, kw.pop("old_logp"), kw.pop("advantages"), entropy=entropy, **kw)


def _token_weights(active, *, token_level: bool, axis_names: AxisNames, denominator):
  """``w_t = d _reduce_tokens(x) / d x_t``, known before any log-prob: ``1 / N`` (token
  level) or ``(1 / N_seq) / n_row`` (sequence level), 0 at masked tokens."""
  if token_level:
    d = (jnp.asarray(denominator, jnp.float32) if denominator is not None
         else jnp.maximum(masked_count(active, axis_names=axis_names), 1.0))
    return jnp.where(active, 1.0 / d, 0.0)
  n_row = masked_count(active, axis=-1)
  d = (jnp.asarray(denominator, jnp.float32) if denominator is not None
       else jnp.maximum(masked_count(n_row > 0, axis_names=axis_names), 1.0))
  w_row = (1.0 / d) / jnp.maximum(n_row, 1.0)
  return jnp.where(active, w_row[..., None], 0.0)


_TOKEN_HYPER = ("beta", "entropy_coef", "clip_low", "clip_high", "dual_clip")


def _policy_token_operands(fn, shape, *, mask, old_logp, advantages, ref_logp, token_level,
                           axis_names, denominator, hyper):
  """The per-token values :func:`_policy_token_grad` reads, from the inputs alone."""
  active = _mask(fn, mask, shape)
  ops = {"active": active,
         "old_logp": _real(fn, "old_logp", old_logp),
         "advantages": _per_token(fn, advantages, shape, "advantages", active),
         "weight": _token_weights(active, token_level=token_level, axis_names=axis_names,
                                  denominator=_denominator(fn, denominator))}
  if ref_logp is not None:
    ops["ref_logp"] = _real(fn, "ref_logp", ref_logp)
  ops.update({k: v for k, v in hyper.items() if k in _TOKEN_HYPER})
  return ops


def _policy_token_grad(logp, entropy, ops, cfg):
  """``(g_logp, g_ent)`` of the ``"ppo"`` :func:`policy_loss` per token: the gradient of
  ``sum_t w_t (pg_t + beta kl_t - c_ent H_t)``, element-wise (``linear_objective``'s
  ``token_grad``; ``ops`` from :func:`_policy_token_operands`, ``cfg`` the static
  hyper-parameters)."""
  kw = dict(cfg)
  kw.update({k: v for k, v in ops.items() if k in _TOKEN_HYPER})
  active, w = ops["active"], ops["weight"]
  clip_low = 0.2 if kw["clip_low"] is None else kw["clip_low"]
  clip_high = 0.2 if kw["clip_high"] is None else kw["clip_high"]
  beta, entropy_coef = kw["beta"], kw["entropy_coef"]

  def loss(lp, en):
    log_ratio = _log_ratio(lp, ops["old_logp"], active)
    pg = _ppo_terms(log_ratio, ops["advantages"], clip_low, clip_high, kw["dual_clip"])[0]
    x = w * pg
    if "ref_logp" in ops and not _is_zero(beta):
      x = x + beta * (w * kl(lp, ops["ref_logp"], mask=active, kind=kw["kl_kind"]))
    if not _is_zero(entropy_coef):
      x = x - entropy_coef * (w * jnp.where(active, en, jnp.zeros((), en.dtype)))
    return jnp.sum(x)

  _, vjp = jax.vjp(loss, logp, entropy)
  return vjp(jnp.ones((), jnp.float32))


@_keyword_mask
def linear_policy_loss(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                       old_logp: jax.Array, advantages: jax.Array,
                       mask: jax.Array | None = None, ref_logp: jax.Array | None = None,
                       beta: float | jax.Array = 0.0, kl_kind: str = "k3",
                       entropy_coef: float | jax.Array = 0.0, objective: str = "ppo",
                       clip_low: float | jax.Array | None = None,
                       clip_high: float | jax.Array | None = None,
                       dual_clip: float | jax.Array | None = None, token_level: bool = True,
                       segment_ids: jax.Array | None = None, axis_names: AxisNames = (),
                       denominator: jax.Array | float | None = None,
                       bias: jax.Array | None = None, temperature: float | jax.Array = 1.0,
                       weight_layout: str = "hv", fp32_head: bool = False,
                       implementation: str | None = None,
                       config=None, vocab_axis=None, vocab_size: int | None = None,
                       merge: str = "all_gather") -> tuple[jax.Array, Metrics]:
  r""":func:`policy_loss` of the LM head's log-probs, fused into the head.

  ``hidden @ W (+ bias)`` at ``temperature`` gives the trained policy's ``logp`` of
  ``targets`` and its ``entropy`` (the kernels of
  :func:`~jaxrl_kernels.linear_logp.linear_logp`: the ``[..., V]`` logits never exist), and
  the forward pass also forms the loss's gradient w.r.t. ``hidden``, ``weight`` and
  ``bias`` (:func:`~jaxrl_kernels.linear_logp.objective.linear_objective`): the backward
  pass of ``jax.grad`` only scales it by the loss cotangent.

  Bits: ``metrics["logp"]`` and ``metrics["entropy"]`` are bitwise ``linear_logp``'s (so
  the sampler's); the loss, the other metrics and the gradients of ``jax.grad`` equal the
  unfused ``policy_loss(linear_logp(..., return_entropy=True), ...)`` to float rounding (the
  objective's sums and element-wise gradient are XLA code in another program); dH rows are
  batch-invariant (with a fixed ``denominator`` or exact global counts), dW deterministic run
  to run.

  Args:
    hidden: ``[..., T, H]`` (e.g. ``[B, T, H]``) final hidden states.
    weight, bias, temperature, weight_layout, fp32_head, implementation: as in
      ``linear_logp`` (not ``"xla"``).
    targets: ``[..., T]`` the sampled token ids.
    config: the backward's :class:`~jaxrl_kernels.linear_logp.BackwardConfig` or None.
      ``BackwardConfig(passes=3)``: ``objective="ppo"`` runs the three-GEMM head (the
      logits once per token chunk; the per-token gradient of this loss, whose weights come
      from the mask and the counts before the pass); ``"gspo"`` keeps the four-GEMM head.
    vocab_axis, vocab_size, merge: the vocab-parallel (tensor-parallel) head, inside
      ``shard_map``: ``weight`` (and ``bias``) is this device's vocabulary shard over the
      mesh axis ``vocab_axis``, ``vocab_size`` the real vocabulary size
      (:func:`~jaxrl_kernels.linear_logp.vocab_parallel_objective.vocab_parallel_linear_objective`;
      four GEMMs whatever ``config.passes``). The tokens and the objective's arrays are the
      same on every device of ``vocab_axis``, so ``axis_names`` must not name it.
    Other arguments: as in :func:`policy_loss`.

  Returns:
    ``(loss, metrics)``: the metrics of :func:`policy_loss` plus the per-token ``logp`` and
    ``entropy`` (float32, ``targets.shape``, 0 at masked tokens for ``logp``). Metrics carry
    no gradient.
  """
  fn = "linear_policy_loss"
  entropy_coef = val.as_scalar(fn, "entropy_coef", entropy_coef)
  arrays = dict(old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp,
                segment_ids=segment_ids)
  hyper = dict(beta=beta, kl_kind=kl_kind, entropy_coef=entropy_coef, objective=objective,
               clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
               token_level=token_level, axis_names=axis_names, denominator=denominator)
  operands = {k: v for k, v in arrays.items() if v is not None}
  static = {}
  for k, v in hyper.items():
    if isinstance(v, jax.Array | np.ndarray | np.generic) and not isinstance(v, np.str_):
      operands[k] = v
    else:
      static[k] = tuple(v) if isinstance(v, list) else v
  try:
    cfg = tuple(sorted(static.items()))
    hash(cfg)
  except TypeError as e:
    raise TypeError(f"{fn}: hyper-parameters must be numbers, strings or arrays: {e}") from None
  if vocab_axis is not None:
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names or ())
    if vocab_axis in names:
      raise ValueError(f"{fn}: axis_names {axis_names!r} must not name vocab_axis "
                       f"{vocab_axis!r}: the tokens are the same on each of its devices")
    if vocab_size is None:
      raise ValueError(f"{fn}: vocab_axis={vocab_axis!r} needs vocab_size (the real "
                       f"vocabulary size; weight is one device's shard)")
    loss, metrics, logp, ent = vocab_parallel_linear_objective(
        hidden, weight, targets, _policy_objective, operands, axis_name=vocab_axis,
        vocab_size=vocab_size, cfg=cfg, entropy_grad=not _is_zero(entropy_coef),
        mask=mask, bias_shard=bias, temperature=temperature, weight_layout=weight_layout,
        fp32_head=fp32_head, merge=merge, implementation=implementation, config=config)
    return loss, {**metrics, "logp": logp, "entropy": ent}
  token_grad = token_ops = None
  if objective == "ppo" and getattr(config, "passes", None) == 3:
    # A token-level objective: the three-GEMM head (linear_objective's token_grad).
    token_grad = _policy_token_grad
    token_ops = _policy_token_operands(
        fn, tuple(jnp.shape(targets)), mask=mask, old_logp=old_logp, advantages=advantages,
        ref_logp=ref_logp, token_level=token_level, axis_names=axis_names,
        denominator=denominator, hyper={k: v for k, v in hyper.items() if k in operands})
  loss, metrics, logp, ent = linear_objective(
      hidden, weight, targets, _policy_objective, operands, cfg=cfg,
      entropy_grad=not _is_zero(entropy_coef), bias=bias, temperature=temperature, mask=mask,
      weight_layout=weight_layout, fp32_head=fp32_head, implementation=implementation,
      config=config, token_grad=token_grad, token_operands=token_ops)
  metrics = dict(metrics)
  metrics["logp"] = logp
  metrics["entropy"] = ent
  return loss, metrics
