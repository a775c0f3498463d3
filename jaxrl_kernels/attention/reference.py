"""Float64 reference for ``causal_attention`` (the truth tests and benchmarks compare against)."""

from __future__ import annotations

import numpy as np


def attention_reference(q, k, v, q_positions, kv_lengths, scale: float, d_out=None):
  """Causal grouped-query attention in float64 on the host.

  ``out[b, i, h] = sum_j p_ij v[b, j, h // G]`` with ``p = softmax_j(scale q . k)``
  over the keys ``j <= q_positions[b, i]``, ``j < kv_lengths[b]`` (0 for a query
  that sees none).

  Args:
    q: ``[B, Tq, Hq, D]``; k, v: ``[B, S, Hkv, D]``; q_positions ``[B, Tq]``;
      kv_lengths ``[B]``.
    d_out: optional ``[B, Tq, Hq, D]`` cotangent.

  Returns:
    ``out`` (float64 ``[B, Tq, Hq, D]``), and with ``d_out`` also
    ``(dq, dk, dv)`` of ``sum(d_out * out)``.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  kk = np.repeat(k, g, axis=2)
  vv = np.repeat(v, g, axis=2)
  keys = np.arange(s_len)[None, None]
  vis = (keys <= np.asarray(q_positions)[:, :, None]) & (
      keys < np.asarray(kv_lengths)[:, None, None])  # [B, Tq, S]
  sc = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
  sc = np.where(vis[:, None], sc, -np.inf)
  mx = np.max(sc, axis=-1, keepdims=True)
  mx = np.where(vis.any(-1)[:, None, :, None], mx, 0.0)
  with np.errstate(invalid="ignore"):  # inf - inf: a NaN score, kept as NaN
    e = np.where(vis[:, None], np.exp(sc - mx), 0.0)
  den = e.sum(-1, keepdims=True)
  # A row sees a key iff its mask has one (never read from ``den``: NaN scores give NaN).
  p = e / np.where(vis.any(-1)[:, None, :, None], den, 1.0)
  out = np.einsum("bhqk,bkhd->bqhd", p, vv)
  if d_out is None:
    return out
  do = np.asarray(d_out, np.float64)
  dv = np.einsum("bhqk,bqhd->bkhd", p, do)
  dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
  ds = p * (dp - np.einsum("bqhd,bqhd->bhq", do, out)[..., None])
  dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  fold = lambda x: x.reshape(b, s_len, hkv, g, d).sum(3)  # noqa: E731
  return out, (dq, fold(dk), fold(dv))
