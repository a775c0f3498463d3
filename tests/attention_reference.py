"""Shared by the attention tests: inputs that reveal reorderings and the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def same_len_inputs(seed, b, t, hq, hkv, d, dtype, *, spread=10):
  """q, k, v of one length ``t``, revealing reorderings: v rows scaled by 2**e,
  e in [-spread, spread]."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k1, (b, t, hq, d))
  k = jax.random.normal(k2, (b, t, hkv, d))
  v = jax.random.normal(k3, (b, t, hkv, d))
  v = v * 2.0 ** jax.random.randint(k4, (b, t, hkv, 1), -spread, spread + 1).astype(jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def reference(q, k, v, pos, kvl, scale, d_out=None):
  """float64 numpy attention; with ``d_out`` also ``(dq, dk, dv)``."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  kk = np.repeat(k, g, axis=2)
  vv = np.repeat(v, g, axis=2)
  vis = (np.arange(s_len)[None, None] <= np.asarray(pos)[:, :, None]) & (
      np.arange(s_len)[None, None] < np.asarray(kvl)[:, None, None])  # [B, Tq, S]
  sc = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
  sc = np.where(vis[:, None], sc, -np.inf)
  mx = np.max(sc, axis=-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  e = np.where(vis[:, None], np.exp(sc - mx), 0.0)
  den = e.sum(-1, keepdims=True)
  p = e / np.where(den > 0, den, 1.0)
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
