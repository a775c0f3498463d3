"""``implementation="cpu"``: causal grouped-query attention as fixed-shape XLA CPU dots.

Layout: the query rows of one (batch entry ``b``, kv head ``hk``) are its
``Tq x G`` (query, group head) pairs, zero-padded to a multiple of
``CPU_ATTENTION_BLOCK_Q``; the keys of ``(b, hk)`` are zero-padded to a multiple
of ``CPU_ATTENTION_KEY_TILE``. A row at position ``p`` sees key ``j`` iff
``j <= last = min(p, kv_lengths[b] - 1)``.

Forward, per block of rows (a ``lax.fori_loop`` over all blocks), key tiles
``t = 0, 1, ...`` in ascending order up to the block's largest ``last``, a
float32 online softmax in base 2 (``s = log2(e) * scale * q . k``)::

    m' = max(m, max_j s_j),  a = 2^(m - m'),  p_j = 2^(s_j - m'),
    l' = a l + sum_j p_j,    acc' = a acc + p @ v_tile,   out = acc / l,
    lse2 = m + log2 l.

Why a row's bits depend on that row alone (``q[b, i, h]``, ``k/v[b, :last +
1, hk]``, ``D``, the dtype and ``scale``), whatever ``B``, ``Tq``, ``S``, the
cache length, the other rows of its block, or whether it runs under
``jax.grad``:

* every product is an XLA dot of one shape (``[BLOCK_Q, D] x [D, KEY_TILE]``
  scores, ``[BLOCK_Q, KEY_TILE] x [KEY_TILE, D]`` for ``P @ V``), so XLA's CPU
  GEMM picks one blocking for every call; within a dot a row's result does not
  depend on the other rows;
* each product and ``exp2``/``log2`` result passes ``_cpu.guard`` before the add
  that consumes it (no FMA contraction, whatever the fusion), and ``sum_j p_j``
  is a fixed pairwise tree (``_cpu.tree_sum_last``);
* a row that sees no key of a tile keeps ``(m, l, acc)`` by a select: tiles
  walked for the block's other rows never touch its bits; inside a tile its
  unseen keys have ``p = 0`` exactly, adding zeros to the dot's sums;
* keys past the block's largest ``last`` (cache garbage past ``kv_lengths``,
  NaN included) are replaced by zeros before any product (a select), so they
  never reach an output or a gradient.

Backward (``jax.custom_vjp`` in ``api.py``, from the forward's ``out`` and
``lse2``): ``delta = rowsum(dO * O)``; per row block, the key tiles in the same
ascending order recompute ``P = 2^(s - lse2)``, ``dS = P (dO V^T - delta)`` and
add ``dS K`` (rows batch-invariant, by the same construction); per key tile,
the row blocks of ``(b, hk)`` (every group head) in ascending order add ``P^T
dO`` and ``dS^T Q`` (deterministic run to run; sums over the batch entry's
rows). Rows that see no key (padding queries) are zeroed before any product,
so NaN in their ``q`` or ``d_out`` stays out of every gradient.

All products run in float32 (bf16/fp16 inputs upcast exactly, ``P`` kept in
float32); the bits are the CPU implementation's own, not the GPU kernels'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels._cpu import cdiv, dot_f32, guard, opaque_zero, tree_sum_last, varying_like
from jaxrl_kernels.attention.base import AttentionBackend
from jaxrl_kernels.contract import CPU_ATTENTION_BLOCK_Q, CPU_ATTENTION_KEY_TILE
from jaxrl_kernels.pallas._common import LOG2E

if CPU_ATTENTION_KEY_TILE & (CPU_ATTENTION_KEY_TILE - 1):
  raise ValueError(f"CPU_ATTENTION_KEY_TILE={CPU_ATTENTION_KEY_TILE} must be a power of two")

BLOCK_Q = CPU_ATTENTION_BLOCK_Q
KEY_TILE = CPU_ATTENTION_KEY_TILE
DTYPES = ("bfloat16", "float16", "float32")


def supported(d: int, dtype) -> str | None:
  """None when this backend runs head dim ``d`` and ``dtype`` (any ``d >= 1``), else why not."""
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not one of {DTYPES}"
  if d < 1:
    return f"head dim {d} is not positive"
  return None


def _rows(x: jax.Array, hkv: int) -> jax.Array:
  """``[B, Tq, Hq, ...]`` -> ``[B * Hkv, Tq * G, ...]``: row ``i * G + g`` of ``(b, hk)``
  is query ``i`` of head ``hk * G + g``."""
  bsz, tq, hq = x.shape[:3]
  g = hq // hkv
  x = x.reshape(bsz, tq, hkv, g, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(bsz * hkv, tq * g, *x.shape[4:])


def _unrows(x: jax.Array, bsz: int, tq: int, hq: int) -> jax.Array:
  """The inverse of :func:`_rows` (``[B * Hkv, Tq * G, ...]`` -> ``[B, Tq, Hq, ...]``)."""
  hkv = x.shape[0] // bsz
  g = hq // hkv
  x = x.reshape(bsz, hkv, tq, g, *x.shape[2:])
  x = jnp.moveaxis(x, 1, 2)
  return x.reshape(bsz, tq, hq, *x.shape[4:])


def _pad_axis1(x: jax.Array, block: int, value=0) -> jax.Array:
  n = x.shape[1]
  padded = max(cdiv(n, block), 1) * block
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, padded - n)
  return jnp.pad(x, pad, constant_values=value) if padded != n else x


def _layout(q, k, v, q_positions, kv_lengths):
  """Row-major float32 operands: ``q [BH, R, D]``, ``k, v [BH, S_pad, D]``, ``last [BH, R]``
  (-1 on padding rows), all padded to whole blocks / tiles."""
  bsz, tq, hq, _ = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  kv_len = jnp.minimum(kv_lengths.astype(jnp.int32), s_len)
  last = jnp.maximum(jnp.minimum(q_positions.astype(jnp.int32), kv_len[:, None] - 1), -1)
  last = jnp.broadcast_to(last[:, None, :, None], (bsz, hkv, tq, g)).reshape(bsz * hkv, tq * g)
  qr = _pad_axis1(_rows(q.astype(jnp.float32), hkv), BLOCK_Q)
  kr = jnp.moveaxis(k.astype(jnp.float32), 2, 1).reshape(bsz * hkv, s_len, -1)
  vr = jnp.moveaxis(v.astype(jnp.float32), 2, 1).reshape(bsz * hkv, s_len, -1)
  return (qr, _pad_axis1(kr, KEY_TILE), _pad_axis1(vr, KEY_TILE),
          _pad_axis1(last, BLOCK_Q, value=-1))


def _tile(x, bh, key0, bound):
  """Keys ``[key0, key0 + KEY_TILE)`` of ``x[bh]``; those ``> bound`` are zeros (a select:
  NaN there never reaches a product)."""
  t = lax.dynamic_slice(x, (bh, key0, 0), (1, KEY_TILE, x.shape[2]))[0]
  keys = key0 + lax.broadcasted_iota(jnp.int32, (KEY_TILE, 1), 0)
  return jnp.where(keys <= bound, t, 0.0)


def _scores(qb, kt, last, key0, scale2, zero):
  """Base-2 scores ``[BLOCK_Q, KEY_TILE]`` of one tile (-inf where unseen) and visibility.

  The one definition of the scores for the forward and the backward.
  """
  keys = key0 + lax.broadcasted_iota(jnp.int32, (KEY_TILE,), 0)
  visible = keys[None, :] <= last[:, None]
  s = guard(dot_f32(qb, kt, ((1,), (1,)), zero) * jnp.float32(scale2), zero)
  return jnp.where(visible, s, -jnp.inf), visible


def _block(x, bh, r0):
  return lax.dynamic_slice(x, (bh, r0, 0), (1, BLOCK_Q, x.shape[2]))[0]


def _block_rows(x, bh, r0):
  return lax.dynamic_slice(x, (bh, r0), (1, BLOCK_Q))[0]


def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
            kv_lengths: jax.Array, *, scale: float) -> tuple[jax.Array, jax.Array]:
  """Attention output ``[B, Tq, Hq, D]`` (q's dtype) and base-2 logsumexp ``[B, Hq, Tq]``.

  ``lse2 = m + log2 sum_j 2^(s_j - m)`` with ``s = log2(e) * scale * q . k`` over
  the visible keys (0 for a row that sees none, whose output is 0).
  """
  bsz, tq, hq, d = q.shape
  qr, kr, vr, last = _layout(q, k, v, q_positions, kv_lengths)
  n_bh, r_pad = last.shape
  nb = r_pad // BLOCK_Q
  scale2 = float(scale) * LOG2E
  zero = opaque_zero(qr)
  g = lambda x: guard(x, zero)  # noqa: E731

  def block(i, outs):
    out_all, lse_all = outs
    bh, r0 = i // nb, (i % nb) * BLOCK_Q
    qb = _block(qr, bh, r0)
    lb = _block_rows(last, bh, r0)
    block_last = jnp.max(lb)

    def tile(t, carry):
      m, den, acc = carry
      key0 = t * KEY_TILE
      kt = _tile(kr, bh, key0, block_last)
      vt = _tile(vr, bh, key0, block_last)
      s, visible = _scores(qb, kt, lb, key0, scale2, zero)
      active = lb >= key0  # the row sees at least one key of this tile
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_use = jnp.where(active, m_new, 0.0)  # no (-inf) - (-inf) in skipped rows
      alpha = g(jnp.exp2(m - m_use))
      p = g(jnp.where(visible, jnp.exp2(s - m_use[:, None]), 0.0))
      den_new = g(alpha * den) + tree_sum_last(p)
      acc_new = g(alpha[:, None] * acc) + dot_f32(p, vt, ((1,), (0,)), zero)
      # Rows that see nothing here keep their state: the tile is skipped exactly.
      return (jnp.where(active, m_new, m), jnp.where(active, den_new, den),
              jnp.where(active[:, None], acc_new, acc))

    init = varying_like((jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                         jnp.zeros((BLOCK_Q,), jnp.float32),
                         jnp.zeros((BLOCK_Q, d), jnp.float32)), qr, kr, vr, last)
    # Ascending key tiles from key 0, up to the block's last seen key.
    m, den, acc = lax.fori_loop(0, (block_last + KEY_TILE) // KEY_TILE, tile, init)
    # Whether a row sees a key comes from its position (``last``), never from ``den``: a
    # NaN or inf score makes ``den`` NaN, and the row's output and lse must be NaN too.
    seen = lb >= 0
    o = acc / jnp.where(seen, den, 1.0)[:, None]
    # A row that sees no key gives 0; zeros are +0 (an unseen key adds a signed zero).
    o = jnp.where(seen[:, None] & (o != 0), o, 0.0)
    lse = jnp.where(seen, m + g(jnp.log2(jnp.where(seen, den, 1.0))), 0.0)
    out_all = lax.dynamic_update_slice(out_all, o[None], (bh, r0, 0))
    lse_all = lax.dynamic_update_slice(lse_all, lse[None], (bh, r0))
    return out_all, lse_all

  # float32 buffers, rounded to q's dtype once at the end (XLA's CPU compiler has
  # no in-place 16-bit dynamic-update-slice).
  outs = varying_like((jnp.zeros((n_bh, r_pad, d), jnp.float32),
                       jnp.zeros((n_bh, r_pad), jnp.float32)), qr, kr, vr, last)
  out, lse = lax.fori_loop(0, n_bh * nb, block, outs)
  rows = tq * (hq // k.shape[2])
  out = _unrows(out[:, :rows], bsz, tq, hq).astype(q.dtype)
  lse = jnp.moveaxis(_unrows(lse[:, :rows], bsz, tq, hq), 1, 2)  # [B, Hq, Tq]
  return out, lse


def _row_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis as a pairwise tree, zero-padded to a power of two (exact)."""
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  return tree_sum_last(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)]))


