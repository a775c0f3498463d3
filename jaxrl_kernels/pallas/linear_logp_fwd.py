"""Fused LM-head forward in Pallas: per-vocab-tile softmax partials, and their merge.

Two kernels (Triton lowering on GPU, the Pallas interpreter on CPU; same code):

* ``tile_partials``: program ``(i, j)`` computes the logits tile
  ``z = (h[rows_i] @ W[:, tile_j] + b[tile_j]) / temperature`` (``[block_t,
  VOCAB_TILE]``, float32 accumulation over ``H`` in ascending ``block_h`` steps)
  and reduces it at once to three float32 numbers per row:

      m_j = max_v z_v,   s_j = sum_v exp(z_v - m_j),   u_j = sum_v exp(z_v - m_j) (z_v - m_j)

  plus the target logit ``z[t]`` of the row when ``t`` falls in tile ``j``.
  No logits leave the kernel: the outputs are ``[n_tiles, T]`` per quantity.
* ``merge_partials``: per row, folds the tiles in ascending tile order into
  ``lse = m + log s``, ``mean_z = sum_v p_v z_v = m + u / s`` and
  ``entropy = log s - u / s`` (written without ``m`` so no cancellation).

Invariance: the vocab tile width and the ascending merge order are the
contract; a row's bits depend on nothing else (not on T, the row's position,
other rows, or how the vocabulary is split into contiguous shards on the tile
grid). ``block_t`` and the launch order are free knobs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Part of the numerical contract: the vocab tile width fixes which logits are
# reduced together into one partial, and so the bits of every merged result.
# Shard boundaries (tensor parallelism) must fall on multiples of it.
VOCAB_TILE = 128


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Free tiling knobs of the logits-tile kernels (any value keeps the bits of a
  given configuration batch-invariant; the defaults never depend on T).

  Attributes:
    block_t: token rows per program.
    block_h: step of the float32 accumulation over the hidden size.
    group_t: token blocks launched next to each other (L2 reuse of weight tiles).
    merge_block_t: token rows per program of the merge kernel.
    num_warps, num_stages: Triton compiler parameters.
  """

  block_t: int = 128
  block_h: int = 64
  group_t: int = 8
  merge_block_t: int = 256
  num_warps: int = 8
  num_stages: int = 3


def default_config(compute_dtype, interpret: bool) -> TuningConfig:
  """Tiles by compute dtype and backend only (never by the number of tokens)."""
  if interpret:
    # The interpreter runs programs one after another on the CPU: small tiles.
    return TuningConfig(block_t=32, block_h=64, group_t=4, merge_block_t=64)
  if jnp.dtype(compute_dtype) == jnp.float32:
    return TuningConfig(block_t=64, block_h=32, num_warps=4, num_stages=3)
  return TuningConfig(block_t=128, block_h=64, num_warps=8, num_stages=3)


def dot_precision(compute_dtype, interpret: bool):
  """fp32 products get fp32 accuracy (IEEE on CPU, 3xTF32 on GPU); never TF32."""
  if jnp.dtype(compute_dtype) != jnp.float32:
    return None
  if interpret:
    return lax.Precision.HIGHEST
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def compiler_params(cfg: TuningConfig, interpret: bool) -> dict:
  if interpret:
    return {}
  return {"compiler_params": pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                     num_stages=cfg.num_stages)}


