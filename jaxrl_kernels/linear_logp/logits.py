"""The sampler side of ``linear_logp``: its logits, and log-probs from them.

Contract: ``head_logits`` stores the very logits the fused op reduces (the
same kernel with a store epilogue), and with ``return_stats`` their
``(lse, entropy)`` from the same registers, so :func:`logp_from_stats` gives
the trainer's ``linear_logp`` bits (sampler == trainer, every implementation
but ``"xla"``).

Why not ``det_matmul`` for the logits: its K tile is the GEMM's contract (32
for float32) while the fused kernel walks H in its own ``block_h`` steps (64
in interpret mode), on Hopper bf16 it runs a different kernel (Mosaic), and an
fp32 head would need an fp32 copy of the weight; the two projections then
differ in their last bits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_kernels import _validation, contract
from jaxrl_kernels.gemm import det_matmul
from jaxrl_kernels.linear_logp import api, xla
from jaxrl_kernels.pallas import draw
from jaxrl_kernels.pallas import softmax_partials as sp


class LogitStats(NamedTuple):
  """Row statistics of sampler logits ``z`` (:func:`head_logits` with ``return_stats``).

  Attributes:
    lse: ``[...]`` float32 ``logsumexp(z)``.
    entropy: ``[...]`` float32 ``lse - sum softmax(z) z``.
  """

  lse: jax.Array
  entropy: jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
  layout: str
  compute_dtype: str
  implementation: str


def _project(hidden2d, weight, bias, temp, st: _Static, return_stats: bool = False):
  return api.backend(st.implementation).logits(
      hidden2d, weight, bias, layout=st.layout, temperature=1.0 if temp is None else temp,
      compute_dtype=st.compute_dtype, return_stats=return_stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _logits(hidden2d, weight, bias, temp, st):
  return _project(hidden2d, weight, bias, temp, st)


def _logits_fwd(hidden2d, weight, bias, temp, st):
  return _project(hidden2d, weight, bias, temp, st), (hidden2d, weight, bias, temp)


def _logits_bwd(st, res, g):
  hidden2d, weight, bias, temp = res
  # dz/d(h W + b) = 1 / temperature; the products run on the deterministic GEMM
  # (dh rows batch-invariant, dW / db deterministic run to run). "mosaic": the
  # GEMM's own choice by weight shape (Mosaic, or Triton where TMA cannot tile it).
  impl = None if st.implementation == "mosaic" else st.implementation
  if temp is not None:
    g = g / temp
  gc = g.astype(st.compute_dtype)
  hc = hidden2d.astype(st.compute_dtype)
  wc = weight.astype(st.compute_dtype)
  if st.layout == "hv":  # W [H, V]: dh = g W^T, dW = h^T g
    dh = det_matmul(gc, wc, transpose_b=True, out_dtype=jnp.float32, implementation=impl)
    dw = det_matmul(hc.T, gc, out_dtype=jnp.float32, implementation=impl)
  else:  # W [V, H]: dh = g W, dW = g^T h
    dh = det_matmul(gc, wc, out_dtype=jnp.float32, implementation=impl)
    dw = det_matmul(gc.T, hc, out_dtype=jnp.float32, implementation=impl)
  db = None if bias is None else jnp.sum(g, axis=0).astype(bias.dtype)
  return dh.astype(hidden2d.dtype), dw.astype(weight.dtype), db, None


_logits.defvjp(_logits_fwd, _logits_bwd)


def _stats_project(h2, weight, bias, temp, st):
  """``(z, (m, s, u))``: the logits and their per-tile statistics from one kernel pass, as
  values (the sampler's head: no gradient flows through them)."""
  def sg(x):
    return _validation.no_gradient("head_logits", "return_stats=True", x)

  return _project(sg(h2), sg(weight), None if bias is None else sg(bias),
                  None if temp is None else sg(temp), st, return_stats=True)


def _check_head(op, hidden, weight, bias, temperature, weight_layout, fp32_head,
                implementation):
  """The checked arguments of a sampler-side head op, its compute dtype and implementation."""
  _validation.check_choice(op, "weight_layout", weight_layout, api.LAYOUTS)
  _validation.check_bool(op, "fp32_head", fp32_head)
  hidden = jnp.asarray(hidden)
  weight = jnp.asarray(weight)
  if weight.ndim != 2 or hidden.ndim < 1:
    raise ValueError(f"{op}: need hidden [..., H] and a 2-D weight, got {hidden.shape} "
                     f"and {weight.shape}")
  _validation.check_float_array(op, "hidden", hidden)
  _validation.check_float_array(op, "weight", weight)
  hd, v = weight.shape if weight_layout == "hv" else weight.shape[::-1]
  if hidden.shape[-1] != hd:
    raise ValueError(f"{op}: hidden has {hidden.shape[-1]} features but weight "
                     f"{weight.shape} ({weight_layout!r}) has {hd}")
  if hidden.dtype != weight.dtype and not fp32_head:
    raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have "
                    f"the same dtype unless fp32_head=True")
  if v == 0:
    raise ValueError(f"{op}: the vocabulary is empty (weight shape {weight.shape})")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (v,):
      raise ValueError(f"{op}: bias must have shape ({v},), got {bias.shape}")
  temperature = _validation.as_temperature(op, temperature)
  compute_dtype = jnp.dtype(jnp.float32 if fp32_head else hidden.dtype)
  impl = api.resolve(op, implementation, compute_dtype)
  return hidden, weight, bias, temperature, compute_dtype, impl, hd, v


