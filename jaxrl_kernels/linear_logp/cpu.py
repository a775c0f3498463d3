"""``implementation="cpu"``: the fused LM head as fixed-shape XLA CPU computations.

With ``z = (h W + b) * (1 / temperature)`` (float32; bf16/fp16 operands upcast):

* :func:`tile_partials` walks the vocabulary in chunks of ``CPU_VOCAB_CHUNK``
  columns (``lax.fori_loop``s; the last chunk zero-padded to the same width)
  and, per chunk, the tokens in blocks of ``CPU_ROW_BLOCK`` rows. Each block
  is one dot ``[CPU_ROW_BLOCK, H] x [H, CPU_VOCAB_CHUNK]``, reduced at once per
  ``VOCAB_TILE`` columns to ``m = max z``, ``s = sum exp(z - m)`` and ``u = sum
  exp(z - m) (z - m)`` (a fixed pairwise tree of adds), plus the target logit.
* :func:`merge_partials` folds the ``[n_tiles, T]`` partials in ascending tile
  order (the fold of ``linear_logp_fwd.merge_step``), per block of rows.
* :func:`backward` recomputes each block's logits with the same code and forms
  ``dz = (g_logp (onehot - p) - g_ent p (z - mean_z)) * (1 / temperature)``;
  ``dH += dz W_c^T`` per row block and chunk (chunks ascending),
  ``dW_c = sum_blocks h_b^T dz_b`` and ``db_c = sum_blocks colsum(dz_b)``
  (row blocks ascending).
* :func:`logits` writes the same blocks' logits (and optionally their
  partials); :func:`partials_from_logits` reduces given logits with the same
  blocks and code.

Why the bits hold with XLA's default flags: see ``jaxrl_kernels/_cpu.py``.
Every computation on a row runs at one fixed shape, and every product that
feeds an addition is guarded (``_cpu.guard``) first, so no program can fuse it
into an FMA in one place and not in another. A vocab tile's partials do not
depend on where its chunk starts (the dot's columns are independent of their
position, a tested property), so vocab shards whose boundaries fall on
``VOCAB_TILE`` give the unsharded partials. ``temperature`` is an operand whose
reciprocal is taken once per call (a division by it inside the loops changed bits with
the number of row blocks): a traced value gives the bits of the same static value.

Memory: per step a ``[CPU_ROW_BLOCK, CPU_VOCAB_CHUNK]`` float32 block, a
float32 group of weight chunks (at most ``_GROUP_BYTES``), the ``[n_tiles, T]``
partials, and in the backward a float32 ``[T, H]`` dH, one float32 ``[H,
CPU_VOCAB_CHUNK]`` dW chunk and the weight gradient's bits: no ``[T, V]`` array
(except the output of :func:`logits` and the input of
:func:`partials_from_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels._cpu import (
  CPU_ROW_BLOCK,
  cdiv,
  dot_f32,
  from_storage,
  guard,
  opaque_zero,
  pad_rows,
  storage_dtype,
  sum_to_match,
  to_storage,
  tree_sum_last,
  varying_like,
)
from jaxrl_kernels.contract import CPU_VOCAB_CHUNK, VOCAB_TILE
from jaxrl_kernels.pallas import softmax_partials as sp

if CPU_VOCAB_CHUNK % VOCAB_TILE:
  raise ValueError(f"CPU_VOCAB_CHUNK={CPU_VOCAB_CHUNK} must be a multiple of VOCAB_TILE="
                   f"{VOCAB_TILE}")


def _vocab_size(weight: jax.Array, layout: str) -> int:
  if layout not in ("hv", "vh"):
    raise ValueError(f"linear_logp[cpu]: layout must be 'hv' or 'vh', got {layout!r}")
  return weight.shape[1] if layout == "hv" else weight.shape[0]


def _as_f32(x: jax.Array, compute_dtype) -> jax.Array:
  """Rounded to the compute dtype (as the GPU kernels' product inputs), held in float32."""
  return x.astype(compute_dtype).astype(jnp.float32)


# Free knob: bytes of float32 weight columns cut out per branch of the chunk
# loop's ``lax.switch`` (never changes a bit: every chunk's dot is the same).
_GROUP_BYTES = 32 << 20


def _for_each_chunk(weight, bias, layout: str, compute_dtype, fn, carry):
  """Calls ``fn(c0, w_c, b_c, carry)`` for the vocab chunks in ascending order.

  ``c0`` (traced) is the chunk's first column, ``w_c`` float32 ``[H,
  CPU_VOCAB_CHUNK]`` (``"hv"``) or ``[CPU_VOCAB_CHUNK, H]`` (``"vh"``), ``b_c``
  float32 ``[CPU_VOCAB_CHUNK]`` or None; columns past the vocabulary are zeros.

  The weight is cut with static slices, a group of chunks at a time, in the
  branches of a ``lax.switch`` (upcast there): XLA's CPU compiler has no 16-bit
  ``dynamic-slice``, and rewrites one into a float32 copy of the whole weight.
  Inside a group, chunks are ``dynamic-slice``s of the float32 group.
  """
  hv = layout == "hv"
  axis = 1 if hv else 0
  v = weight.shape[axis]
  h = weight.shape[1 - axis]
  vc = CPU_VOCAB_CHUNK
  n_chunks = cdiv(v, vc)
  per_group = max(1, min(n_chunks, _GROUP_BYTES // (4 * h * vc)))
  n_groups = cdiv(n_chunks, per_group)
  gw = per_group * vc
  operands = (weight,) if bias is None else (weight, bias)

  def cut(gi):
    lo, hi = gi * gw, min(v, (gi + 1) * gw)

    def get(weight, bias=None):
      w = _as_f32(lax.slice_in_dim(weight, lo, hi, axis=axis), compute_dtype)
      pad = [(0, 0), (0, gw - (hi - lo))]
      w = jnp.pad(w, pad if hv else pad[::-1])
      if bias is None:
        return w, None
      return w, jnp.pad(bias[lo:hi].astype(jnp.float32), (0, gw - (hi - lo)))

    return get

  def group(g, carry):
    if n_groups == 1:
      w_g, b_g = cut(0)(*operands)
    else:
      w_g, b_g = lax.switch(g, [cut(gi) for gi in range(n_groups)], *operands)

    def chunk(j, carry):
      w_c = lax.dynamic_slice_in_dim(w_g, j * vc, vc, axis=axis)
      b_c = None if b_g is None else lax.dynamic_slice_in_dim(b_g, j * vc, vc)
      return fn((g * per_group + j) * vc, w_c, b_c, carry)

    return lax.fori_loop(0, jnp.minimum(per_group, n_chunks - g * per_group), chunk, carry)

  return lax.fori_loop(0, n_groups, group, carry)


def _write_cols(buf, block, c0, axis: int, start=0):
  """``buf`` with ``block``'s columns (along ``axis``) written at ``c0 ...``, those that
  fall inside ``buf``; ``start`` is the offset on the other axis (2-D buffers).

  A chunk that would run past the end is written as the last full-width window
  of ``buf``, its columns shifted into place and the window's leading columns
  kept: ``dynamic_update_slice`` would clamp the start instead.
  """
  n = buf.shape[axis]
  vc = block.shape[axis]
  block = block.astype(buf.dtype)
  if n < vc:  # one chunk
    part = lax.slice_in_dim(block, 0, n, axis=axis)
    at = [start] * buf.ndim
    at[axis] = 0
    return lax.dynamic_update_slice(buf, part, at)
  s = jnp.minimum(c0, n - vc)
  d = c0 - s
  shifted = lax.dynamic_slice_in_dim(jnp.concatenate([jnp.zeros_like(block), block], axis),
                                     vc - d, vc, axis=axis)
  at = [start] * buf.ndim
  at[axis] = s
  old = lax.dynamic_slice(buf, at, block.shape)
  keep = lax.broadcasted_iota(jnp.int32, block.shape, axis) < d
  return lax.dynamic_update_slice(buf, jnp.where(keep, old, shifted), at)


def _block_logits(xb, w_c, b_c, inv_temperature, ok, hv: bool, zero) -> jax.Array:
  """float32 logits ``[CPU_ROW_BLOCK, CPU_VOCAB_CHUNK]`` of one block; -inf where not ``ok``.

  The one definition of the logits for the forward, the backward and :func:`logits`.
  """
  z = dot_f32(xb, w_c, ((1,), (0,)) if hv else ((1,), (1,)), zero)
  if b_c is not None:
    z = z + b_c[None, :]
  # z * (1 / temperature), the op order of every backend; guarded so that no consumer
  # contracts the product (a division by a loop-invariant was not reliably exact here:
  # its bits changed with the number of row blocks).
  z = guard(z * inv_temperature, zero)
  return jnp.where(ok[None, :], z, -jnp.inf)


def _exp(x, zero):
  """float32 ``exp`` from guarded IEEE basic operations (:func:`softmax_partials.exp_arith`):
  XLA's compiled ``exp`` rounds differently in the last bit between fusions (vectorized or
  scalar code, FMA contracted or not), so the same logit would give other bits in a program
  that also computes the entropy."""
  return sp.exp_arith(x, sep=lambda v: guard(v, zero))


def _tile_stats(z, ok, zero):
  """Per-row, per-``VOCAB_TILE`` ``(m, s, u)`` of a logits block, each ``[rows, tiles]``.

  ``m = max z`` (exact in any order), ``e = exp(z - m)``, ``d = e (z - m)``,
  both guarded before the pairwise trees that sum them. A tile of padding
  only gives ``(-inf, 0, 0)``, which the merge skips exactly.
  """
  rows, width = z.shape
  nt = width // VOCAB_TILE
  zt = z.reshape(rows, nt, VOCAB_TILE)
  okt = ok.reshape(1, nt, VOCAB_TILE)
  m = jnp.max(zt, axis=-1)
  x = jnp.where(okt, zt - sp.finite_max(m)[..., None], -jnp.inf)
  e = guard(_exp(x, zero), zero)  # exp(-inf) = 0 on padding columns
  d = guard(jnp.where(okt & (zt != -jnp.inf), e * x, 0.0), zero)
  return m, tree_sum_last(e), tree_sum_last(d)


def _store_partials(parts, z, ok, targets, c0, r0, zero):
  """Writes one block's tile partials and target logits into ``parts = (m, s, u, tz)``.

  ``m, s, u`` are ``[tiles, T_pad]``; the target logit is taken by the chunk that
  owns the target (``targets`` are local ids), exactly, and kept elsewhere.
  """
  mm, ss, uu, tz = parts
  rows, vc = z.shape
  m, s, u = _tile_stats(z, ok, zero)
  at = (c0 // VOCAB_TILE, r0)
  mm = lax.dynamic_update_slice(mm, m.T, at)
  ss = lax.dynamic_update_slice(ss, s.T, at)
  uu = lax.dynamic_update_slice(uu, u.T, at)
  lt = lax.dynamic_slice_in_dim(targets, r0, rows) - c0
  own = (lt >= 0) & (lt < vc) & jnp.take(ok, jnp.clip(lt, 0, vc - 1))
  zt = jnp.take_along_axis(z, jnp.clip(lt, 0, vc - 1)[:, None], axis=1)[:, 0]
  tz = lax.dynamic_update_slice_in_dim(
      tz, jnp.where(own, zt, lax.dynamic_slice_in_dim(tz, r0, rows)), r0, 0)
  return mm, ss, uu, tz


def _prepare(hidden2d, targets, temperature, compute_dtype, vocab_offset):
  x = pad_rows(_as_f32(hidden2d, compute_dtype), CPU_ROW_BLOCK)
  tg = pad_rows(jnp.asarray(targets, jnp.int32) - jnp.int32(vocab_offset), CPU_ROW_BLOCK)
  # One reciprocal per call (a scalar, outside every loop): logits are z * (1 / T).
  inv_t = jnp.float32(1.0) / jnp.asarray(temperature, jnp.float32)
  return x, tg, inv_t, opaque_zero(x)


def _forward_pass(hidden2d, weight, bias, targets, *, layout, temperature, compute_dtype,
                  vocab_offset, valid_vocab, want_z: bool, want_partials: bool):
  t = hidden2d.shape[0]
  v = _vocab_size(weight, layout)
  v_local = v if valid_vocab is None else int(valid_vocab)
  hv = layout == "hv"
  rb, vc = CPU_ROW_BLOCK, CPU_VOCAB_CHUNK
  x, tg, temp, zero = _prepare(hidden2d, targets, temperature, compute_dtype, vocab_offset)
  t_pad = x.shape[0]
  n_tiles = cdiv(v, VOCAB_TILE)
  nt_alloc = cdiv(v, vc) * (vc // VOCAB_TILE)
  cols = lax.broadcasted_iota(jnp.int32, (vc,), 0)

  def chunk(c0, w_c, b_c, carry):
    ok = c0 + cols < v_local

    def block(i, carry):
      z_out, mm, ss, uu, tz = carry
      r0 = i * rb
      z = _block_logits(lax.dynamic_slice_in_dim(x, r0, rb), w_c, b_c, temp, ok, hv, zero)
      if want_z:
        z_out = _write_cols(z_out, z, c0, 1, start=r0)
      if want_partials:
        mm, ss, uu, tz = _store_partials((mm, ss, uu, tz), z, ok, tg, c0, r0, zero)
      return z_out, mm, ss, uu, tz

    return lax.fori_loop(0, t_pad // rb, block, carry)

  part = jnp.zeros((nt_alloc, t_pad), jnp.float32) if want_partials else None
  carry = (jnp.zeros((t_pad, v), jnp.float32) if want_z else None, part, part, part,
           jnp.zeros((t_pad,), jnp.float32) if want_partials else None)
  # Inside a user's shard_map the loop carries vary as the operands do.
  carry = varying_like(carry, hidden2d, weight, bias, targets, temperature)
  z, m, s, u, tz = _for_each_chunk(weight, bias, layout, compute_dtype, chunk, carry)
  z = None if z is None else z[:t]
  if not want_partials:
    return z, None
  return z, (m[:n_tiles, :t], s[:n_tiles, :t], u[:n_tiles, :t], tz[:t])


def tile_partials(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, layout: str, temperature, compute_dtype,
                  vocab_offset: int = 0, valid_vocab: int | None = None):
  """Per-vocab-tile float32 softmax partials of ``z = (hidden2d W + b) / temperature``.

  Args:
    hidden2d: ``[T, H]``.
    weight: ``[H, V]`` (``layout="hv"``) or ``[V, H]`` (``"vh"``); a shard holding
      global vocab ids ``[vocab_offset, vocab_offset + V)``.
    bias: ``[V]`` or None.
    targets: ``[T]`` int32 global ids (anything, e.g. -100, at inactive rows).
    temperature: a Python float or a float32 scalar (traced or not; the same
      value gives the same bits either way).
    compute_dtype: dtype the operands are rounded to before the float32 product.
    vocab_offset: global id of the weight's first column (a multiple of
      ``VOCAB_TILE`` for tensor-parallel bitwise invariance).
    valid_vocab: local columns ``>= valid_vocab`` are padding (-inf).

  Returns:
    ``(m, s, u, target_logit)``: float32 ``[ceil(V / VOCAB_TILE), T]`` tile max,
    ``sum exp(z - m)``, ``sum exp(z - m) (z - m)``; float32 ``[T]`` target logit,
    exactly 0 where this weight does not own the row's target.
  """
  t = hidden2d.shape[0]
  n_tiles = cdiv(_vocab_size(weight, layout), VOCAB_TILE)
  if t == 0:
    empty = jnp.zeros((n_tiles, 0), jnp.float32)
    return empty, empty, empty, jnp.zeros((0,), jnp.float32)
  _, parts = _forward_pass(hidden2d, weight, bias, targets, layout=layout,
                           temperature=temperature, compute_dtype=compute_dtype,
                           vocab_offset=vocab_offset, valid_vocab=valid_vocab, want_z=False,
                           want_partials=True)
  return parts


def logits(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None, *, layout: str,
           temperature, compute_dtype, vocab_offset: int = 0, valid_vocab: int | None = None,
           return_stats: bool = False):
  """float32 logits ``z [T, V]``, each bitwise the one :func:`tile_partials` reduces.

  With ``return_stats``: ``(z, (m, s, u))``, the partials of :func:`tile_partials`
  computed from the same blocks. Columns ``>= valid_vocab`` are -inf.
  """
  t = hidden2d.shape[0]
  v = _vocab_size(weight, layout)
  if t == 0:
    z = jnp.zeros((0, v), jnp.float32)
    empty = jnp.zeros((cdiv(v, VOCAB_TILE), 0), jnp.float32)
    return (z, (empty, empty, empty)) if return_stats else z
  targets = jnp.full((t,), -1, jnp.int32)
  z, parts = _forward_pass(hidden2d, weight, bias, targets, layout=layout,
                           temperature=temperature, compute_dtype=compute_dtype,
                           vocab_offset=vocab_offset, valid_vocab=valid_vocab, want_z=True,
                           want_partials=return_stats)
  return (z, parts[:3]) if return_stats else z


def partials_from_logits(logits2d: jax.Array, targets: jax.Array, *, compute_dtype=None):
  """``(m, s, u, target_logit)`` of float32 logits ``[T, V]``, reduced by the blocks and
  code of :func:`tile_partials`: bitwise its partials for logits from :func:`logits`.

  ``compute_dtype`` is unused (the logits are already float32); it is accepted
  for the common from-logits signature.
  """
  del compute_dtype
  t, v = logits2d.shape
  n_tiles = cdiv(v, VOCAB_TILE)
  if t == 0:
    empty = jnp.zeros((n_tiles, 0), jnp.float32)
    return empty, empty, empty, jnp.zeros((0,), jnp.float32)
  rb, vc = CPU_ROW_BLOCK, CPU_VOCAB_CHUNK
  n_chunks = cdiv(v, vc)
  t_pad = cdiv(t, rb) * rb
  z_all = jnp.pad(jnp.asarray(logits2d, jnp.float32), ((0, t_pad - t), (0, n_chunks * vc - v)),
                  constant_values=-jnp.inf)
  tg = pad_rows(jnp.asarray(targets, jnp.int32), rb)
  zero = opaque_zero(z_all)
  cols = lax.broadcasted_iota(jnp.int32, (vc,), 0)

  def chunk(c, carry):
    c0 = c * vc
    ok = c0 + cols < v

    def block(i, carry):
      r0 = i * rb
      z = lax.dynamic_slice(z_all, (r0, c0), (rb, vc))
      return _store_partials(carry, z, ok, tg, c0, r0, zero)

    return lax.fori_loop(0, t_pad // rb, block, carry)

  part = jnp.zeros((n_chunks * (vc // VOCAB_TILE), t_pad), jnp.float32)
  carry = varying_like((part, part, part, jnp.zeros((t_pad,), jnp.float32)), logits2d, targets)
  m, s, u, tz = lax.fori_loop(0, n_chunks, chunk, carry)
  return m[:n_tiles, :t], s[:n_tiles, :t], u[:n_tiles, :t], tz[:t]


def _merge_step(m, s, u, mt, st, ut, zero):
  """Folds a tile's ``(mt, st, ut)`` into the running ``(m, s, u)`` (each ``[rows]``): the
  kernels' :func:`softmax_partials.merge_step` with every product guarded before the sum
  that consumes it."""
  return sp.merge_step(m, s, u, mt, st, ut, exp=lambda x: _exp(x, zero),
                       sep=lambda x: guard(x, zero))


def merge_partials(m: jax.Array, s: jax.Array, u: jax.Array):
  """Folds ``[n_tiles, T]`` partials in ascending tile order, per block of rows.

  Returns float32 ``(lse, mean_z, entropy)``, each ``[T]``: ``lse = m + log s``,
  ``mean_z = m + u / s`` (``= sum softmax(z) z``), ``entropy = log s - u / s``.
  """
  n, t = m.shape
  if t == 0:
    empty = jnp.zeros((0,), jnp.float32)
    return empty, empty, empty
  rb = CPU_ROW_BLOCK
  t_pad = cdiv(t, rb) * rb
  mp, s_pad, up = (jnp.pad(jnp.asarray(a, jnp.float32), ((0, 0), (0, t_pad - t)))
                for a in (m, s, u))
  zero = opaque_zero(s_pad)

  def block(i, out):
    r0 = i * rb
    mb, sb, ub = (lax.dynamic_slice(a, (0, r0), (n, rb)) for a in (mp, s_pad, up))

    def fold(k, state):
      return _merge_step(*state, mb[k], sb[k], ub[k], zero)

    init = varying_like((jnp.full((rb,), -jnp.inf, jnp.float32), jnp.zeros((rb,), jnp.float32),
                         jnp.zeros((rb,), jnp.float32)), m, s, u)
    mf, sf, uf = lax.fori_loop(0, n, fold, init)
    log_s = guard(sp.log_arith(sf, sep=lambda x: guard(x, zero)), zero)
    ratio = uf / sf
    res = (mf + log_s, mf + ratio, log_s - ratio)
    return tuple(lax.dynamic_update_slice_in_dim(o, r, r0, 0) for o, r in zip(out, res))

  zeros = jnp.zeros((t_pad,), jnp.float32)
  out = varying_like((zeros, zeros, zeros), m, s, u)
  lse, mean_z, ent = lax.fori_loop(0, t_pad // rb, block, out)
  return lse[:t], mean_z[:t], ent[:t]


def _dlogits(z, ok, lse, mean_z, g_logp, g_ent, lt, active, inv_temperature, zero):
  """``dz = (g_logp (onehot - p) - g_ent p (z - mean_z)) / temperature`` of one block,
  0 at padding columns and at rows without a cotangent (a select: NaN there stays out)."""
  cols = lax.broadcasted_iota(jnp.int32, z.shape, 1)
  p = guard(_exp(z - lse[:, None], zero), zero)  # 0 on padding columns (z = -inf)
  zc = jnp.where(ok[None, :] & (z != -jnp.inf), z - mean_z[:, None], 0.0)
  onehot = (cols == lt[:, None]).astype(jnp.float32)
  a = guard(g_logp[:, None] * (onehot - p), zero)
  b = guard(g_ent[:, None] * (p * zc), zero)
  dz = guard((a - b) * inv_temperature, zero)
  return jnp.where(ok[None, :] & active[:, None], dz, 0.0)


def dlogits(z: jax.Array, lse: jax.Array, mean_z: jax.Array, g_logp: jax.Array,
            g_ent: jax.Array, targets: jax.Array, *, inv_temperature=None,
            entropy: bool = True) -> jax.Array:
  """:func:`backward`'s logit gradient (the same guarded code) of stored float32 logits
  ``z [rows, V]`` from :func:`logits`: for the three-GEMM objective
  (``linear_logp/three_gemm.py``). ``inv_temperature``: None (1) or the float32
  ``1 / temperature``. Rows whose cotangents are both 0 give exact zeros."""
  del entropy  # the entropy term is kept (g_ent = 0 makes it zero)
  zero = opaque_zero(z)
  g_logp = jnp.asarray(g_logp, jnp.float32)
  g_ent = jnp.asarray(g_ent, jnp.float32)
  inv_t = jnp.float32(1.0) if inv_temperature is None else inv_temperature
  ok = jnp.ones((z.shape[1],), bool)
  active = (g_logp != 0) | (g_ent != 0)
  return _dlogits(z, ok, lse, mean_z, g_logp, g_ent, targets, active, inv_t, zero)


def backward(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None, targets: jax.Array,
             lse: jax.Array, mean_z: jax.Array, g_logp: jax.Array, g_ent: jax.Array, *,
             layout: str, temperature, compute_dtype, vocab_offset: int = 0,
             valid_vocab: int | None = None):
  """Gradients of ``sum(g_logp * logp + g_ent * entropy)`` w.r.t. hidden, weight, bias.

  Args:
    hidden ``[T, H]``, weight ``[H, V]`` / ``[V, H]``, bias ``[V]`` or None,
    targets ``[T]`` int32 global ids, lse and mean_z ``[T]`` float32 (forward
    residuals), g_logp and g_ent ``[T]`` float32 (zero at masked rows: such a
    row contributes exact zeros to every gradient, whatever its hidden state
    or residuals hold, NaN included).
    temperature, compute_dtype, vocab_offset, valid_vocab: as in :func:`tile_partials`.

  Returns:
    ``(dh, dw, db)``: float32 ``[T, H]`` (rows batch-invariant; a vocab shard's
    term of the sum over shards), ``dw`` in ``weight.dtype`` and float32 ``db``
    ``[V]`` or None (deterministic run to run).
  """
  t, h = hidden.shape
  v = _vocab_size(weight, layout)
  v_local = v if valid_vocab is None else int(valid_vocab)
  hv = layout == "hv"
  rb, vc = CPU_ROW_BLOCK, CPU_VOCAB_CHUNK
  has_bias = bias is not None
  if t == 0:
    return (jnp.zeros((0, h), jnp.float32), jnp.zeros(weight.shape, weight.dtype),
            jnp.zeros((v,), jnp.float32) if has_bias else None)
  g_logp = jnp.asarray(g_logp, jnp.float32)
  g_ent = jnp.asarray(g_ent, jnp.float32)
  active = (g_logp != 0) | (g_ent != 0)  # NaN cotangents stay active (and propagate)
  hidden_in = hidden
  # Inside a user's shard_map the loop carries vary as these operands do.
  operands = (hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, temperature)
  hidden = jnp.where(active[:, None], hidden, jnp.zeros((), hidden.dtype))
  x, tg, temp, zero = _prepare(hidden, targets, temperature, compute_dtype, vocab_offset)
  t_pad = x.shape[0]
  lse, mean_z, g_logp, g_ent = (pad_rows(jnp.asarray(a, jnp.float32), rb)
                                for a in (lse, mean_z, g_logp, g_ent))
  active = pad_rows(active, rb)
  cols = lax.broadcasted_iota(jnp.int32, (vc,), 0)

  def chunk(c0, w_c, b_c, carry):
    dh, dw, db = carry
    ok = c0 + cols < v_local

    def block(i, carry):
      dh, dw_c, db_c = carry
      r0 = i * rb
      rows = lambda a: lax.dynamic_slice_in_dim(a, r0, rb)  # noqa: E731
      xb = rows(x)
      z = _block_logits(xb, w_c, b_c, temp, ok, hv, zero)
      dz = _dlogits(z, ok, rows(lse), rows(mean_z), rows(g_logp), rows(g_ent),
                    rows(tg) - c0, rows(active), temp, zero)
      # dH rows: this chunk's term, added after the previous chunks' (ascending).
      prod = dot_f32(dz, w_c, ((1,), (1,)) if hv else ((1,), (0,)), zero)
      dh = lax.dynamic_update_slice(dh, rows(dh) + prod, (r0, 0))
      # dW and db of the chunk: sums over row blocks, ascending.
      dw_c = dw_c + (dot_f32(xb, dz, ((0,), (0,)), zero) if hv
                     else dot_f32(dz, xb, ((0,), (0,)), zero))
      if db_c is not None:
        db_c = db_c + tree_sum_last(dz.T)
      return dh, dw_c, db_c

    dw_c = jnp.zeros((h, vc) if hv else (vc, h), jnp.float32)
    db_c = jnp.zeros((vc,), jnp.float32) if has_bias else None
    dw_c, db_c = varying_like((dw_c, db_c), *operands)
    dh, dw_c, db_c = lax.fori_loop(0, t_pad // rb, block, (dh, dw_c, db_c))
    dw = _write_cols(dw, to_storage(dw_c, weight.dtype), c0, 1 if hv else 0)
    if has_bias:
      db = _write_cols(db, db_c, c0, 0)
    return dh, dw, db

  # dW is written chunk by chunk into its bits (16-bit weights: see _cpu.storage_dtype).
  carry = (jnp.zeros((t_pad, h), jnp.float32),
           jnp.zeros(weight.shape, storage_dtype(weight.dtype)),
           jnp.zeros((v,), jnp.float32) if has_bias else None)
  carry = varying_like(carry, *operands)
  dh, dw, db = _for_each_chunk(weight, bias, layout, compute_dtype, chunk, carry)
  # Inside a user's shard_map, a replicated operand's gradient is the sum of the
  # devices' terms (as JAX's autodiff transposes the implicit broadcast).
  return (sum_to_match(dh[:t], hidden_in), sum_to_match(from_storage(dw, weight.dtype), weight),
          sum_to_match(db, bias))