def swizzle(pid, n_t: int, n_v: int, group_t: int):
  """Maps a 1-D program id to (token block, vocab tile), ``group_t`` token blocks
  at a time, so concurrently running programs share weight tiles in L2."""
  per_group = group_t * n_v
  first_t = (pid // per_group) * group_t
  size = jnp.minimum(n_t - first_t, group_t)
  local = pid % per_group
  return first_t + local % size, local // size


def logits_tile(h_ref, w_ref, b_ref, row0, col0, *, t, h, v_local, block_t, layout,
                temperature, compute_dtype, precision, block_h):
  """The float32 logits tile ``[block_t, VOCAB_TILE]`` at rows ``row0``, local
  columns ``col0`` of the weight; columns at or past ``v_local`` are -inf.

  The one definition of the logits used by the forward and backward kernels.
  ``w_ref`` is ``[H, V]`` (``layout="hv"``) or ``[V, H]`` (``"vh"``, read in
  place: the tile is contracted on its last dimension).
  """
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (VOCAB_TILE,), 0)
  row_ok = rows < t
  col_ok = cols < v_local

  def body(kk, acc):
    ks = kk * block_h + lax.broadcasted_iota(jnp.int32, (block_h,), 0)
    k_ok = ks < h
    x = pltriton.load(h_ref.at[pl.ds(row0, block_t), pl.ds(kk * block_h, block_h)],
                      mask=row_ok[:, None] & k_ok[None, :], other=0)
    if layout == "hv":
      w = pltriton.load(w_ref.at[pl.ds(kk * block_h, block_h), pl.ds(col0, VOCAB_TILE)],
                        mask=k_ok[:, None] & col_ok[None, :], other=0)
      dims = ((1,), (0,))
    else:
      w = pltriton.load(w_ref.at[pl.ds(col0, VOCAB_TILE), pl.ds(kk * block_h, block_h)],
                        mask=col_ok[:, None] & k_ok[None, :], other=0)
      dims = ((1,), (1,))
    part = lax.dot_general(x.astype(compute_dtype), w.astype(compute_dtype), (dims, ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)
    return acc + part

  # Ascending H order with a fixed trip count: part of each logit's bits.
  z = lax.fori_loop(0, pl.cdiv(h, block_h), body, jnp.zeros((block_t, VOCAB_TILE), jnp.float32))
  if b_ref is not None:
    b = pltriton.load(b_ref.at[pl.ds(col0, VOCAB_TILE)], mask=col_ok, other=0)
    z = z + b.astype(jnp.float32)[None, :]
  if temperature != 1.0:
    z = z / jnp.float32(temperature)
  z = jnp.where(col_ok[None, :], z, -jnp.inf)
  return z, rows, cols, row_ok, col_ok


_LN2_HI = 0.693145751953125  # 12 significant bits: k * _LN2_HI is exact for |k| < 2^11
_LN2_LO = 1.4286068203094172e-06  # ln 2 - _LN2_HI


def exp_arith(x):
  """float32 ``exp(x)`` from IEEE basic operations only (within 2 ulps; ``x <
  -87.33`` gives 0, ``x > 88`` inf (the kernels only take ``x <= 0``), ``-inf``
  0, NaN NaN).

  For the interpreted kernels: XLA's compiled ``exp`` may differ in the last
  bit between fusions (vectorized or not), these operations cannot.
  ``x = k ln2 + r`` with ``k = round(x / ln2)`` (two-part ln2, exact
  products), ``exp(r)`` by Horner on its Taylor series to degree 8 (``|r| <=
  0.35``), then scaled by ``2^k`` through the exponent bits.
  """
  x = jnp.asarray(x, jnp.float32)
  xc = jnp.clip(x, -87.33, 88.0)
  k = jnp.round(xc * jnp.float32(1.4426950408889634))
  r = (xc - k * jnp.float32(_LN2_HI)) - k * jnp.float32(_LN2_LO)
  p = jnp.float32(1.0 / 40320)
  for c in (1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
    p = p * r + jnp.float32(c)
  scale = lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)
  y = p * scale
  y = jnp.where(x < -87.33, 0.0, jnp.where(x > 88.0, jnp.inf, y))
  return jnp.where(jnp.isnan(x), x, y)


def log_arith(x):
  """float32 ``log(x)`` from IEEE basic operations only (within a few ulps;
  0 gives -inf, negative or NaN gives NaN, subnormals are treated as 0).

  ``x = 2^e f`` with ``f`` in [sqrt(1/2), sqrt(2)), ``log f = 2 atanh(y)``,
  ``y = (f - 1) / (f + 1)``, as a fixed odd series to ``y^13``.
  """
  x = jnp.asarray(x, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.int32)
  e = (bits >> 23) - 127
  f = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)
  big = f > jnp.float32(1.4142135)
  f = jnp.where(big, f * jnp.float32(0.5), f)
  e = jnp.where(big, e + 1, e)
  y = (f - 1.0) / (f + 1.0)
  y2 = y * y
  p = jnp.float32(1.0 / 13)
  for c in (1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5, 1.0 / 3, 1.0):
    p = p * y2 + jnp.float32(c)
  ef = e.astype(jnp.float32)
  r = (2.0 * y * p + ef * jnp.float32(_LN2_LO)) + ef * jnp.float32(_LN2_HI)
  r = jnp.where(x == jnp.inf, jnp.inf, r)
  return jnp.where(x >= jnp.float32(1.1754944e-38), r,
                   jnp.where((x >= 0) & ~jnp.isnan(x), -jnp.inf, jnp.nan))


