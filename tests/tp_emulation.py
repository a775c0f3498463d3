"""Vocab-parallel linear_logp emulated on one device: the shards' partials merged in order."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels.linear_logp import finalize, merge_partials, tile_partials
from jaxrl_kernels.linear_logp.vocab_parallel import pad_vocab


@functools.partial(jax.jit, static_argnames=("tp", "vocab", "layout", "implementation"))
def emulated_tp_logp(x, w, tg, tp: int, vocab: int, *, layout: str = "hv", implementation):
  """``(logp, entropy)`` of ``w`` (``vocab`` columns) split into ``tp`` padded shards on the
  tile grid: each shard's ``tile_partials``, concatenated in global tile order, through the
  one ``merge_partials`` and ``finalize`` (what vocab_parallel_linear_logp does over devices),
  jitted as a training step runs it: one program per TP degree."""
  wp = pad_vocab(w, tp, weight_layout=layout)
  v_s = (wp.shape[1] if layout == "hv" else wp.shape[0]) // tp
  parts, tz = [], 0.0
  for r in range(tp):
    valid = min(max(vocab - r * v_s, 0), v_s)
    shard = wp[:, r * v_s:(r + 1) * v_s] if layout == "hv" else wp[r * v_s:(r + 1) * v_s]
    m, s, u, z = tile_partials(x, shard, None, tg - r * v_s, weight_layout=layout,
                               implementation=implementation, valid_vocab=valid)
    parts.append((m, s, u))
    tz = tz + z
  n = -(-vocab // 128)
  m, s, u = (jnp.concatenate([p[i] for p in parts])[:n] for i in range(3))
  lse, _, ent = merge_partials(m, s, u, implementation=implementation)
  return finalize(tz, lse, ent, tg, None, vocab)
