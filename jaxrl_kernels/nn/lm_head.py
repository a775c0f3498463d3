"""``LMHead``: the LM-head parameters, read by the fused log-prob op and by a sampler.

Three ways to read the head, with one definition of the logits between them:

* ``head(h, targets)``: selected-token log-probs (and entropy) through
  :func:`jaxrl_kernels.linear_logp`; the ``[..., V]`` logits never exist.
* ``head.logits(h)``: the float32 logits for a sampler, computed by
  :func:`head_logits` with the fused op's own projection: on Hopper with
  bf16/fp16 products (``"mosaic"``) the fused Mosaic kernel itself with a store
  epilogue (``linear_logp_mosaic.logits``); otherwise a Pallas kernel built on
  the fused Triton kernel's ``logits_tile`` (same vocab tile, same ``block_h``
  walk over H, same ``TuningConfig``). Either way every logit has the bits of
  the fused path's projection.
* ``head.logits(h, return_stats=True)``: the same logits plus :class:`LogitStats`
  ``(lse, entropy)`` reduced by the projection kernel itself, on the registers
  that hold the logit tile, with the fused kernel's per-tile statistics code.
  :func:`logp_from_stats` then gives the log-prob of any token the sampler
  picks: **the bitwise sampler path** (logp and entropy equal to the trainer's
  ``head(h, targets, return_entropy=True)`` on every implementation; tested on
  H100 with ``"mosaic"`` and ``"triton"`` and under the interpreter).
* ``head.logp_from_logits(logits, targets)``: :func:`logits_logp`, log-probs of
  logits given after the fact, through the fused op's per-tile partials code
  and its ``merge_partials`` / ``finalize``. A second kernel re-reads the
  logits from memory, and GPU compilers may reduce them with another
  instruction sequence than the fused epilogue: bitwise the trainer under the
  interpreter, logp bitwise with ``"mosaic"`` (entropy within 1e-6), logp and
  entropy within a relative 1e-6 with ``"triton"`` (H100: 2 of 37 rows differed
  in the last bit). Use it for logits you did not produce with ``head.logits``.

Why not ``det_matmul`` for the logits: its K tile is the GEMM's contract
(32 for float32) while the fused kernel walks H in ``block_h`` steps (64 in
interpret mode), on Hopper bf16 it runs a different kernel (Mosaic), and an
fp32 head would need an fp32 copy of the weight; the two projections then
differ in their last bits (``test_det_matmul_projection_differs_control``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels import _backend
from jaxrl_kernels.gemm import det_matmul
from jaxrl_kernels.linear_logp import linear_logp, merge
from jaxrl_kernels.pallas import linear_logp_fwd as _fwd
from jaxrl_kernels.pallas.linear_logp_fwd import VOCAB_TILE

# "mosaic" (Hopper, bf16/fp16) is the default there, as for linear_logp.
_SUPPORTED = ("mosaic", "triton", "interpret", "xla")
_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
_DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


# ----------------------------------------------------------------------------- logits kernel


def _logits_kernel(*refs, t, h, v, n_t, n_v, has_bias, group_t, stats, interpret, **tile_kw):
  refs = list(refs)
  h_ref, w_ref = refs[:2]
  b_ref = refs[2] if has_bias else None
  o_ref, *stat_refs = refs[2 + int(has_bias):]
  i, j = _fwd.swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * tile_kw["block_t"]
  col0 = j * VOCAB_TILE
  # The fused op's own tile function: the bits of each logit are the ones it reduces.
  z, _, _, row_ok, col_ok = _fwd.logits_tile(h_ref, w_ref, b_ref, row0, col0, t=t, h=h,
                                             v_local=v, **tile_kw)
  pltriton.store(o_ref.at[pl.ds(row0, tile_kw["block_t"]), pl.ds(col0, VOCAB_TILE)], z,
                 mask=row_ok[:, None] & col_ok[None, :])
  if stats:
    # linear_logp_fwd._partials_kernel's reduction of the same registers, in the
    # same kernel: a from-logits kernel (logits_logp), whose z is a load, compiled
    # u = sum e (z - m) differently on an H100 (last bit, a few rows).
    m, s, u = _fwd.tile_stats(z, col_ok, interpret=interpret)
    for ref, x in zip(stat_refs, (m, s, u)):
      pltriton.store(ref.at[j, pl.ds(row0, tile_kw["block_t"])], x, mask=row_ok)


def _logits_call(hidden2d, weight, bias, layout, temperature, compute_dtype, impl,
                 stats: bool = False):
  """``z [T, V]``, or ``(z, (m, s, u))`` with the fused op's per-tile partials."""
  if impl == "mosaic":
    from jaxrl_kernels.pallas import linear_logp_mosaic

    return linear_logp_mosaic.logits(hidden2d, weight, bias, layout=layout,
                                     temperature=temperature, compute_dtype=compute_dtype,
                                     return_stats=stats)
  interpret = impl == "interpret"
  t, hd = hidden2d.shape
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  cfg = _fwd.default_config(compute_dtype, interpret)  # the fused op's tiles
  n_t = pl.cdiv(t, cfg.block_t)
  n_v = pl.cdiv(v, VOCAB_TILE)
  kernel = functools.partial(
      _logits_kernel, t=t, h=hd, v=v, n_t=n_t, n_v=n_v, has_bias=bias is not None,
      group_t=cfg.group_t, block_t=cfg.block_t, block_h=cfg.block_h, layout=layout,
      temperature=float(temperature), compute_dtype=jnp.dtype(compute_dtype),
      precision=_fwd.dot_precision(compute_dtype, interpret), stats=stats, interpret=interpret)
  args = [hidden2d, weight] + ([] if bias is None else [bias])
  out_shape = [jax.ShapeDtypeStruct((t, v), jnp.float32)]
  if stats:
    out_shape += [jax.ShapeDtypeStruct((n_v, t), jnp.float32)] * 3
  out = pl.pallas_call(
      kernel,
      grid=(n_t * n_v,),
      out_shape=tuple(out_shape),
      interpret=interpret,
      name="lm_head_logits",
      **_fwd.compiler_params(cfg, interpret),
  )(*args)
  return (out[0], tuple(out[1:])) if stats else out[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logits(hidden2d, weight, bias, layout, temperature, compute_dtype, impl):
  return _logits_call(hidden2d, weight, bias, layout, temperature, compute_dtype, impl)


def _logits_fwd(hidden2d, weight, bias, layout, temperature, compute_dtype, impl):
  out = _logits_call(hidden2d, weight, bias, layout, temperature, compute_dtype, impl)
  return out, (hidden2d, weight, bias)


def _logits_bwd(layout, temperature, compute_dtype, impl, res, g):
  hidden2d, weight, bias = res
  # dz/d(h W + b) = 1 / temperature; the products run on the deterministic GEMM
  # (dh rows batch-invariant, dW / db deterministic run to run). "mosaic": the
  # GEMM's own choice by weight shape (Mosaic, or Triton where TMA cannot tile it).
  impl = None if impl == "mosaic" else impl
  g = g / jnp.float32(temperature)
  gc = g.astype(compute_dtype)
  hc = hidden2d.astype(compute_dtype)
  wc = weight.astype(compute_dtype)
  if layout == "hv":  # W [H, V]: dh = g W^T, dW = h^T g
    dh = det_matmul(gc, wc, transpose_b=True, out_dtype=jnp.float32, implementation=impl)
    dw = det_matmul(hc.T, gc, out_dtype=jnp.float32, implementation=impl)
  else:  # W [V, H]: dh = g W, dW = g^T h
    dh = det_matmul(gc, wc, out_dtype=jnp.float32, implementation=impl)
    dw = det_matmul(gc.T, hc, out_dtype=jnp.float32, implementation=impl)
  db = None if bias is None else jnp.sum(g, axis=0).astype(bias.dtype)
  return dh.astype(hidden2d.dtype), dw.astype(weight.dtype), db


_logits.defvjp(_logits_fwd, _logits_bwd)


def head_logits(hidden: jax.Array, weight: jax.Array, *, bias: jax.Array | None = None,
                temperature: float = 1.0, weight_layout: str = "hv", fp32_head: bool = False,
                return_stats: bool = False, implementation: str | None = None):
  """Float32 logits ``z = (hidden @ W + bias) / temperature`` with the fused op's bits.

  Each ``[block_t, VOCAB_TILE]`` tile is computed by ``linear_logp``'s own
  ``logits_tile`` with its tuning config, so ``z[..., v]`` is bitwise the logit
  that :func:`jaxrl_kernels.linear_logp` reduces for the same row, and (like
  it) independent of the batch, position, padding and chunking of the rows.

  Args:
    hidden: ``[..., H]`` float.
    weight: ``[H, V]`` (``"hv"``) or ``[V, H]`` (``"vh"``, a tied embedding, read in place).
    bias: ``[V]`` or None.
    temperature: static float > 0 (the division is the fused op's, in float32).
    weight_layout: ``"hv"`` or ``"vh"``.
    fp32_head: tiles are upcast to float32 before the product (no fp32 copy of
      the weight); otherwise ``hidden`` and ``weight`` must share a dtype.
    return_stats: also return :class:`LogitStats` ``(lse, entropy)`` of each
      row, reduced inside the logits kernel from the same registers by the
      fused op's own per-tile code (``"mosaic"``: ``tile_epilogue``; Triton /
      interpreter: ``tile_stats``) and merged by its ``merge_partials``: the
      entropy is bitwise ``linear_logp(..., return_entropy=True)``'s and
      :func:`logp_from_stats` gives its log-probs bitwise. Sampler-side: no
      gradient flows through either output.
    implementation: ``"mosaic"`` (Hopper, bf16/fp16), ``"triton"``,
      ``"interpret"``, ``"xla"`` (plain ``jnp.dot``: not bitwise anything) or
      None (by device and dtype, as ``linear_logp`` picks: the logits carry
      the bits of that implementation's fused op).

  Returns:
    ``[..., V]`` float32 (and :class:`LogitStats` of ``[...]`` float32 arrays).
    Gradients of the logits w.r.t. hidden, weight and bias run on ``det_matmul``.

  >>> import jax.numpy as jnp
  >>> head_logits(jnp.ones((2, 4)), jnp.ones((4, 3)), implementation="interpret").tolist()
  [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
  """
  hidden = jnp.asarray(hidden)
  weight = jnp.asarray(weight)
  if weight_layout not in ("hv", "vh"):
    raise ValueError(f"head_logits: weight_layout must be 'hv' or 'vh', got {weight_layout!r}")
  if weight.ndim != 2 or hidden.ndim < 1:
    raise ValueError(f"head_logits: need hidden [..., H] and a 2-D weight, got {hidden.shape} "
                     f"and {weight.shape}")
  hd, v = weight.shape if weight_layout == "hv" else weight.shape[::-1]
  if hidden.shape[-1] != hd:
    raise ValueError(f"head_logits: hidden has {hidden.shape[-1]} features but weight "
                     f"{weight.shape} ({weight_layout!r}) has {hd}")
  if hidden.dtype != weight.dtype and not fp32_head:
    raise TypeError(f"head_logits: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have "
                    f"the same dtype unless fp32_head=True")
  if bias is not None and bias.shape != (v,):
    raise ValueError(f"head_logits: bias must have shape ({v},), got {bias.shape}")
  if not (isinstance(temperature, int | float) and math.isfinite(temperature)
          and temperature > 0):
    raise ValueError(f"head_logits: temperature must be a static finite float > 0, got "
                     f"{temperature!r}")
  compute_dtype = jnp.dtype(jnp.float32 if fp32_head else hidden.dtype)
  impl = _backend.resolve("head_logits", implementation, compute_dtype,
                          supported=_SUPPORTED)
  lead = hidden.shape[:-1]
  h2 = hidden.reshape(math.prod(lead), hd)
  if h2.shape[0] == 0:
    z0 = jnp.zeros((*lead, v), jnp.float32)
    empty = jnp.zeros(lead, jnp.float32)
    return (z0, LogitStats(empty, empty)) if return_stats else z0
  if return_stats:
    z, lse, ent = _logits_and_stats(lax.stop_gradient(h2), lax.stop_gradient(weight),
                                    None if bias is None else lax.stop_gradient(bias),
                                    weight_layout, float(temperature), compute_dtype, impl)
    return z.reshape(*lead, v), LogitStats(lse.reshape(lead), ent.reshape(lead))
  if impl == "xla":
    z = _xla_logits(h2, weight, bias, weight_layout, temperature, compute_dtype)
  else:
    z = _logits(h2, weight, bias, weight_layout, float(temperature), compute_dtype.name, impl)
  return z.reshape(*lead, v)


def _xla_logits(h2, weight, bias, layout, temperature, compute_dtype):
  """The stock path's ``[T, V]`` float32 logits (plain ``jnp.dot``; not batch-invariant)."""
  w = weight.T if layout == "vh" else weight
  z = jnp.dot(h2.astype(compute_dtype), w.astype(compute_dtype),
              preferred_element_type=jnp.float32,
              precision=lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return z / jnp.float32(temperature) if temperature != 1.0 else z


def _logits_and_stats(h2, weight, bias, layout, temperature, compute_dtype, impl):
  """``(z [T, V], lse [T], entropy [T])`` for :func:`head_logits` (no gradient)."""
  if impl == "xla":
    z = _xla_logits(h2, weight, bias, layout, temperature, compute_dtype)
    lse = jax.nn.logsumexp(z, axis=-1)
    return z, lse, lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
  z, (m, s, u) = _logits_call(h2, weight, bias, layout, temperature, compute_dtype.name, impl,
                              stats=True)
  lse, _, ent = merge.merge_partials(m, s, u, implementation=impl)
  return z, lse, ent


class LogitStats(NamedTuple):
  """Row statistics of sampler logits ``z`` (:func:`head_logits` with ``return_stats``).

  Attributes:
    lse: ``[...]`` float32 ``logsumexp(z)``.
    entropy: ``[...]`` float32 ``lse - sum softmax(z) z``.
  """

  lse: jax.Array
  entropy: jax.Array


def logp_from_stats(logits: jax.Array, stats: LogitStats, targets: jax.Array,
                    mask: jax.Array | None = None) -> jax.Array:
  """``logp = logits[..., t] - lse``: for ``(logits, stats) = head_logits(h, W, ...,
  return_stats=True)``, bitwise ``linear_logp(h, W, targets, ...)`` (the fused op's
  ``finalize`` on the same target logit and ``lse``). NaN for active ids outside
  ``[0, V)``; 0 where ``mask`` is False."""
  logits = jnp.asarray(logits)
  targets = jnp.asarray(targets)
  if targets.shape != logits.shape[:-1] or stats.lse.shape != targets.shape:
    raise ValueError(f"logp_from_stats: targets and stats.lse must have shape "
                     f"{logits.shape[:-1]}, got {targets.shape} and {stats.lse.shape}")
  if mask is not None and (mask.shape != targets.shape or mask.dtype != jnp.bool_):
    raise ValueError(f"logp_from_stats: mask must be bool of shape {targets.shape}, got "
                     f"{mask.dtype} {mask.shape}")
  v = logits.shape[-1]
  t = targets.astype(jnp.int32)
  tz = jnp.take_along_axis(logits, jnp.clip(t, 0, v - 1)[..., None], axis=-1)[..., 0]
  logp, _ = merge.finalize(tz, stats.lse, stats.entropy, t, mask, v)
  return logp


# ------------------------------------------------------------------------ logp from logits


def _partials_from_logits_kernel(z_ref, tg_ref, tz0_ref, m_ref, s_ref, u_ref, tz_ref, *, t, v,
                                 n_t, n_v, block_t, group_t, interpret):
  del tz0_ref  # aliased to tz_ref: rows whose target is not in this tile keep their 0
  i, j = _fwd.swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * block_t
  col0 = j * VOCAB_TILE
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (VOCAB_TILE,), 0)
  row_ok = rows < t
  col_ok = cols < v
  z = pltriton.load(z_ref.at[pl.ds(row0, block_t), pl.ds(col0, VOCAB_TILE)],
                    mask=row_ok[:, None] & col_ok[None, :], other=0)
  z = jnp.where(col_ok[None, :], z, -jnp.inf)
  # The per-tile statistics of linear_logp_fwd._partials_kernel (the same
  # function): the bits of (m, s, u) follow from them.
  m, s, u = _fwd.tile_stats(z, col_ok, interpret=interpret)
  pltriton.store(m_ref.at[j, pl.ds(row0, block_t)], m, mask=row_ok)
  pltriton.store(s_ref.at[j, pl.ds(row0, block_t)], s, mask=row_ok)
  pltriton.store(u_ref.at[j, pl.ds(row0, block_t)], u, mask=row_ok)
  tg = pltriton.load(tg_ref.at[pl.ds(row0, block_t)], mask=row_ok, other=-1)
  hit = (cols[None, :] == tg[:, None]) & col_ok[None, :]
  tz = jnp.sum(jnp.where(hit, z, 0.0), axis=1)
  owns = row_ok & (tg >= col0) & (tg < jnp.minimum(col0 + VOCAB_TILE, v))
  pltriton.store(tz_ref.at[pl.ds(row0, block_t)], tz, mask=owns)


def logits_logp(logits: jax.Array, targets: jax.Array, *, mask: jax.Array | None = None,
                return_entropy: bool = False, compute_dtype=jnp.float32,
                implementation: str | None = None):
  """Log-probs (and entropy) of given float32 logits, merged like ``linear_logp``.

  ``logp = z[t] - logsumexp(z)``, ``entropy = logsumexp(z) - sum softmax(z) z``,
  computed from per-``VOCAB_TILE`` partials merged in ascending tile order by
  ``linear_logp``'s ``merge_partials`` and ``finalize``. For ``logits =
  head_logits(h, W, ...)`` and the same implementation the result is bitwise
  ``linear_logp(h, W, targets, ...)`` under the Pallas interpreter; with
  ``"mosaic"`` on Hopper (the logit tiles are loaded into the fused kernel's
  wgmma accumulator layout and reduced by its own ``tile_epilogue``) the logp is
  bitwise and the entropy within a relative 1e-6; with ``"triton"`` on a GPU
  both are within a relative 1e-6 (not bitwise: the compiled reduction of
  re-read logits may differ from the fused epilogue's). For the bitwise
  sampler path use ``head_logits(..., return_stats=True)`` and
  :func:`logp_from_stats`. No gradient (a sampler-side function).

  Args:
    logits: ``[..., V]`` float32 (already divided by the temperature).
    targets: ``[...]`` integer ids; active ids outside ``[0, V)`` give NaN.
    mask: ``[...]`` bool or None; False positions give 0.
    return_entropy: also return the entropy.
    compute_dtype: the head's compute dtype (picks the implementation and the
      fused op's token tile, as the head's ``linear_logp`` does).
    implementation: ``"mosaic"``, ``"triton"``, ``"interpret"`` or None.

  Returns:
    float32 ``logp`` of shape ``targets.shape``, or ``(logp, entropy)``.
  """
  logits = jnp.asarray(logits)
  targets = jnp.asarray(targets)
  if logits.dtype != jnp.float32:
    raise TypeError(f"logits_logp: logits must be float32, got {logits.dtype}")
  if targets.shape != logits.shape[:-1]:
    raise ValueError(f"logits_logp: targets must have shape {logits.shape[:-1]}, got "
                     f"{targets.shape}")
  if mask is not None and (mask.shape != targets.shape or mask.dtype != jnp.bool_):
    raise ValueError(f"logits_logp: mask must be bool of shape {targets.shape}, got "
                     f"{mask.dtype} {mask.shape}")
  impl = _backend.resolve("logits_logp", implementation, compute_dtype,
                          supported=("mosaic", "triton", "interpret"))
  interpret = impl == "interpret"
  lead, v = targets.shape, logits.shape[-1]
  t = math.prod(lead)
  if t == 0:
    z0 = jnp.zeros(lead, jnp.float32)
    return (z0, z0) if return_entropy else z0
  z2 = lax.stop_gradient(logits).reshape(t, v)
  t2 = targets.reshape(t).astype(jnp.int32)
  if impl == "mosaic":
    from jaxrl_kernels.pallas import linear_logp_mosaic

    m, s, u, tz = linear_logp_mosaic.partials_from_logits(z2, t2)
  else:
    m, s, u, tz = _partials_from_logits(z2, t2, compute_dtype, interpret)
  lse, _, ent = merge.merge_partials(m, s, u, implementation=impl)
  logp, ent = merge.finalize(tz, lse, ent, t2, None if mask is None else mask.reshape(t), v)
  logp, ent = logp.reshape(lead), ent.reshape(lead)
  return (logp, ent) if return_entropy else logp


def _partials_from_logits(z2, t2, compute_dtype, interpret: bool):
  """The Triton / interpreter form: ``tile_stats`` on the fused Triton kernel's tiles."""
  t, v = z2.shape
  cfg = _fwd.default_config(compute_dtype, interpret)
  n_t, n_v = pl.cdiv(t, cfg.block_t), pl.cdiv(v, VOCAB_TILE)
  part = jax.ShapeDtypeStruct((n_v, t), jnp.float32)
  m, s, u, tz = pl.pallas_call(
      functools.partial(_partials_from_logits_kernel, t=t, v=v, n_t=n_t, n_v=n_v,
                        block_t=cfg.block_t, group_t=cfg.group_t, interpret=interpret),
      grid=(n_t * n_v,),
      out_shape=(part, part, part, jax.ShapeDtypeStruct((t,), jnp.float32)),
      input_output_aliases={2: 3},
      interpret=interpret,
      name="lm_head_logits_partials",
      **_fwd.compiler_params(cfg, interpret),
  )(z2, t2, jnp.zeros((t,), jnp.float32))
  return m, s, u, tz


# --------------------------------------------------------------------------------- module


class LMHead(nnx.Module):
  """An LM head ``z = h @ W (+ b)`` read without logits for training, with logits for sampling.

  Parameters: ``kernel [H, V]`` (as ``nnx.Linear``), or, with
  ``tied_embedding``, the ``[V, H]`` embedding variable itself (shared, read in
  place, never transposed or copied); optional ``bias [V]``.

  ``fp32_head=True`` computes the projection from float32-upcast tiles of
  ``h`` and ``W`` (``h`` is then used in its own dtype, e.g. a float32
  residual stream) while ``W`` stays in ``param_dtype``; gradients are
  accumulated in float32 and returned in the parameter's dtype (e.g. bf16).
  Otherwise ``h`` is cast to the weight's dtype.
  """

  def __init__(self, hidden: int, vocab: int, *, tied_embedding: nnx.Variable | None = None,
               use_bias: bool = False, fp32_head: bool = False, param_dtype=jnp.float32,
               kernel_init=_DEFAULT_KERNEL_INIT, bias_init=_DEFAULT_BIAS_INIT,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.hidden = hidden
    self.vocab = vocab
    self.fp32_head = fp32_head
    self.implementation = implementation
    if tied_embedding is not None:
      shape = tuple(tied_embedding.value.shape)
      if shape != (vocab, hidden):
        raise ValueError(f"LMHead: tied_embedding must be [vocab, hidden] = {(vocab, hidden)}, "
                         f"got {shape}")
      self.embedding = tied_embedding  # the same variable: one parameter, two readers
      self.kernel = None
    else:
      self.embedding = None
      self.kernel = nnx.Param(kernel_init(rngs.params(), (hidden, vocab), param_dtype))
    dtype = self._weight().dtype
    self.bias = nnx.Param(bias_init(rngs.params(), (vocab,), dtype)) if use_bias else None

  @property
  def weight_layout(self) -> str:
    return "vh" if self.embedding is not None else "hv"

  @property
  def compute_dtype(self):
    return jnp.dtype(jnp.float32 if self.fp32_head else self._weight().dtype)

  def _weight(self) -> jax.Array:
    return (self.embedding if self.embedding is not None else self.kernel).value

  def _hidden(self, h: jax.Array) -> jax.Array:
    h = jnp.asarray(h)
    return h if self.fp32_head else h.astype(self._weight().dtype)

  def _bias(self):
    return None if self.bias is None else self.bias.value

  def __call__(self, h: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
               temperature: float = 1.0, return_entropy: bool = False):
    """``[..., H]`` hidden states -> float32 ``logp [...]`` (and entropy) of ``targets``."""
    return linear_logp(self._hidden(h), self._weight(), targets, bias=self._bias(),
                       temperature=temperature, mask=mask, return_entropy=return_entropy,
                       weight_layout=self.weight_layout, fp32_head=self.fp32_head,
                       implementation=self.implementation)

  def logits(self, h: jax.Array, temperature: float = 1.0, return_stats: bool = False):
    """``[..., H]`` -> float32 ``[..., V]`` logits, bitwise the fused path's projection
    (and, with ``return_stats``, :class:`LogitStats` whose entropy is bitwise
    ``self(h, t, ..., temperature, return_entropy=True)``'s and with which
    :func:`logp_from_stats` gives ``self(h, t, ..., temperature)`` bitwise)."""
    return head_logits(self._hidden(h), self._weight(), bias=self._bias(),
                       temperature=temperature, weight_layout=self.weight_layout,
                       fp32_head=self.fp32_head, return_stats=return_stats,
                       implementation=self.implementation)

  def logp_from_logits(self, logits: jax.Array, targets: jax.Array,
                       mask: jax.Array | None = None, return_entropy: bool = False):
    """Log-probs of given logits (see :func:`logits_logp` for how close to ``self(h,
    targets, ..., temperature)`` they are on each implementation). For bitwise sampler
    log-probs use ``self.logits(h, T, return_stats=True)`` and :func:`logp_from_stats`."""
    impl = None if self.implementation == "xla" else self.implementation
    return logits_logp(logits, targets, mask=mask, return_entropy=return_entropy,
                       compute_dtype=self.compute_dtype, implementation=impl)
