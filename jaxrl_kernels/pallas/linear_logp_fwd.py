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

from jaxrl_kernels import contract
from jaxrl_kernels.pallas import _common
from jaxrl_kernels.pallas import softmax_partials as sp

VOCAB_TILE = contract.VOCAB_TILE


def block_h(compute_dtype, interpret: bool) -> int:
  """The H step of the logits tile: part of the contract (it fixes every logit's
  bits, and so the sampler's logits equal the trainer's), not a tuning knob."""
  if interpret:
    return contract.LOGITS_BLOCK_H_INTERPRET
  return contract.LOGITS_BLOCK_H_TRITON[jnp.dtype(compute_dtype).name]


@dataclasses.dataclass(frozen=True)
class Config:
  """Free tiling knobs of the logits-tile kernels: none changes a row's bits (the
  H step, which does, is :func:`block_h`, from ``contract.py``); the defaults
  never depend on T.

  Attributes:
    block_t: token rows per program.
    group_t: token blocks launched next to each other (L2 reuse of weight tiles).
    merge_block_t: token rows per program of the merge kernel.
    num_warps, num_stages: Triton compiler parameters.
  """

  block_t: int = 128
  group_t: int = 8
  merge_block_t: int = 64
  num_warps: int = 8
  num_stages: int = 3


def default_config(compute_dtype, interpret: bool) -> Config:
  """Tiles by compute dtype and backend only (never by the number of tokens)."""
  if interpret:
    # The interpreter runs programs one after another on the CPU: small tiles.
    return Config(block_t=32, group_t=4, merge_block_t=64)
  if jnp.dtype(compute_dtype) == jnp.float32:
    return Config(block_t=64, num_warps=4, num_stages=3)
  return Config(block_t=128, num_warps=8, num_stages=3)


def compiler_params(cfg: Config, interpret: bool) -> dict:
  return _common.triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret)


def logits_tile(h_ref, w_ref, b_ref, row0, col0, *, t, h, v_local, block_t, layout,
                temperature, compute_dtype, precision, block_h):
  """The float32 logits tile ``[block_t, VOCAB_TILE]`` at rows ``row0``, local
  columns ``col0`` of the weight; columns at or past ``v_local`` are -inf.

  The one definition of the logits used by the forward, backward and logits
  kernels. ``w_ref`` is ``[H, V]`` (``layout="hv"``) or ``[V, H]`` (``"vh"``,
  read in place: the tile is contracted on its last dimension).
  ``temperature``: None or the float32 ``1 / temperature`` that the logits are
  multiplied by (``softmax_partials.temperature_operand``).
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
  bias_row = None
  if b_ref is not None:
    b = pltriton.load(b_ref.at[pl.ds(col0, VOCAB_TILE)], mask=col_ok, other=0)
    bias_row = b.astype(jnp.float32)[None, :]
  z = sp.scale_logits(z, bias_row, temperature)
  z = jnp.where(col_ok[None, :], z, -jnp.inf)
  return z, rows, cols, row_ok, col_ok


def split_refs(refs, *, has_bias: bool, has_temp: bool):
  """``(b_ref or None, 1 / temperature or None, rest)`` from a kernel's refs that
  continue with an optional bias ref and an optional ``[1]`` inverse-temperature ref."""
  refs = list(refs)
  b_ref = refs.pop(0) if has_bias else None
  temperature = refs.pop(0)[0] if has_temp else None
  return b_ref, temperature, refs


def _partials_kernel(h_ref, w_ref, *refs, t, h, v_local, vocab_offset, n_t, n_v, has_bias,
                     has_temp, block_t, interpret, group_t, **tile_kw):
  b_ref, temperature, (tg_ref, _, m_ref, s_ref, u_ref, tz_ref) = split_refs(
      refs, has_bias=has_bias, has_temp=has_temp)
  i, j = _common.group_swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * block_t
  col0 = j * VOCAB_TILE
  z, rows, cols, row_ok, col_ok = logits_tile(h_ref, w_ref, b_ref, row0, col0, t=t, h=h,
                                              v_local=v_local, block_t=block_t,
                                              temperature=temperature, **tile_kw)
  m, s, u = sp.tile_stats(z, col_ok, interpret=interpret)
  pltriton.store(m_ref.at[j, pl.ds(row0, block_t)], m, mask=row_ok)
  pltriton.store(s_ref.at[j, pl.ds(row0, block_t)], s, mask=row_ok)
  pltriton.store(u_ref.at[j, pl.ds(row0, block_t)], u, mask=row_ok)
  # The target logit, written only by the tile that owns the target.
  tg = pltriton.load(tg_ref.at[pl.ds(row0, block_t)], mask=row_ok, other=-1) - vocab_offset
  tz = sp.target_logit(z, (cols[None, :] == tg[:, None]) & col_ok[None, :])
  owns = row_ok & sp.owns_target(tg, col0, jnp.minimum(col0 + VOCAB_TILE, v_local))
  pltriton.store(tz_ref.at[pl.ds(row0, block_t)], tz, mask=owns)


def tile_partials(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, layout: str, temperature, compute_dtype,
                  interpret: bool, vocab_offset: int = 0, valid_vocab: int | None = None,
                  config: Config | None = None):
  """Per-vocab-tile softmax partials of ``z = (hidden @ W + b) / temperature``.

  Args:
    hidden: ``[T, H]``.
    weight: ``[H, V]`` (``layout="hv"``) or ``[V, H]`` (``"vh"``); a shard
      holding global vocab ids ``[vocab_offset, vocab_offset + V)``.
    bias: ``[V]`` or None.
    targets: ``[T]`` int32 global vocab ids (anything, e.g. -100, elsewhere).
    temperature: a Python float or a float32 scalar (traced or not).
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
  temp = sp.temperature_operand(temperature)
  kernel = functools.partial(
      _partials_kernel, t=t, h=h, v_local=v_local, vocab_offset=vocab_offset, n_t=n_t, n_v=n_v,
      interpret=interpret, has_bias=bias is not None, has_temp=temp is not None,
      block_t=cfg.block_t, group_t=cfg.group_t, block_h=block_h(compute_dtype, interpret),
      layout=layout, compute_dtype=jnp.dtype(compute_dtype),
      precision=_common.dot_precision(compute_dtype, interpret))
  tz0 = jnp.zeros((t,), jnp.float32)
  args = [hidden, weight] + [x for x in (bias, temp) if x is not None] + [targets, tz0]
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