def tile_stats(z, col_ok, *, interpret: bool):
  """Per-row ``(m, s, u)`` of a float32 logits tile ``z [rows, VOCAB_TILE]``
  (masked columns -inf, ``col_ok`` their mask): ``m = max z``, ``s = sum
  exp(z - m)``, ``u = sum exp(z - m) (z - m)``. Shared by every kernel that
  must produce the fused forward's bits (the from-logits path of nn.lm_head).

  Compiled (Triton), the two sums are reductions in the kernel's register
  layout. Interpreted, they are a fixed pairwise tree of elementwise adds
  (halving the columns 7 times) and the exponential is :func:`exp_arith`: XLA
  compiles an interpreted ``jnp.sum`` and ``jnp.exp`` to different code
  depending on what else is live (dropping ``u``, as a forward-only call
  without entropy does, changed the last bit of ``s`` on some rows against
  the training call); IEEE basic operations round the same way in any fusion.
  """
  m = jnp.max(z, axis=1)  # exact in any order
  e = (exp_arith if interpret else jnp.exp)(z - m[:, None])  # exp(-inf) = 0 on masked columns
  d = jnp.where(col_ok[None, :], e * (z - m[:, None]), 0.0)
  if not interpret:
    return m, jnp.sum(e, axis=1), jnp.sum(d, axis=1)
  width = z.shape[1]
  while width > 1:
    width //= 2
    e = e[:, :width] + e[:, width:2 * width]
    d = d[:, :width] + d[:, width:2 * width]
  return m, e[:, 0], d[:, 0]


def _partials_kernel(*refs, t, h, v_local, vocab_offset, n_t, n_v, has_bias, block_t, interpret,
                     group_t, **tile_kw):
  if has_bias:
    h_ref, w_ref, b_ref, tg_ref, _, m_ref, s_ref, u_ref, tz_ref = refs
  else:
    h_ref, w_ref, tg_ref, _, m_ref, s_ref, u_ref, tz_ref = refs
    b_ref = None
  i, j = swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * block_t
  col0 = j * VOCAB_TILE
  z, rows, cols, row_ok, col_ok = logits_tile(h_ref, w_ref, b_ref, row0, col0, t=t, h=h,
                                              v_local=v_local, block_t=block_t, **tile_kw)
  m, s, u = tile_stats(z, col_ok, interpret=interpret)
  pltriton.store(m_ref.at[j, pl.ds(row0, block_t)], m, mask=row_ok)
  pltriton.store(s_ref.at[j, pl.ds(row0, block_t)], s, mask=row_ok)
  pltriton.store(u_ref.at[j, pl.ds(row0, block_t)], u, mask=row_ok)
  # The target logit, written only by the tile that owns the target (exactly
  # one term of the masked sum is non-zero, so it is exact).
  tg = pltriton.load(tg_ref.at[pl.ds(row0, block_t)], mask=row_ok, other=-1) - vocab_offset
  hit = (cols[None, :] == tg[:, None]) & col_ok[None, :]
  tz = jnp.sum(jnp.where(hit, z, 0.0), axis=1)
  owns = row_ok & (tg >= col0) & (tg < jnp.minimum(col0 + VOCAB_TILE, v_local))
  pltriton.store(tz_ref.at[pl.ds(row0, block_t)], tz, mask=owns)


def tile_partials(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, layout: str, temperature: float, compute_dtype,
                  interpret: bool, vocab_offset: int = 0, valid_vocab: int | None = None,
                  config: TuningConfig | None = None):
  """Per-vocab-tile softmax partials of ``z = (hidden @ W + b) / temperature``.

  Args:
    hidden: ``[T, H]``.
    weight: ``[H, V]`` (``layout="hv"``) or ``[V, H]`` (``"vh"``); a shard
      holding global vocab ids ``[vocab_offset, vocab_offset + V)``.
    bias: ``[V]`` or None.
    targets: ``[T]`` int32 global vocab ids (anything, e.g. -100, elsewhere).
    compute_dtype: dtype the tiles are cast to before the product (float32
      for ``fp32_head``); accumulation is always float32.
    vocab_offset: global id of this weight's first vocab column.
    valid_vocab: columns ``>= valid_vocab`` are padding, masked to -inf
      (default: all ``V``).

  Returns:
    ``(m, s, u, target_logit)``: float32 ``[ceil(V / VOCAB_TILE), T]`` each for
    the partials, and ``[T]`` target logits, 0 where this weight does not own
    the row's target.
  """
  t, h = hidden.shape
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  v_local = v if valid_vocab is None else valid_vocab
  cfg = config or default_config(compute_dtype, interpret)
  n_t = pl.cdiv(t, cfg.block_t)
  n_v = pl.cdiv(v, VOCAB_TILE)
  has_bias = bias is not None
  kernel = functools.partial(
      _partials_kernel, t=t, h=h, v_local=v_local, vocab_offset=vocab_offset, n_t=n_t, n_v=n_v,
      interpret=interpret,
      has_bias=has_bias, block_t=cfg.block_t, group_t=cfg.group_t, block_h=cfg.block_h,
      layout=layout, temperature=float(temperature), compute_dtype=jnp.dtype(compute_dtype),
      precision=dot_precision(compute_dtype, interpret))
  tz0 = jnp.zeros((t,), jnp.float32)
  args = [hidden, weight] + ([bias] if has_bias else []) + [targets, tz0]
  part = jax.ShapeDtypeStruct((n_v, t), jnp.float32)
  m, s, u, tz = pl.pallas_call(
      kernel,
      grid=(n_t * n_v,),
      out_shape=(part, part, part, jax.ShapeDtypeStruct((t,), jnp.float32)),
      input_output_aliases={len(args) - 1: 3},
      interpret=interpret,
      name="linear_logp_tile_partials",
      **compiler_params(cfg, interpret),
  )(*args)
  return m, s, u, tz