def head_logits(hidden: jax.Array, weight: jax.Array, *, bias: jax.Array | None = None,
                temperature: float | jax.Array = 1.0, weight_layout: str = "hv",
                fp32_head: bool = False, return_stats: bool = False,
                implementation: str | None = None):
  """Float32 logits ``z = (hidden @ W + bias) / temperature`` with the fused op's bits.

  Each logit is computed by ``linear_logp``'s own kernel for the
  implementation (the Triton/interpreted ``logits_tile``, the Mosaic forward
  with a store epilogue, or the CPU implementation's logits), so ``z[..., v]``
  is bitwise the logit that :func:`jaxrl_kernels.linear_logp` reduces for the
  same row, and (like it) independent of the batch, position, padding and
  chunking of the rows.

  Args:
    hidden: ``[..., H]`` float.
    weight: ``[H, V]`` (``"hv"``) or ``[V, H]`` (``"vh"``, a tied embedding, read in place).
    bias: ``[V]`` or None.
    temperature: a float > 0 or a float32 scalar (may be traced; the same bits
      either way).
    weight_layout: ``"hv"`` or ``"vh"``.
    fp32_head: tiles are upcast to float32 before the product (no fp32 copy of
      the weight); otherwise ``hidden`` and ``weight`` must share a dtype.
    return_stats: also return :class:`LogitStats` ``(lse, entropy)`` of each
      row, reduced inside the logits kernel from the same registers by the
      fused op's own per-tile code and merged by its merge: the entropy is
      bitwise ``linear_logp(..., return_entropy=True)``'s and
      :func:`logp_from_stats` gives its log-probs bitwise. Sampler-side: no
      gradient flows through either output (differentiating them raises).
    implementation: as in ``linear_logp`` (``"xla"``: plain ``jnp.dot``, not
      bitwise anything) or None (the default of ``linear_logp``: the logits
      carry the bits of that implementation's fused op).

  Returns:
    ``[..., V]`` float32 (and :class:`LogitStats` of ``[...]`` float32 arrays).
    Gradients of the logits w.r.t. hidden, weight and bias run on ``det_matmul``.
    Forward-mode autodiff is not supported (a ``custom_vjp``).

  >>> import jax.numpy as jnp
  >>> head_logits(jnp.ones((2, 4)), jnp.ones((4, 3)), implementation="interpret").tolist()
  [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
  """
  op = "head_logits"
  _validation.check_bool(op, "return_stats", return_stats)
  hidden, weight, bias, temperature, compute_dtype, impl, hd, v = _check_head(
      op, hidden, weight, bias, temperature, weight_layout, fp32_head, implementation)
  lead = hidden.shape[:-1]
  h2 = hidden.reshape(math.prod(lead), hd)
  if h2.shape[0] == 0:
    z0 = jnp.zeros((*lead, v), jnp.float32)
    empty = jnp.zeros(lead, jnp.float32)
    return (z0, LogitStats(empty, empty)) if return_stats else z0
  h2, weight = api.with_features(h2, weight, weight_layout)
  temp = sp.temperature_scalar(temperature)
  if impl == "xla":
    z = xla.logits(h2, weight, bias, layout=weight_layout,
                   temperature=1.0 if temp is None else temp, compute_dtype=compute_dtype)
    if not return_stats:
      return z.reshape(*lead, v)
    z = _validation.no_gradient(op, "return_stats=True", z)
    lse, ent = xla.logits_stats(z)
    return z.reshape(*lead, v), LogitStats(lse.reshape(lead), ent.reshape(lead))
  st = _Static(weight_layout, compute_dtype.name, impl)
  if not return_stats:
    return _logits(h2, weight, bias, temp, st).reshape(*lead, v)
  z, (m, s, u) = _stats_project(h2, weight, bias, temp, st)
  lse, _, ent = api.backend(impl).merge_partials(m, s, u)
  return z.reshape(*lead, v), LogitStats(lse.reshape(lead), ent.reshape(lead))


