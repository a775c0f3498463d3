"""``implementation="xla"``: plain-XLA causal attention, the materialised baseline.

Scores ``[B, Hkv, group, Tq, S]`` in float32 (fp32 inputs at HIGHEST precision),
a masked softmax over keys, and ``P @ V``. Not batch-invariant (XLA picks the
reduction order by shape); a baseline for tests and benchmarks only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def visibility(q_positions: jax.Array, kv_lengths: jax.Array, s_len: int) -> jax.Array:
  """``[B, Tq, S]`` bool: query ``i`` of row ``b`` sees key ``j`` iff
  ``j <= q_positions[b, i]`` and ``j < kv_lengths[b]``."""
  keys = jnp.arange(s_len, dtype=jnp.int32)
  return ((keys[None, None, :] <= q_positions[:, :, None])
          & (keys[None, None, :] < kv_lengths[:, None, None]))


def causal_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                         kv_lengths: jax.Array, *, scale: float) -> jax.Array:
  """``softmax(scale q k^T + mask) v`` per query head (grouped-query), in q's dtype.

  Args:
    q: ``[B, Tq, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with ``Hq % Hkv == 0``.
    q_positions: ``[B, Tq]`` int32; kv_lengths: ``[B]`` int32.

  A query that sees no key outputs 0 (and gets zero gradient).
  """
  bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  qg = q.reshape(bsz, tq, hkv, group, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=prec,
                 preferred_element_type=jnp.float32) * jnp.float32(scale)
  vis = visibility(q_positions, kv_lengths, s_len)[:, None, None]  # [B, 1, 1, Tq, S]
  any_vis = jnp.any(vis, axis=-1, keepdims=True)
  # Double where: rows with no visible key get finite scores, then p = 0 (no NaN grads).
  s = jnp.where(vis, s, jnp.where(any_vis, -jnp.inf, 0.0))
  p = jnp.where(vis, jax.nn.softmax(s, axis=-1), 0.0)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=prec)
  return o.reshape(bsz, tq, hq, d).astype(q.dtype)
