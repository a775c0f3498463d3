"""The sampler's draw from a head's logits, written once for every backend.

A token is drawn from ``softmax(z)`` by an exponential race: with independent
``E_v ~ Exp(1)``, ``argmax_v exp(z_v) / E_v`` is distributed as ``softmax(z)``. Each
vocabulary tile of ``VOCAB_TILE`` columns reduces its rows to three numbers
(:func:`tile_draw`): its best key ``m + log max_v (exp(z_v - m) / E_v)`` (``m`` the tile's
max logit, so ``exp(z_v - m)`` is the exponential the tile's softmax statistics already
compute), the column holding it, and that column's logit (an exact masked sum). The tiles
are then merged by taking the best key (:func:`merge_draws`; ties to the lower tile, a
tile's ties to the lower column). The drawn token's logit is so the very logit the fused
``linear_logp`` reduces, and its log-prob is bitwise the trainer's. A Mosaic kernel does
this in the LM head's own epilogue: no ``[T, V]`` logits reach memory.

The race's noise is a counter-based hash of ``(seed, row, column)`` (:func:`noise_bits`): two
rounds of a 32-bit bijective mixer (``lowbias32``) keyed by two per-row words
(:func:`row_keys`, made once per call from two seed words and the row index). Within a
row the 32-bit values are all distinct (each round is a bijection of the column); ``u``
takes the top 23 bits, ``u = (b + 1/2) 2^-23`` (exact in float32, in ``(0, 1)``), and
``E = -log u``. A
column whose ``exp(z_v - m)`` underflows to 0 (a probability below ``e^-87`` of the
tile's largest) cannot be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.pallas import softmax_partials as sp

# lowbias32's multipliers (a 32-bit bijective mixer), as int32 (arithmetic wraps mod 2^32).
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)


def mix32(x):
  """A bijection of 32-bit words (``lowbias32``): xor-shifts and odd multiplies on int32
  (wrapping products, logical shifts)."""
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * jnp.int32(_M1)
  x = x ^ lax.shift_right_logical(x, jnp.int32(15))
  x = x * jnp.int32(_M2)
  return x ^ lax.shift_right_logical(x, jnp.int32(16))


def seed_words(key: jax.Array) -> jax.Array:
  """Two int32 seed words from a PRNG key (any implementation)."""
  return lax.bitcast_convert_type(jax.random.bits(key, (2,), jnp.uint32), jnp.int32)


def row_keys(seed: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two per-row key words of rows ``rows`` (int32 row indices) under ``seed`` (int32
  ``[2]``): distinct rows get distinct first words (a bijection of the row)."""
  rows = rows.astype(jnp.int32)
  k1 = mix32(rows ^ mix32(seed[0] + jnp.int32(_GOLDEN)))
  k2 = mix32(k1 + seed[1])
  return k1, k2


def noise_bits(k1, k2, cols):
  """The 32-bit word of column ``cols`` (int32) in the rows keyed ``(k1, k2)`` (broadcast
  against ``cols``)."""
  return mix32(mix32(cols + k1) ^ k2)


def exp_noise(bits, log=jnp.log):
  """``E = -log u``, ``u = (top 23 bits + 1/2) 2^-23``: an Exp(1) variate per word, in
  ``[5.96e-8, 16.6]``. ``u`` is exact in float32 (24 significant bits) and lies in
  ``[2^-24, 1 - 2^-24]``: never 0 or 1, so ``E`` is never 0 or infinite."""
  u = (lax.shift_right_logical(bits, jnp.int32(9)).astype(jnp.float32) + 0.5) * (
      jnp.float32(2.0 ** -23))
  return -log(u)


def tile_draw(z, m, e, cols, k1, k2, *, log=jnp.log):
  """Per-row ``(key, col, logit)`` of the race over one tile ``z [rows, width]``.

  ``m [rows]``: the tile's row max; ``e = exp(z - m)`` (0 on masked columns); ``cols``:
  the int32 global column ids (as ``z``); ``k1, k2``: the rows' key words broadcast as
  ``z``. ``col`` is returned as float32 (exact below 2^24 columns), ``logit`` is the exact
  masked sum of the winning column's ``z``.
  """
  ratio = e / exp_noise(noise_bits(k1, k2, cols), log)
  best = jnp.max(ratio, axis=1)
  hit = ratio == lax.broadcast_in_dim(best, ratio.shape, [0])
  colf = cols.astype(jnp.float32)
  col = -jnp.max(jnp.where(hit, -colf, -jnp.inf), axis=1)
  logit = jnp.sum(jnp.where(colf == lax.broadcast_in_dim(col, z.shape, [0]), z, 0.0), axis=1)
  return m + log(best), col, logit


def merge_draws(key, col, logit):
  """The drawn token and its logit from per-tile ``[n_tiles, ...]`` results of
  :func:`tile_draw`: the tile of the largest key (ties to the lower tile)."""
  # A tile whose row has no logit above -inf has key -inf there; a NaN key (NaN logits)
  # never wins either.
  win = jnp.argmax(jnp.where(jnp.isnan(key), -jnp.inf, key), axis=0)
  pick = lambda x: jnp.take_along_axis(x, win[None], axis=0)[0]  # noqa: E731
  col = pick(col)
  # A row of NaN logits has no winner: token 0, and its statistics (so its log-prob) NaN.
  return jnp.where(jnp.isfinite(col), col, 0.0).astype(jnp.int32), pick(logit)


def draw_from_logits(z: jax.Array, seed: jax.Array, *, tile: int) -> tuple[jax.Array, jax.Array]:
  """The race over materialized float32 logits ``z [T, V]`` (masked columns ``-inf``), tile
  by tile as the fused kernel runs it: ``(tokens [T] int32, their logits [T])``.

  The backends without a fused draw take this; its tokens follow the same rule as the
  fused one's (the same noise words), its floating point may round differently.
  """
  t, v = z.shape
  n = -(-v // tile)
  zp = jnp.pad(z, ((0, 0), (0, n * tile - v)), constant_values=-jnp.inf)
  zt = zp.reshape(t, n, tile).transpose(1, 0, 2)  # [n, T, tile]
  k1, k2 = row_keys(seed, jnp.arange(t, dtype=jnp.int32))
  cols = (jnp.arange(n, dtype=jnp.int32)[:, None] * tile
          + jnp.arange(tile, dtype=jnp.int32)[None, :])  # [n, tile]

  def one(zt, cols):
    m = jnp.max(zt, axis=1)
    e = jnp.exp(zt - sp.finite_max(m)[:, None])  # 0 across a tile masked whole
    cb = jnp.broadcast_to(cols[None, :], zt.shape)
    return tile_draw(zt, m, e, cb, k1[:, None], k2[:, None])

  key, col, logit = jax.vmap(one)(zt, cols)
  return merge_draws(key, col, logit)
