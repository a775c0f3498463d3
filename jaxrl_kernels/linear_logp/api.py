"""``linear_logp``: LM-head projection + selected-token log-prob (+ entropy), fused."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxrl_kernels import _backend
from jaxrl_kernels.linear_logp import merge
from jaxrl_kernels.linear_logp.reference import linear_logp_xla
from jaxrl_kernels.pallas import linear_logp_bwd

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
# "mosaic": the Hopper forward (pallas/linear_logp_mosaic.py) for bf16/fp16 products, the
# default there (implementation=None); fp32 products always run on Triton (3xTF32).
_SUPPORTED = ("mosaic", "triton", "interpret", "xla")
_DEFAULT_CANDIDATES = ("mosaic", "triton", "interpret", "xla")


def supported_for(implementation: str | None, supported=_SUPPORTED) -> tuple[str, ...]:
  """What ``_backend.resolve`` may pick: every name when one is asked for, the
  default candidates for ``implementation=None`` (a switch kept for bring-up:
  a new kernel can be opt-in by leaving it out of ``_DEFAULT_CANDIDATES``)."""
  if implementation is None:
    return tuple(i for i in supported if i in _DEFAULT_CANDIDATES)
  return supported


@dataclasses.dataclass(frozen=True)
class _Static:
  layout: str
  temperature: float
  compute_dtype: str
  implementation: str
  vocab_size: int


def _is_concrete(x) -> bool:
  return x is not None and not isinstance(x, jax.core.Tracer)


def check_targets(targets, vocab_size: int, mask=None) -> None:
  """Checks that every active target id lies in ``[0, vocab_size)``.

  Concrete arrays: raises ``ValueError`` naming the first bad position. Traced
  arrays: emits a ``jax.experimental.checkify`` check (run the function under
  ``checkify.checkify`` to get the error out of ``jit``). Positions where
  ``mask`` is False are ignored (their ids may be anything, e.g. -100).

  >>> import jax.numpy as jnp
  >>> check_targets(jnp.array([0, 3, -100]), 4, mask=jnp.array([True, True, False]))
  """
  if _is_concrete(targets) and (mask is None or _is_concrete(mask)):
    t = np.asarray(targets)
    bad = (t < 0) | (t >= vocab_size)
    if mask is not None:
      bad &= np.asarray(mask, bool)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"linear_logp: {int(bad.sum())} active target id(s) outside [0, "
                       f"{vocab_size}); first at index {idx}: {int(t[idx])}")
    return
  t = jnp.asarray(targets)
  bad = (t < 0) | (t >= vocab_size)
  if mask is not None:
    bad = bad & jnp.asarray(mask, bool)
  checkify.check(~jnp.any(bad), "linear_logp: {n} active target id(s) outside [0, {v})",
                 n=jnp.sum(bad), v=jnp.int32(vocab_size))


def _forward(hidden, weight, bias, targets, mask, st: _Static):
  impl = st.implementation
  m, s, u, tz = merge.tile_partials(hidden, weight, bias, targets, weight_layout=st.layout,
                                    temperature=st.temperature, compute_dtype=st.compute_dtype,
                                    implementation=impl)
  lse, mean_z, ent = merge.merge_partials(m, s, u, implementation=impl)
  logp, ent = merge.finalize(tz, lse, ent, targets, mask, st.vocab_size)
  return (logp, ent), (lse, mean_z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(hidden, weight, bias, targets, mask, st):
  return _forward(hidden, weight, bias, targets, mask, st)[0]


def _fused_fwd(hidden, weight, bias, targets, mask, st):
  # The very same kernels as the primal: forward-only and training bits agree.
  out, (lse, mean_z) = _forward(hidden, weight, bias, targets, mask, st)
  return out, (hidden, weight, bias, targets, mask, lse, mean_z)


def _fused_bwd(st, res, cts):
  hidden, weight, bias, targets, mask, lse, mean_z = res
  g_logp, g_ent = (jnp.asarray(c, jnp.float32) for c in cts)
  # An active out-of-range target has logp NaN; its gradient is NaN too.
  invalid = (targets < 0) | (targets >= st.vocab_size)
  g_logp = jnp.where(invalid & (g_logp != 0), jnp.nan, g_logp)
  if mask is not None:
    g_logp = jnp.where(mask, g_logp, 0.0)
    g_ent = jnp.where(mask, g_ent, 0.0)
  dh, dw, db = linear_logp_bwd.backward_auto(
      hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, layout=st.layout,
      temperature=st.temperature, compute_dtype=st.compute_dtype,
      implementation=st.implementation)
  db = None if bias is None else db.astype(bias.dtype)
  return dh.astype(hidden.dtype), dw.astype(weight.dtype), db, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _validate(hidden, weight, targets, bias, mask, temperature, weight_layout, fp32_head,
              return_entropy):
  if weight_layout not in ("hv", "vh"):
    raise ValueError(f"linear_logp: weight_layout must be 'hv' ([H, V]) or 'vh' ([V, H]), got "
                     f"{weight_layout!r}")
  for name, flag in (("fp32_head", fp32_head), ("return_entropy", return_entropy)):
    if not isinstance(flag, bool):
      raise TypeError(f"linear_logp: {name} must be a bool, got {flag!r}")
  if hidden.ndim < 1:
    raise ValueError(f"linear_logp: hidden must be [..., H], got shape {hidden.shape}")
  if weight.ndim != 2:
    raise ValueError(f"linear_logp: weight must be 2-D ([H, V] for 'hv', [V, H] for 'vh'), got "
                     f"shape {weight.shape}")
  for name, x in (("hidden", hidden), ("weight", weight)):
    if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
      raise TypeError(f"linear_logp: {name} must be one of {_FLOAT_DTYPES}, got {x.dtype}")
  if hidden.dtype != weight.dtype and not fp32_head:
    raise TypeError(f"linear_logp: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have "
                    f"the same dtype unless fp32_head=True; cast one explicitly")
  h_w, v = weight.shape if weight_layout == "hv" else weight.shape[::-1]
  if hidden.shape[-1] != h_w:
    raise ValueError(f"linear_logp: hidden has {hidden.shape[-1]} features but weight "
                     f"{weight.shape} ({weight_layout!r}) has {h_w}")
  if v == 0:
    raise ValueError(f"linear_logp: the vocabulary is empty (weight shape {weight.shape})")
  if targets.shape != hidden.shape[:-1]:
    raise ValueError(f"linear_logp: targets must have shape {hidden.shape[:-1]} (hidden's "
                     f"leading dims), got {targets.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"linear_logp: targets must be integer ids, got {targets.dtype}")
  if mask is not None:
    if mask.shape != targets.shape:
      raise ValueError(f"linear_logp: mask must have shape {targets.shape}, got {mask.shape}")
    if mask.dtype != jnp.bool_:
      raise TypeError(f"linear_logp: mask must be bool (False = inactive), got {mask.dtype}")
  if bias is not None:
    if bias.shape != (v,):
      raise ValueError(f"linear_logp: bias must have shape ({v},), got {bias.shape}")
    if jnp.dtype(bias.dtype).name not in _FLOAT_DTYPES:
      raise TypeError(f"linear_logp: bias must be one of {_FLOAT_DTYPES}, got {bias.dtype}")
  if isinstance(temperature, jax.core.Tracer) or not isinstance(
      temperature, numbers.Real | np.ndarray | jax.Array):
    raise TypeError(f"linear_logp: temperature must be a static positive float, got "
                    f"{temperature!r}")
  temperature = float(temperature)
  if not (temperature > 0 and math.isfinite(temperature)):
    raise ValueError(f"linear_logp: temperature must be a finite float > 0, got {temperature}")
  return v, temperature


def linear_logp(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                bias: jax.Array | None = None, temperature: float = 1.0,
                mask: jax.Array | None = None, return_entropy: bool = False,
                weight_layout: str = "hv", fp32_head: bool = False,
                implementation: str | None = None):
  """Selected-token log-probs (and entropy) of an LM head, without the logits.

  With ``z = (hidden @ W + bias) / temperature`` (float32 accumulation):
  ``logp = z[t] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) z``.
  The ``[..., V]`` logits never exist: the kernels reduce each
  ``VOCAB_TILE``-wide tile of them to float32 partials and merge those in a
  fixed order, so logp and entropy are bitwise batch-, position-, padding-,
  chunk- and mode-invariant (CONTRACT.md section 1) for every implementation
  except ``"xla"``.

  Args:
    hidden: ``[..., H]`` float (bf16, fp16 or fp32).
    weight: ``[H, V]`` (``weight_layout="hv"``, a Dense kernel) or ``[V, H]``
      (``"vh"``, a tied embedding table, read in place).
    targets: ``[...]`` integer ids. Active ids outside ``[0, V)`` give NaN
      (and raise here when ``targets`` is a concrete array; see
      :func:`check_targets`).
    bias: ``[V]`` or None.
    temperature: static float > 0.
    mask: ``[...]`` bool or None; False positions return 0 and get no gradient.
    return_entropy: also return the entropy.
    weight_layout: ``"hv"`` or ``"vh"``.
    fp32_head: compute the projection from float32-upcast hidden and weight
      tiles (hidden and weight may then differ in dtype); gradients keep the
      parameters' dtypes.
    implementation: ``"mosaic"`` (Hopper, bf16/fp16 products: TMA + wgmma
      forward, Mosaic GEMM backward; the default there), ``"triton"`` (other
      GPUs, fp32 heads), ``"interpret"`` (CPU default) or
      ``"xla"`` (materialized reference; not invariant), or None. Each
      implementation has its own bits; the invariances hold within one.

  Returns:
    float32 ``logp`` of shape ``targets.shape``, or ``(logp, entropy)``.

  Gradients (``jax.custom_vjp``) w.r.t. hidden, weight and bias from both
  outputs: ``dz = (g_logp (onehot - p) - g_ent p (z - sum p z)) / temperature``,
  with logits recomputed tile by tile (residuals: two float32 per token).
  dH rows are batch-invariant; dW and db are deterministic run to run.

  >>> import jax.numpy as jnp, numpy as np
  >>> h = jnp.zeros((2, 4)); w = jnp.zeros((4, 8)); t = jnp.array([1, 5])
  >>> np.asarray(linear_logp(h, w, t, implementation="interpret"), np.float64).round(4).tolist()
  [-2.0794, -2.0794]
  """
  hidden = jnp.asarray(hidden)
  weight = jnp.asarray(weight)
  targets = targets if isinstance(targets, jax.core.Tracer) else jnp.asarray(targets)
  bias = None if bias is None else jnp.asarray(bias)
  v, temperature = _validate(hidden, weight, targets, bias, mask, temperature, weight_layout,
                             fp32_head, return_entropy)
  compute_dtype = jnp.float32 if fp32_head else hidden.dtype
  impl = _backend.resolve("linear_logp", implementation, compute_dtype,
                          supported=supported_for(implementation))
  if _is_concrete(targets) and (mask is None or _is_concrete(mask)):
    check_targets(targets, v, mask)  # eager calls fail loudly; traced ones give NaN
  lead = targets.shape
  t = math.prod(lead)
  h2 = hidden.reshape(t, hidden.shape[-1])
  t2 = targets.reshape(t).astype(jnp.int32)
  m2 = None if mask is None else mask.reshape(t)
  if t == 0:
    logp = ent = jnp.zeros((0,), jnp.float32)
  elif impl == "xla":
    logp, ent = linear_logp_xla(h2, weight, bias, t2, m2, temperature=temperature,
                                weight_layout=weight_layout, compute_dtype=compute_dtype)
  else:
    st = _Static(weight_layout, temperature, jnp.dtype(compute_dtype).name, impl, v)
    logp, ent = _fused(h2, weight, bias, t2, m2, st)
  logp = logp.reshape(lead)
  ent = ent.reshape(lead)
  return (logp, ent) if return_entropy else logp