# The merge is a sequential fold over the vocabulary tiles per row (1187 steps at
# V = 151936): latency-bound. It loads MERGE_UNROLL tiles ahead of folding them, in 64-row
# programs, one warp for a single program's rows (a decode step), else four: the loads of
# the next tiles overlap the fold's latency (benchmarks/results/linear_logp.md).
# None of these changes a bit: each row's steps are the same operations in the same order.
MERGE_UNROLL = 16


def merge_num_warps(t: int) -> int:
  return 1 if t <= 64 else 4


def _merge_kernel(m_ref, s_ref, u_ref, lse_ref, mean_ref, ent_ref, *, t, n, block,
                  interpret=False):
  # Interpreted: exp/log from basic operations (see softmax_partials.tile_stats)
  # so that the fold compiles to the same bits whichever of its outputs a caller uses.
  row0 = pl.program_id(0) * block
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block,), 0)
  ok = rows < t

  exp = sp.exp_arith if interpret else jnp.exp

  def load(k):
    return tuple(pltriton.load(r.at[k, pl.ds(row0, block)], mask=ok, other=0)
                 for r in (m_ref, s_ref, u_ref))

  def body(k, state):
    return sp.merge_step(*state, *load(k), exp=exp)

  def unrolled(c, state):
    # MERGE_UNROLL tiles' loads issued before their merge steps: the steps are the
    # sequential fold's, in the same order (the same bits); only the loads overlap.
    parts = [load(c * MERGE_UNROLL + j) for j in range(MERGE_UNROLL)]
    for part in parts:
      state = sp.merge_step(*state, *part, exp=exp)
    return state

  init = (jnp.full((block,), -jnp.inf, jnp.float32), jnp.zeros((block,), jnp.float32),
          jnp.zeros((block,), jnp.float32))
  # Ascending tile order: the contract that makes the merge reproducible.
  state = lax.fori_loop(0, n // MERGE_UNROLL, unrolled, init)
  m, s, u = lax.fori_loop(n - n % MERGE_UNROLL, n, body, state)
  lse, mean_z, ent = sp.finalize_stats(m, s, u, log=sp.log_arith if interpret else jnp.log)
  pltriton.store(lse_ref.at[pl.ds(row0, block)], lse, mask=ok)
  pltriton.store(mean_ref.at[pl.ds(row0, block)], mean_z, mask=ok)
  pltriton.store(ent_ref.at[pl.ds(row0, block)], ent, mask=ok)


def merge_partials(m: jax.Array, s: jax.Array, u: jax.Array, *, interpret: bool,
                   config: Config | None = None):
  """Merges ``[n_tiles, T]`` partials in ascending tile order.

  Returns float32 ``(lse, mean_z, entropy)``, each ``[T]``:
  ``lse = logsumexp(z)``, ``mean_z = sum softmax(z) z``, ``entropy = lse - mean_z``.
  """
  n, t = m.shape
  cfg = config or default_config(jnp.bfloat16, interpret)
  block = cfg.merge_block_t
  out = jax.ShapeDtypeStruct((t,), jnp.float32)
  return pl.pallas_call(
      functools.partial(_merge_kernel, t=t, n=n, block=block, interpret=interpret),
      grid=(pl.cdiv(t, block),),
      out_shape=(out, out, out),
      interpret=interpret,
      name="linear_logp_merge",
      **_common.triton_compiler_params(merge_num_warps(t), 2, interpret),
  )(m, s, u)