class LogitPartials(NamedTuple):
  """Per-vocabulary-tile row statistics of sampler logits, not yet merged
  (:func:`head_logits_partials`). ``[n_tiles, ...]`` float32 each: the tile's max ``m``,
  ``s = sum exp(z - m)`` and ``u = sum exp(z - m) (z - m)`` over its columns."""

  m: jax.Array
  s: jax.Array
  u: jax.Array


def _rows_and_tiles(hidden: jax.Array, hd: int, v: int):
  """``hidden [..., H]``'s leading shape, the head's vocabulary tile count and the rows as
  ``[T, H]``."""
  lead = hidden.shape[:-1]
  return lead, -(-v // contract.VOCAB_TILE), hidden.reshape(math.prod(lead), hd)


def _no_rows_partials(n_tiles: int, lead: tuple[int, ...]) -> LogitPartials:
  """The per-tile statistics of no rows: ``[n_tiles, *lead]`` with a zero-sized ``lead``."""
  empty = jnp.zeros((n_tiles, *lead), jnp.float32)
  return LogitPartials(empty - jnp.inf, empty, empty)


def head_logits_partials(hidden: jax.Array, weight: jax.Array, *, bias: jax.Array | None = None,
                         temperature: float | jax.Array = 1.0, weight_layout: str = "hv",
                         fp32_head: bool = False, implementation: str | None = None
                         ) -> tuple[jax.Array, LogitPartials]:
  """:func:`head_logits` with ``return_stats``, the merge left to the caller.

  The logits and their per-tile statistics come from the same kernel as
  ``head_logits(..., return_stats=True)``; :func:`merge_logit_partials` of them gives its
  :class:`LogitStats` bitwise, for the rows of one call or for the rows of many calls
  stacked along a row axis (the merge folds each row's tiles on their own). A sampler
  can so merge the statistics of many decode steps in one launch: the merge is a
  sequential fold over the vocabulary tiles, whose latency does not shrink with fewer rows.
  Arguments as :func:`head_logits`; ``"xla"`` has no partials (a ValueError).

  Returns:
    ``(logits [..., V] float32, LogitPartials of [n_tiles, ...])``.
  """
  op = "head_logits_partials"
  hidden, weight, bias, temperature, compute_dtype, impl, hd, v = _check_head(
      op, hidden, weight, bias, temperature, weight_layout, fp32_head, implementation)
  if impl == "xla":
    raise ValueError(f"{op}: implementation='xla' has no per-tile statistics; use "
                     f"head_logits(..., return_stats=True)")
  lead, n_tiles, h2 = _rows_and_tiles(hidden, hd, v)
  if h2.shape[0] == 0:
    return jnp.zeros((*lead, v), jnp.float32), _no_rows_partials(n_tiles, lead)
  h2, weight = api.with_features(h2, weight, weight_layout)
  temp = sp.temperature_scalar(temperature)
  st = _Static(weight_layout, compute_dtype.name, impl)
  z, (m, s, u) = _stats_project(h2, weight, bias, temp, st)
  parts = LogitPartials(*(x.reshape(n_tiles, *lead) for x in (m, s, u)))
  return z.reshape(*lead, v), parts


def head_draw_partials(hidden: jax.Array, weight: jax.Array, seed: jax.Array, *,
                       bias: jax.Array | None = None, temperature: float | jax.Array = 1.0,
                       weight_layout: str = "hv", fp32_head: bool = False,
                       implementation: str | None = None
                       ) -> tuple[jax.Array, jax.Array, LogitPartials]:
  """A token per row drawn from ``softmax(z)``, ``z`` the logits of :func:`head_logits`, with
  its logit and :func:`head_logits_partials`' statistics.

  The draw is the exponential race of :mod:`jaxrl_kernels.pallas.draw`, its noise keyed by
  ``seed`` (int32 ``[2]``, e.g. ``draw.seed_words(key)``) and the row index (the row of the
  flattened ``hidden``). On Hopper (``"mosaic"``) it runs in the LM head's epilogue and no
  logits reach memory; the other implementations run it on their stored logits, tile by
  tile. The token's logit and the statistics are the fused op's bits:
  :func:`merge_logit_partials` and ``logp = logit - lse`` give ``linear_logp``'s
  log-prob of the drawn token bitwise. ``"xla"`` has no partials (a ValueError).

  Returns:
    ``(tokens [...] int32, token logits [...] float32, LogitPartials of [n_tiles, ...])``.
  """
  op = "head_draw_partials"
  hidden, weight, bias, temperature, compute_dtype, impl, hd, v = _check_head(
      op, hidden, weight, bias, temperature, weight_layout, fp32_head, implementation)
  if impl == "xla":
    raise ValueError(f"{op}: implementation='xla' has no per-tile statistics; draw from "
                     f"head_logits(...) instead")
  seed = jnp.asarray(seed)
  if seed.shape != (2,) or seed.dtype != jnp.int32:
    raise ValueError(f"{op}: seed must be int32 [2] (draw.seed_words(key)), got "
                     f"{seed.dtype} {seed.shape}")
  lead, n_tiles, h2 = _rows_and_tiles(hidden, hd, v)
  if h2.shape[0] == 0:
    return (jnp.zeros(lead, jnp.int32), jnp.zeros(lead, jnp.float32),
            _no_rows_partials(n_tiles, lead))
  h2, weight = api.with_features(h2, weight, weight_layout)
  temp = sp.temperature_scalar(temperature)
  st = _Static(weight_layout, compute_dtype.name, impl)
  be = api.backend(impl)

  def sg(x):
    return _validation.no_gradient(op, "hidden/weight/bias", x)

  h2, weight = sg(h2), sg(weight)
  bias = None if bias is None else sg(bias)
  if be.logits_draw is not None:
    tokens, tz, (m, s, u) = be.logits_draw(
        h2, weight, bias, seed, layout=weight_layout,
        temperature=1.0 if temp is None else temp, compute_dtype=st.compute_dtype)
  else:
    z, (m, s, u) = _stats_project(h2, weight, bias, temp, st)
    tokens, tz = draw.draw_from_logits(z, seed, tile=contract.VOCAB_TILE)
  parts = LogitPartials(*(x.reshape(n_tiles, *lead) for x in (m, s, u)))
  return tokens.reshape(lead), tz.reshape(lead), parts


def merge_logit_partials(partials: LogitPartials, *, implementation: str | None = None
                         ) -> LogitStats:
  """:class:`LogitStats` of :func:`head_logits_partials`' statistics ``[n_tiles, ...]``
  (of one call, or of several calls' rows stacked on the axes after the first): the
  fused op's merge, in ascending tile order per row, bitwise ``head_logits(...,
  return_stats=True)``'s statistics of each row. ``implementation``: the one that made
  the partials (None: by device)."""
  op = "merge_logit_partials"
  m, s, u = (jnp.asarray(x) for x in partials)
  if not (m.shape == s.shape == u.shape) or m.ndim < 1:
    raise ValueError(f"{op}: partials must be three arrays of one shape [n_tiles, ...], got "
                     f"{m.shape}, {s.shape}, {u.shape}")
  for name, x in zip(("m", "s", "u"), (m, s, u), strict=True):
    if x.dtype != jnp.float32:
      raise TypeError(f"{op}: partials.{name} must be float32, got {x.dtype}")
  lead = m.shape[1:]
  if math.prod(lead) == 0:
    empty = jnp.zeros(lead, jnp.float32)
    return LogitStats(empty, empty)
  lse, _, ent = api.merge_partials(*(x.reshape(m.shape[0], -1) for x in (m, s, u)),
                                   implementation=implementation)
  return LogitStats(lse.reshape(lead), ent.reshape(lead))


def logp_from_stats(logits: jax.Array, stats: LogitStats, targets: jax.Array,
                    mask: jax.Array | None = None) -> jax.Array:
  """``logp = logits[..., t] - lse``: for ``(logits, stats) = head_logits(h, W, ...,
  return_stats=True)``, bitwise ``linear_logp(h, W, targets, ...)`` (the fused op's
  ``finalize`` on the same target logit and ``lse``). NaN for active ids outside
  ``[0, V)``; 0 where ``mask`` is False (bool or 0/1). No gradient (differentiating it
  raises: use ``linear_logp``)."""
  op = "logp_from_stats"
  logits = _validation.no_gradient(op, "logits", jnp.asarray(logits))
  t = _validation.as_ids(op, "targets", targets, shape=logits.shape[:-1])
  if stats.lse.shape != t.shape:
    raise ValueError(f"{op}: stats.lse must have shape {t.shape}, got {stats.lse.shape}")
  mask = _validation.as_mask(op, "mask", mask, t.shape)
  v = logits.shape[-1]
  tz = jnp.take_along_axis(logits, jnp.clip(t, 0, v - 1)[..., None], axis=-1)[..., 0]
  logp, _ = sp.finalize(tz, stats.lse, stats.entropy, t, mask, v)
  return logp


#: Implementations that can reduce given logits.
FROM_LOGITS = ("mosaic", "triton", "interpret", "cpu")


def logits_logp(logits: jax.Array, targets: jax.Array, *, mask: jax.Array | None = None,
                return_entropy: bool = False, compute_dtype=jnp.float32,
                implementation: str | None = None):
  """Log-probs (and entropy) of given float32 logits, merged like ``linear_logp``.

  ``logp = z[t] - logsumexp(z)``, ``entropy = logsumexp(z) - sum softmax(z) z``,
  computed from per-``VOCAB_TILE`` partials merged in ascending tile order by
  ``linear_logp``'s merge and finalize. For ``logits = head_logits(h, W, ...)``
  and the same implementation the result is bitwise ``linear_logp(h, W,
  targets, ...)`` under the Pallas interpreter; with ``"mosaic"`` on Hopper
  (the logit tiles are loaded into the fused kernel's wgmma accumulator layout
  and reduced by its own epilogue) the logp is bitwise and the entropy within
  a relative 1e-6; with ``"triton"`` on a GPU both are within a relative 1e-6
  (not bitwise: the compiled reduction of re-read logits may differ from the
  fused epilogue's). For the bitwise sampler path use ``head_logits(...,
  return_stats=True)`` and :func:`logp_from_stats`. No gradient (a
  sampler-side function: differentiating it raises).

  Args:
    logits: ``[..., V]`` float32 (already divided by the temperature).
    targets: ``[...]`` integer ids; active ids outside ``[0, V)`` give NaN.
    mask: ``[...]`` bool (or 0/1) or None; False positions give 0.
    return_entropy: also return the entropy.
    compute_dtype: the head's compute dtype (picks the implementation and the
      fused op's token tile, as the head's ``linear_logp`` does).
    implementation: ``"mosaic"``, ``"triton"``, ``"interpret"`` or None (on the
      CPU: ``"interpret"``).

  Returns:
    float32 ``logp`` of shape ``targets.shape``, or ``(logp, entropy)``.
  """
  op = "logits_logp"
  logits = jnp.asarray(logits)
  if logits.dtype != jnp.float32:
    raise TypeError(f"{op}: logits must be float32, got {logits.dtype}")
  targets = _validation.as_ids(op, "targets", targets, shape=logits.shape[:-1])
  mask = _validation.as_mask(op, "mask", mask, targets.shape)
  _validation.check_bool(op, "return_entropy", return_entropy)
  compute_dtype = _validation.as_float_dtype(op, "compute_dtype", compute_dtype)
  impl = api.resolve(op, implementation, compute_dtype, supported=FROM_LOGITS)
  lead, v = targets.shape, logits.shape[-1]
  t = math.prod(lead)
  if t == 0:
    z0 = jnp.zeros(lead, jnp.float32)
    return (z0, z0) if return_entropy else z0
  z2 = _validation.no_gradient(op, "logits", logits).reshape(t, v)
  t2 = targets.reshape(t)
  be = api.backend(impl)
  m, s, u, tz = be.partials_from_logits(z2, t2, compute_dtype=compute_dtype)
  lse, _, ent = be.merge_partials(m, s, u)
  logp, ent = sp.finalize(tz, lse, ent, t2, None if mask is None else mask.reshape(t), v)
  logp, ent = logp.reshape(lead), ent.reshape(lead)
  return (logp, ent) if return_entropy else logp
