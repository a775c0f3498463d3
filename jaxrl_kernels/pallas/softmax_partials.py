"""The softmax arithmetic of ``linear_logp``, written once for every backend.

For a float32 logits tile ``z [rows, VOCAB_TILE]`` (masked columns ``-inf``):

    m = max_v z_v,   s = sum_v exp(z_v - m),   u = sum_v exp(z_v - m) (z_v - m)

(:func:`tile_stats`), folded over tiles in ascending order by :func:`merge_step`
and turned into ``lse = m + log s``, ``mean_z = m + u / s``, ``entropy = log s
- u / s`` by :func:`finalize_stats`; the target logit is an exact masked sum
(:func:`target_logit`), and the logit cotangent of the backward is

    dz = (g_logp (onehot(t) - p) - g_ent p (z - mean_z)) / temperature

(:func:`logit_grad`). The Triton kernels, the Mosaic epilogues, the GEMM
backward and the XLA path call these functions; each caller keeps its own
layout code (loads, stores, register layouts) around them. The interpreted
kernels take :func:`exp_arith` / :func:`log_arith`: IEEE basic operations,
which round the same way in every XLA fusion.

The temperature reaches the kernels as ``inv_temperature``: ``None`` (the
static ``1.0``: nothing to do) or the float32 ``1 / temperature``, computed once
per call (:func:`temperature_operand`), by which logits and their gradient are
multiplied. A product rounds the same way in every fusion, while XLA's CPU
code turns a division into a product with a reciprocal in some fusions and not
in others; ``z * 1.0`` is ``z`` exactly, so a traced temperature equal to 1
keeps the static path's bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_LN2_HI = 0.693145751953125  # 12 significant bits: k * _LN2_HI is exact for |k| < 2^11
_LN2_LO = 1.4286068203094172e-06  # ln 2 - _LN2_HI


def exp_arith(x, sep=None):
  """float32 ``exp(x)`` from IEEE basic operations only (within 2 ulps; ``x <
  -87.33`` gives 0, ``x > 88`` inf (the kernels only take ``x <= 0``), ``-inf``
  0, NaN NaN).

  For the interpreted kernels: XLA's compiled ``exp`` may differ in the last
  bit between fusions (vectorized or not), these operations cannot. ``sep`` (the
  "cpu" implementation's guard) is applied to every product before the sum that
  consumes it, so that no FMA contraction can differ between programs either; None
  adds no operation.
  ``x = k ln2 + r`` with ``k = round(x / ln2)`` (two-part ln2, exact
  products), ``exp(r)`` by Horner on its Taylor series to degree 8 (``|r| <=
  0.35``), then scaled by ``2^k`` through the exponent bits.
  """
  sep = sep or (lambda v: v)
  x = jnp.asarray(x, jnp.float32)
  xc = jnp.clip(x, -87.33, 88.0)
  k = jnp.round(sep(xc * jnp.float32(1.4426950408889634)))
  r = (xc - sep(k * jnp.float32(_LN2_HI))) - sep(k * jnp.float32(_LN2_LO))
  p = jnp.float32(1.0 / 40320)
  for c in (1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
    p = sep(p * r) + jnp.float32(c)
  scale = lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)
  y = sep(p * scale)
  y = jnp.where(x < -87.33, 0.0, jnp.where(x > 88.0, jnp.inf, y))
  return jnp.where(jnp.isnan(x), x, y)


def log_arith(x, sep=None):
  """float32 ``log(x)`` from IEEE basic operations only (within a few ulps;
  0 gives -inf, negative or NaN gives NaN, subnormals are treated as 0).

  ``x = 2^e f`` with ``f`` in [sqrt(1/2), sqrt(2)), ``log f = 2 atanh(y)``,
  ``y = (f - 1) / (f + 1)``, as a fixed odd series to ``y^13``. ``sep`` as in
  :func:`exp_arith`.
  """
  sep = sep or (lambda v: v)
  x = jnp.asarray(x, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.int32)
  e = (bits >> 23) - 127
  f = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)
  big = f > jnp.float32(1.4142135)
  f = jnp.where(big, f * jnp.float32(0.5), f)
  e = jnp.where(big, e + 1, e)
  y = (f - 1.0) / (f + 1.0)
  y2 = sep(y * y)
  p = jnp.float32(1.0 / 13)
  for c in (1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5, 1.0 / 3, 1.0):
    p = sep(p * y2) + jnp.float32(c)
  ef = e.astype(jnp.float32)
  r = (sep(sep(2.0 * y) * p) + sep(ef * jnp.float32(_LN2_LO))) + sep(ef * jnp.float32(_LN2_HI))
  r = jnp.where(x == jnp.inf, jnp.inf, r)
  return jnp.where(x >= jnp.float32(1.1754944e-38), r,
                   jnp.where((x >= 0) & ~jnp.isnan(x), -jnp.inf, jnp.nan))


def scale_logits(z, bias_row, inv_temperature):
  """``(z + b) * (1 / temperature)``: the op order of every backend's logit."""
  if bias_row is not None:
    z = z + bias_row
  if inv_temperature is not None:
    z = z * inv_temperature
  return z


def finite_max(m):
  """A tile's row max for ``z - m``: ``m``, or 0 where the row has no logit above ``-inf``
  in the tile (every column masked, e.g. by a ``-inf`` bias). Such a row's tile then gives
  ``e = 0``, ``s = u = 0`` (an empty tile, which :func:`merge_step` skips exactly) instead
  of ``exp(-inf - -inf)`` = NaN; every other row is unchanged."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def tile_stats(z, col_ok, *, interpret: bool):
  """Per-row ``(m, s, u)`` of a float32 logits tile ``z [rows, VOCAB_TILE]``
  (masked columns -inf, ``col_ok [VOCAB_TILE]`` their mask), in the Triton
  kernels' form.

  Compiled (Triton), the two sums are reductions in the kernel's register
  layout. Interpreted, they are a fixed pairwise tree of elementwise adds
  (halving the columns 7 times) and the exponential is :func:`exp_arith`: XLA
  compiles an interpreted ``jnp.sum`` and ``jnp.exp`` to different code
  depending on what else is live (dropping ``u``, as a forward-only call
  without entropy does, changed the last bit of ``s`` on some rows against
  the training call); IEEE basic operations round the same way in any fusion.
  """
  m = jnp.max(z, axis=1)  # exact in any order
  m0 = finite_max(m)
  e = (exp_arith if interpret else jnp.exp)(z - m0[:, None])  # exp(-inf) = 0 on masked columns
  d = jnp.where(col_ok[None, :] & (z != -jnp.inf), e * (z - m0[:, None]), 0.0)
  if not interpret:
    return m, jnp.sum(e, axis=1), jnp.sum(d, axis=1)
  width = z.shape[1]
  while width > 1:
    width //= 2
    e = e[:, :width] + e[:, width:2 * width]
    d = d[:, :width] + d[:, width:2 * width]
  return m, e[:, 0], d[:, 0]


def tile_stats_2d(z, col_ok, *, with_exp: bool = False, entropy: bool = True):
  """Per-row ``(m, s, u)`` of ``z [rows, VOCAB_TILE]`` with a 2-D column mask
  ``col_ok`` (the Mosaic epilogue's form: every operand in the wgmma register
  layout, row vectors broadcast with ``broadcast_in_dim``). Masks ``z`` itself.
  Returns ``(z, m, s, u)``, and ``e = exp(z - m)`` last with ``with_exp``.

  ``entropy=False``: ``u`` is not reduced (zeros; ``m`` and ``s`` keep their bits), for
  callers that use no entropy."""
  z = jnp.where(col_ok, z, -jnp.inf)
  m = jnp.max(z, axis=1)
  zm = z - lax.broadcast_in_dim(finite_max(m), z.shape, [0])
  e = jnp.exp(zm)  # exp(-inf) = 0 on masked columns
  s = jnp.sum(e, axis=1)
  if entropy:
    u = jnp.sum(jnp.where(col_ok & (z != -jnp.inf), e * zm, 0.0), axis=1)
  else:
    u = jnp.zeros_like(s)
  return (z, m, s, u, e) if with_exp else (z, m, s, u)


def target_logit(z, hit):
  """``z[t]`` per row as a masked sum over the tile's columns: ``hit`` is True at
  the target's column only, so at most one term is non-zero and the sum is exact
  (and 0 on rows whose target lies elsewhere)."""
  return jnp.sum(jnp.where(hit, z, 0.0), axis=1)


def owns_target(targets, col0, col_end):
  """Rows whose (local) target id lies in the tile ``[col0, col_end)``."""
  return (targets >= col0) & (targets < col_end)


def merge_step(m, s, u, mt, st, ut, exp=jnp.exp, sep=None):
  """Folds partial ``(mt, st, ut)`` into the running ``(m, s, u)``.

  With ``M = max(m, mt)``: ``s' = e^(m-M) s + e^(mt-M) st`` and
  ``u' = e^(m-M) (u + (m-M) s) + e^(mt-M) (ut + (mt-M) st)``. An empty side
  (``s == 0``: the start, or a tile of padding only) is skipped exactly.
  ``sep`` (the "cpu" implementation's guard) is applied to every product before
  the sum that consumes it; None (the kernels) adds no operation.
  """
  sep = sep or (lambda x: x)
  big = jnp.maximum(m, mt)
  da = m - big
  db = mt - big
  a = exp(da)
  b = exp(db)
  s2 = sep(a * s) + sep(b * st)
  u2 = sep(a * (u + sep(da * s))) + sep(b * (ut + sep(db * st)))
  take_tile = s == 0
  keep = st == 0
  m_out = jnp.where(take_tile, mt, jnp.where(keep, m, big))
  s_out = jnp.where(take_tile, st, jnp.where(keep, s, s2))
  u_out = jnp.where(take_tile, ut, jnp.where(keep, u, u2))
  return m_out, s_out, u_out


def finalize_stats(m, s, u, log=jnp.log):
  """``(lse, mean_z, entropy)`` of merged ``(m, s, u)``; the entropy is written
  without ``m`` (``log s - u / s``), so no cancellation."""
  log_s = log(s)
  ratio = u / s
  return m + log_s, m + ratio, log_s - ratio


def finalize(target_logit_: jax.Array, lse: jax.Array, entropy: jax.Array, targets: jax.Array,
             mask: jax.Array | None, vocab_size: int):
  """``logp = z[t] - lse``, NaN where an active target is outside ``[0, V)``,
  and 0 (both outputs) at masked positions. Elementwise: batch-invariant."""
  valid = (targets >= 0) & (targets < vocab_size)
  logp = jnp.where(valid, target_logit_ - lse, jnp.nan)
  if mask is not None:
    logp = jnp.where(mask, logp, 0.0)
    entropy = jnp.where(mask, entropy, 0.0)
  return logp, entropy


def logit_grad(z, lse, mean_z, onehot, g_logp, g_ent, col_ok, inv_temperature, *,
               mask_p: bool = False):
  """``dz = (g_logp (onehot - p) - g_ent p (z - mean_z)) * (1 / temperature)`` of one
  logits tile (row vectors already broadcast against ``z``).

  ``col_ok`` masks ``z - mean_z`` on padding columns (``z = -inf`` there);
  ``mask_p`` also selects ``p = 0`` there (the GEMM epilogue's form, whose ``z``
  is finite on padding columns). The caller zeroes rows and columns outside
  the array. ``g_ent=None``: no entropy cotangent (the caller returned no entropy),
  ``dz = g_logp (onehot - p) / temperature``, and ``mean_z`` is not read.
  """
  p = jnp.exp(z - lse)  # 0 on masked columns where z = -inf
  if mask_p:
    p = jnp.where(col_ok, p, 0.0)
  if g_ent is None:
    dz = g_logp * (onehot - p)
  else:
    # A -inf logit (a column masked by the bias) has p = 0 and no entropy term: 0, not
    # 0 * -inf.
    zc = jnp.where(col_ok & (z != -jnp.inf), z - mean_z, 0.0)
    dz = g_logp * (onehot - p) - g_ent * (p * zc)
  if inv_temperature is not None:
    dz = dz * inv_temperature
  return dz


def lse_entropy_xla(z):
  """``(lse, mean_z, entropy)`` of materialized float32 logits ``z [..., V]`` with
  XLA's own reductions (the ``"xla"`` backend; not batch-invariant)."""
  lse = jax.nn.logsumexp(z, axis=-1)
  mean_z = jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
  return lse, mean_z, lse - mean_z


def temperature_scalar(temperature) -> jax.Array | None:
  """None for a Python ``1.0`` (the static path), else the float32 temperature
  behind an optimization barrier: XLA never sees a static value as a constant,
  so a static and a traced temperature compile to the same code."""
  if isinstance(temperature, int | float) and temperature == 1.0:
    return None
  return lax.optimization_barrier(jnp.asarray(temperature, jnp.float32))


def temperature_operand(temperature) -> jax.Array | None:
  """The kernels' ``inv_temperature`` operand: None for a Python ``1.0``, else
  the float32 ``[1]`` array ``1 / temperature`` (one correctly rounded scalar
  division per call), loaded by the kernels. Every other value, static or
  traced, takes this path, so its bits do not depend on whether it was traced."""
  t = temperature_scalar(temperature)
  return None if t is None else jnp.reshape(jnp.float32(1.0) / t, (1,))