def backward(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
             kv_lengths: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array, *,
             scale: float, every_row_sees_a_key: bool = False
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(dq, dk, dv)`` in the input dtypes, from the forward's ``out`` and ``lse2``.

  ``dP = dO V^T``, ``dS = P (dP - rowsum(dO O))``, ``dQ = scale dS K``,
  ``dK = scale dS^T Q`` (summed over the query heads of a kv head), ``dV = P^T dO``.
  ``every_row_sees_a_key`` (``AttentionBackend``'s hint) is not used: the rows are
  cleared inside the layout copies this backward makes anyway, and the CPU code's bits
  stay those of one program.
  """
  bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  qr, kr, vr, last = _layout(q, k, v, q_positions, kv_lengths)
  n_bh, r_pad = last.shape
  nb = r_pad // BLOCK_Q
  n_kt = kr.shape[1] // KEY_TILE
  scale2 = float(scale) * LOG2E
  zero = opaque_zero(qr)
  g = lambda x: guard(x, zero)  # noqa: E731
  sees = last >= 0
  # Rows that see no key (padding) are zeros from here on: NaN in their q, d_out
  # or residuals would otherwise reach dK/dV through 0 * NaN.
  clean = lambda x: jnp.where(sees[..., None], x, 0.0)  # noqa: E731
  qr = clean(qr)
  dor = clean(_pad_axis1(_rows(d_out.astype(jnp.float32), hkv), BLOCK_Q))
  orr = clean(_pad_axis1(_rows(out.astype(jnp.float32), hkv), BLOCK_Q))
  lser = jnp.where(sees, _pad_axis1(_rows(jnp.moveaxis(lse, 1, 2), hkv), BLOCK_Q), 0.0)
  delta = _row_sum(g(dor * orr))  # [BH, R_pad]
  # The last key any row of (b, hk) sees: keys past it get zero gradient and are
  # never read (garbage, NaN included).
  bh_last = jnp.max(last, axis=1)

  def probs(qb, kt, lb, lsb, key0):
    s, visible = _scores(qb, kt, lb, key0, scale2, zero)
    return g(jnp.where(visible, jnp.exp2(s - lsb[:, None]), 0.0))

  def d_scores(p, dob, vt, dlb):
    dp = dot_f32(dob, vt, ((1,), (1,)), zero)
    return g(p * (dp - dlb[:, None]))

  def dq_block(i, dq_all):
    bh, r0 = i // nb, (i % nb) * BLOCK_Q
    qb, dob = _block(qr, bh, r0), _block(dor, bh, r0)
    lb, lsb, dlb = (_block_rows(x, bh, r0) for x in (last, lser, delta))
    block_last = jnp.max(lb)

    def tile(t, dq):
      key0 = t * KEY_TILE
      kt = _tile(kr, bh, key0, block_last)
      vt = _tile(vr, bh, key0, block_last)
      ds = d_scores(probs(qb, kt, lb, lsb, key0), dob, vt, dlb)
      # Rows that see no key of the tile keep their bits (a select).
      return jnp.where((lb >= key0)[:, None], dq + dot_f32(ds, kt, ((1,), (0,)), zero), dq)

    dq0 = varying_like(jnp.zeros((BLOCK_Q, d), jnp.float32), qr, kr, vr, dor, last)
    dq = lax.fori_loop(0, (block_last + KEY_TILE) // KEY_TILE, tile, dq0)
    return lax.dynamic_update_slice(dq_all, dq[None], (bh, r0, 0))

  def dkv_tile(i, dkv_all):
    dk_all, dv_all = dkv_all
    bh, key0 = i // n_kt, (i % n_kt) * KEY_TILE
    kt = _tile(kr, bh, key0, bh_last[bh])
    vt = _tile(vr, bh, key0, bh_last[bh])

    def row_block(j, carry):
      r0 = j * BLOCK_Q
      lb = _block_rows(last, bh, r0)

      def update(carry):
        dk, dv = carry
        qb, dob = _block(qr, bh, r0), _block(dor, bh, r0)
        p = probs(qb, kt, lb, _block_rows(lser, bh, r0), key0)
        ds = d_scores(p, dob, vt, _block_rows(delta, bh, r0))
        return (dk + dot_f32(ds, qb, ((0,), (0,)), zero),
                dv + dot_f32(p, dob, ((0,), (0,)), zero))

      # Row blocks that see none of these keys add nothing: skipped.
      return lax.cond(jnp.max(lb) >= key0, update, lambda c: c, carry)

    z = jnp.zeros((KEY_TILE, d), jnp.float32)
    dk, dv = lax.fori_loop(0, nb, row_block,
                           varying_like((z, z), qr, kr, vr, dor, last))
    dk_all = lax.dynamic_update_slice(dk_all, dk[None], (bh, key0, 0))
    dv_all = lax.dynamic_update_slice(dv_all, dv[None], (bh, key0, 0))
    return dk_all, dv_all

  dq_all = varying_like(jnp.zeros(qr.shape, jnp.float32), qr, kr, vr, dor, last)
  dq_all = lax.fori_loop(0, n_bh * nb, dq_block, dq_all)
  dkv0 = varying_like((jnp.zeros(kr.shape, jnp.float32), jnp.zeros(vr.shape, jnp.float32)),
                      qr, kr, vr, dor, last)
  dk_all, dv_all = lax.fori_loop(0, n_bh * n_kt, dkv_tile, dkv0)
  rows = tq * (hq // hkv)
  dq = _unrows(dq_all[:, :rows] * jnp.float32(scale), bsz, tq, hq)

  def kv_back(x):
    return jnp.moveaxis(x[:, :s_len].reshape(bsz, hkv, s_len, d), 1, 2)

  dk = kv_back(dk_all * jnp.float32(scale))
  dv = kv_back(dv_all)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


BACKEND = AttentionBackend("cpu", forward=forward, backward=backward, supported=supported)