def _merge_kernel(m_ref, s_ref, u_ref, lse_ref, mean_ref, ent_ref, *, t, n, block,
                  interpret=False):
  # Interpreted: exp/log from basic operations (see tile_stats) so that the
  # fold compiles to the same bits whichever of its outputs a caller uses.
  row0 = pl.program_id(0) * block
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block,), 0)
  ok = rows < t

  def body(k, state):
    m, s, u = state
    mt = pltriton.load(m_ref.at[k, pl.ds(row0, block)], mask=ok, other=0)
    st = pltriton.load(s_ref.at[k, pl.ds(row0, block)], mask=ok, other=0)
    ut = pltriton.load(u_ref.at[k, pl.ds(row0, block)], mask=ok, other=0)
    return merge_step(m, s, u, mt, st, ut, exp=exp_arith if interpret else jnp.exp)

  init = (jnp.full((block,), -jnp.inf, jnp.float32), jnp.zeros((block,), jnp.float32),
          jnp.zeros((block,), jnp.float32))
  # Ascending tile order: the contract that makes the merge reproducible.
  m, s, u = lax.fori_loop(0, n, body, init)
  log_s = (log_arith if interpret else jnp.log)(s)
  ratio = u / s
  pltriton.store(lse_ref.at[pl.ds(row0, block)], m + log_s, mask=ok)
  pltriton.store(mean_ref.at[pl.ds(row0, block)], m + ratio, mask=ok)
  pltriton.store(ent_ref.at[pl.ds(row0, block)], log_s - ratio, mask=ok)


def merge_step(m, s, u, mt, st, ut, exp=jnp.exp):
  """Folds partial ``(mt, st, ut)`` into the running ``(m, s, u)``.

  With ``M = max(m, mt)``: ``s' = e^(m-M) s + e^(mt-M) st`` and
  ``u' = e^(m-M) (u + (m-M) s) + e^(mt-M) (ut + (mt-M) st)``. An empty side
  (``s == 0``: the start, or a tile of padding only) is skipped exactly.
  """
  big = jnp.maximum(m, mt)
  da = m - big
  db = mt - big
  a = exp(da)
  b = exp(db)
  s2 = a * s + b * st
  u2 = a * (u + da * s) + b * (ut + db * st)
  take_tile = s == 0
  keep = st == 0
  m_out = jnp.where(take_tile, mt, jnp.where(keep, m, big))
  s_out = jnp.where(take_tile, st, jnp.where(keep, s, s2))
  u_out = jnp.where(take_tile, ut, jnp.where(keep, u, u2))
  return m_out, s_out, u_out


def merge_partials(m: jax.Array, s: jax.Array, u: jax.Array, *, interpret: bool,
                   config: TuningConfig | None = None):
  """Merges ``[n_tiles, T]`` partials in ascending tile order.

  Returns float32 ``(lse, mean_z, entropy)``, each ``[T]``:
  ``lse = logsumexp(z)``, ``mean_z = sum softmax(z) z``, ``entropy = lse - mean_z``.
  """
  n, t = m.shape
  cfg = config or default_config(jnp.bfloat16, interpret)
  block = cfg.merge_block_t
  out = jax.ShapeDtypeStruct((t,), jnp.float32)
  extra = {}
  if not interpret:
    extra["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=2)
  return pl.pallas_call(
      functools.partial(_merge_kernel, t=t, n=n, block=block, interpret=interpret),
      grid=(pl.cdiv(t, block),),
      out_shape=(out, out, out),
      interpret=interpret,
      name="linear_logp_merge",
      **extra,
  )(m, s, u)
