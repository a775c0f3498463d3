"""Causal (grouped-query) attention in Pallas: forward and backward, decode = prefill.

Layouts: ``q [B, Tq, Hq, D]``, ``k, v [B, S, Hkv, D]``, ``q_positions [B, Tq]``,
``kv_lengths [B]`` (int32). Query ``i`` of row ``b`` at position ``p`` sees key
``j`` iff ``j <= p`` and ``j < kv_lengths[b]``; ``last = min(p, kv_len - 1)`` is
the last key it sees (``last < 0``: none).

Forward (program = one ``BLOCK_Q`` block of queries of one (row, query head)):
walk key tiles ``[t * KEY_TILE, (t + 1) * KEY_TILE)`` for ``t = 0, 1, ...`` in
ascending order up to the block's largest ``last``, with an fp32 online softmax
in base 2 (``s = log2(e) * scale * q . k``):

    m' = max(m, max_j s_j),  a = 2^(m - m'),  p_j = 2^(s_j - m'),
    l' = a l + sum_j p_j,    acc' = a acc + p @ v_tile,   out = acc / l.

A row whose ``last`` lies before a tile's first key keeps ``(m, l, acc)``
unchanged (a select, not an update by zero): for that row the tile is skipped
exactly, so walking extra tiles for other rows of the block never touches its
bits. Masked keys give ``p = 0``; K/V past the block's largest ``last`` (and
past ``kv_len``) are masked loads (0), so garbage in a cache can never leak
(not even a NaN through ``0 * NaN``). Output zeros are written as +0.

The invariance contract (decode = prefill, batch, padding, chunking, mode):
``BLOCK_Q``, ``KEY_TILE``, the padded head dim and the Triton warps/stages are
fixed for every call of a dtype, so every query row goes through the same tile
instructions whatever ``B``, ``Tq``, ``S``, the block's other rows or the
number of tiles walked. A row's bits depend only on ``q[b, i, h]``,
``k/v[b, :last + 1, h // group]``, the dtype and ``scale``.

Backward (flash-attention style, from the saved base-2 logsumexp; no atomics,
so run-to-run deterministic): ``dq`` per query block looping over key tiles;
``dk, dv`` per key block looping over the group's query heads and the query
blocks ``[lo, hi)`` that can see it (:func:`dkv_walks`: from the first to the last
block whose largest ``last`` reaches the key block, computed outside the kernel from
the positions; inside, a block that sees none of its keys is still skipped by a
``cond``, for positions that are not increasing). Long walks are cut into ranges of
``dkv_split_rows`` rows, one program each; the float32 partials of the ranges a key
block uses are summed in range order by a second kernel (unused ranges are neither
written nor read). ``delta = rowsum(dO * O)`` is computed by the dq kernel (which loads
each row's ``dO`` anyway) and read by the dK/dV kernel.
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
from jaxrl_kernels.pallas import fixed_order
from jaxrl_kernels.pallas._common import LOG2E, cdiv, dot_precision, triton_compiler_params

# The contract's forward constants (with the head-dim padding): queries per
# program, the key tile walked in ascending order from key 0, and the compiler
# parameters of that instruction sequence. Decode pads its single query up to
# BLOCK_Q rows so that it runs the very instructions of a prefill block.
BLOCK_Q = contract.ATTENTION_TRITON_BLOCK_Q
KEY_TILE = contract.ATTENTION_TRITON_KEY_TILE
FWD_NUM_WARPS = contract.ATTENTION_TRITON_FWD_NUM_WARPS
FWD_NUM_STAGES = contract.ATTENTION_TRITON_FWD_NUM_STAGES

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Free tiling knobs of the backward kernels (gradients are deterministic for
  any value; they are not part of the forward contract).

  Attributes:
    dq_block_q, dq_block_k: query rows per dQ program and its key step.
    dkv_block_q, dkv_block_k: query step and key rows per dK/dV program.
    dkv_split_rows: query rows (of all the group's heads) per dK/dV program: a key
      block's rows are cut into ``ceil(G * Tq / dkv_split_rows)`` ranges (the Mosaic
      kernel: ranges of ``max(1, dkv_split_rows // (64 G))`` query blocks of each head),
      one program each, whose float32 partials are summed in range order (more programs
      for the long causal walks of few heads; the order is fixed by the shape).
    num_warps, num_stages: Triton compiler parameters.

  Without a config the kernels take :func:`default_backward_config` of the inputs' dtype and
  head dim.
  """

  dq_block_q: int = 64
  dq_block_k: int = 32
  dkv_block_q: int = 64
  dkv_block_k: int = 64
  dkv_split_rows: int = 2048
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("dq_block_q", "dq_block_k", "dkv_block_q", "dkv_block_k"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"BackwardConfig: {name} must be a power of two >= 16, got {v!r}")
    if (not isinstance(self.dkv_split_rows, int) or self.dkv_split_rows < self.dkv_block_q
        or self.dkv_split_rows % self.dkv_block_q):
      raise ValueError(f"BackwardConfig: dkv_split_rows must be a positive multiple of "
                       f"dkv_block_q = {self.dkv_block_q}, got {self.dkv_split_rows!r}")


def default_backward_config(dtype, d: int) -> BackwardConfig:
  """The backward's tiles when the caller gives none: for 16-bit inputs with head dims
  padded to 64 (the models' D = 64), a 64-key dQ step and 3 pipeline stages (fewer
  registers per step at the training step's document slots); at D = 128, dK/dV ranges of
  4096 rows (fewer ranges to walk and merge than with 2048;
  ``benchmarks/results/attention.md``); the
  general default otherwise. Free knobs: they change no forward bit, and the gradients are
  deterministic for either."""
  if jnp.dtype(dtype).itemsize == 2 and padded_head_dim(d) == 64:
    return BackwardConfig(dq_block_k=64, num_stages=3)
  if jnp.dtype(dtype).itemsize == 2 and d == 128:
    return BackwardConfig(dkv_split_rows=4096)
  return BackwardConfig()


def padded_head_dim(d: int) -> int:
  """Triton tiles are powers of two: D is padded (masked loads) to the next one."""
  return max(16, pl.next_power_of_2(d))


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
  """``a @ b`` (optionally transposed operands) with float32 accumulation."""
  dims = ((0,) if trans_a else (1,), (1,) if trans_b else (0,))
  return lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _last_visible(pos_ref, b, row0, block, kv_len, *, tq):
  """``last = min(p, kv_len - 1)`` of ``block`` query rows from ``row0`` (-1 past Tq)."""
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block,), 0)
  row_ok = rows < tq
  pos = pltriton.load(pos_ref.at[b, pl.ds(row0, block)], mask=row_ok, other=-1)
  return jnp.maximum(jnp.minimum(pos, kv_len - 1), -1), row_ok


def _load_rows(ref, b, row0, block, head, row_ok, d_ok, dp):
  """``ref[b, row0:row0 + block, head, :dp]`` with masked rows / columns as 0."""
  return pltriton.load(ref.at[b, pl.ds(row0, block), head, pl.ds(0, dp)],
                       mask=row_ok[:, None] & d_ok[None, :], other=0)


def _scores(q, k, last, key0, block_k, *, scale2, precision):
  """Base-2 scores ``[rows, block_k]`` of one tile and its visibility mask.

  The one definition of the scores shared by the forward and both backward
  kernels: ``s = (q @ k^T) * log2(e) * scale``, ``-inf`` where key ``j`` is
  not visible to the row (``j > last``).
  """
  keys = key0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
  visible = keys[None, :] <= last[:, None]
  s = _dot(q, k, precision, trans_b=True) * jnp.float32(scale2)
  return jnp.where(visible, s, -jnp.inf), visible


def _kv_tile_mask(key0, block_k, bound):
  """Keys of the tile below ``bound`` (exclusive); the rest load as 0."""
  return key0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < bound


def _fwd_kernel(q_ref, k_ref, v_ref, pos_ref, kvl_ref, o_ref, lse_ref, *, tq, s_len, d, hq,
                group, scale2, precision):
  dp = padded_head_dim(d)
  qb = pl.program_id(0)
  b = pl.program_id(1) // hq
  h = pl.program_id(1) % hq
  hk = h // group
  row0 = qb * BLOCK_Q
  d_ok = lax.broadcasted_iota(jnp.int32, (dp,), 0) < d
  kv_len = jnp.minimum(kvl_ref[b], s_len)
  last, row_ok = _last_visible(pos_ref, b, row0, BLOCK_Q, kv_len, tq=tq)
  q = _load_rows(q_ref, b, row0, BLOCK_Q, h, row_ok, d_ok, dp)
  block_last = jnp.max(last)
  n_tiles = (block_last + KEY_TILE) // KEY_TILE  # 0 when no row sees a key

  def body(t, carry):
    m, den, acc = carry
    key0 = t * KEY_TILE
    kv_ok = _kv_tile_mask(key0, KEY_TILE, block_last + 1)
    k = _load_rows(k_ref, b, key0, KEY_TILE, hk, kv_ok, d_ok, dp)
    v = _load_rows(v_ref, b, key0, KEY_TILE, hk, kv_ok, d_ok, dp)
    s, visible = _scores(q, k, last, key0, KEY_TILE, scale2=scale2, precision=precision)
    active = last >= key0  # the row sees at least one key of this tile
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(active, m_new, 0.0)  # no (-inf) - (-inf) in skipped rows
    alpha = jnp.exp2(m - m_use)
    p = jnp.where(visible, jnp.exp2(s - m_use[:, None]), 0.0)
    den_new = alpha * den + jnp.sum(p, axis=1)
    acc_new = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, precision)
    # Rows that see nothing here keep their state: the tile is skipped exactly.
    return (jnp.where(active, m_new, m), jnp.where(active, den_new, den),
            jnp.where(active[:, None], acc_new, acc))

  init = (jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK_Q,), jnp.float32),
          jnp.zeros((BLOCK_Q, dp), jnp.float32))
  # Ascending key tiles from key 0: the reduction order of the contract.
  m, den, acc = lax.fori_loop(0, n_tiles, body, init)
  # Whether a row sees a key comes from its position (``last``), never from ``den``: a
  # NaN or inf score makes ``den`` NaN, and the row's output and lse must be NaN too.
  seen = last >= 0
  out = acc / jnp.where(seen, den, 1.0)[:, None]
  # A row that sees no key gives 0; zeros are written as +0 (a masked key adds
  # a signed zero whose sign could differ between a cache and a sequence).
  out = jnp.where(seen[:, None] & (out != 0), out, 0.0)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, den, 1.0)), 0.0)
  pltriton.store(o_ref.at[b, pl.ds(row0, BLOCK_Q), h, pl.ds(0, dp)], out.astype(o_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])
  pltriton.store(lse_ref.at[b, h, pl.ds(row0, BLOCK_Q)], lse, mask=row_ok)


def check_operands(fn: str, q, k, v, q_positions, kv_lengths, rows=None, vectors=None):
  """Refuses by name an operand whose shape the attention kernels would misread (they
  index rows by the shapes of ``q`` and ``k``: a mismatch reads other rows rather than
  failing), and query heads that are not a multiple of the kv heads. ``rows``: name ->
  shape of arrays shaped like ``q``; ``vectors``: name -> shape of ``[B, Hq, Tq]`` arrays."""
  rows, vectors = rows or {}, vectors or {}
  if q.ndim != 4:
    raise ValueError(f"{fn}: q must be [B, Tq, Hq, D], got shape {tuple(q.shape)}")
  bsz, tq, hq, d = q.shape
  if k.ndim != 4 or k.shape[2] == 0:
    raise ValueError(f"{fn}: k must be [B, S, Hkv, D], got shape {tuple(k.shape)}")
  if hq % k.shape[2]:
    raise ValueError(f"{fn}: query heads {hq} are not a multiple of kv heads {k.shape[2]}")
  want = {"k": (bsz, k.shape[1], k.shape[2], d), "v": k.shape, "q_positions": (bsz, tq),
          "kv_lengths": (bsz,), **{name: q.shape for name in rows},
          **{name: (bsz, hq, tq) for name in vectors}}
  got = {"k": k.shape, "v": v.shape, "q_positions": q_positions.shape,
         "kv_lengths": kv_lengths.shape, **rows, **vectors}
  for name, shape in want.items():
    if tuple(got[name]) != tuple(shape):
      raise ValueError(f"{fn}: {name} has shape {tuple(got[name])}, expected {tuple(shape)} "
                       f"(q {tuple(q.shape)}, k {tuple(k.shape)})")


def forward(q, k, v, q_positions, kv_lengths, *, scale: float, interpret: bool):
  """Attention output ``[B, Tq, Hq, D]`` (q's dtype) and base-2 logsumexp ``[B, Hq, Tq]``.

  ``lse2 = max_j s_j + log2 sum_j 2^(s_j - max)`` with ``s = log2(e) * scale * q . k``
  over visible keys (0 for a row that sees none).
  """
  check_operands("causal_attention forward", q, k, v, q_positions, kv_lengths)
  bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  kernel = functools.partial(_fwd_kernel, tq=tq, s_len=s_len, d=d, hq=hq, group=hq // hkv,
                             scale2=scale * LOG2E, precision=dot_precision(q.dtype, interpret))
  return pl.pallas_call(
      kernel,
      grid=(cdiv(tq, BLOCK_Q), bsz * hq),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((bsz, hq, tq), jnp.float32)),
      interpret=interpret,
      name="causal_attention_fwd",
      **triton_compiler_params(FWD_NUM_WARPS, FWD_NUM_STAGES, interpret),
  )(q, k, v, q_positions, kv_lengths)


def _probs(q, k, last, lse, key0, block_k, *, scale2, precision):
  """Softmax probabilities ``[rows, block_k]`` of a tile, recomputed from lse2."""
  s, visible = _scores(q, k, last, key0, block_k, scale2=scale2, precision=precision)
  return jnp.where(visible, jnp.exp2(s - lse[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, pos_ref, kvl_ref, do_ref, o_ref, lse_ref, dq_ref,
               delta_ref, *, tq, s_len, d, hq, group, scale, precision, block_q, block_k):
  dp = padded_head_dim(d)
  qb = pl.program_id(0)
  b = pl.program_id(1) // hq
  h = pl.program_id(1) % hq
  hk = h // group
  row0 = qb * block_q
  d_ok = lax.broadcasted_iota(jnp.int32, (dp,), 0) < d
  kv_len = jnp.minimum(kvl_ref[b], s_len)
  last, row_ok = _last_visible(pos_ref, b, row0, block_q, kv_len, tq=tq)
  # A row that sees no key (padding) loads as zeros: its q, dO and delta may
  # hold NaN, and 0 * NaN in the products below would reach other rows' dK/dV.
  sees = row_ok & (last >= 0)
  q = _load_rows(q_ref, b, row0, block_q, h, sees, d_ok, dp)
  do = _load_rows(do_ref, b, row0, block_q, h, sees, d_ok, dp)
  lse = pltriton.load(lse_ref.at[b, h, pl.ds(row0, block_q)], mask=sees, other=0)
  # delta = rowsum(dO * O), here for the dK/dV kernel too: one reduction per row whose
  # order is the tile layout's, the same for every row of every block (0 for padding rows).
  o = _load_rows(o_ref, b, row0, block_q, h, sees, d_ok, dp)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1)
  pltriton.store(delta_ref.at[b, h, pl.ds(row0, block_q)], delta, mask=row_ok)
  block_last = jnp.max(last)

  def body(t, dq):
    key0 = t * block_k
    kv_ok = _kv_tile_mask(key0, block_k, block_last + 1)
    k = _load_rows(k_ref, b, key0, block_k, hk, kv_ok, d_ok, dp)
    v = _load_rows(v_ref, b, key0, block_k, hk, kv_ok, d_ok, dp)
    p = _probs(q, k, last, lse, key0, block_k, scale2=scale * LOG2E, precision=precision)
    ds = p * (_dot(do, v, precision, trans_b=True) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, precision)

  dq = lax.fori_loop(0, (block_last + block_k) // block_k, body,
                     jnp.zeros((block_q, dp), jnp.float32))
  pltriton.store(dq_ref.at[b, pl.ds(row0, block_q), h, pl.ds(0, dp)],
                 (dq * jnp.float32(scale)).astype(dq_ref.dtype),
                 mask=row_ok[:, None] & d_ok[None, :])


def _dkv_kernel(q_ref, k_ref, v_ref, pos_ref, kvl_ref, walk_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, tq, s_len, d, hkv, group, scale, precision, block_q,
                block_k, split_blocks, n_split):
  dp = padded_head_dim(d)
  kb = pl.program_id(0)
  b = pl.program_id(1) // hkv
  hk = pl.program_id(1) % hkv
  split = pl.program_id(2)
  key0 = kb * block_k
  d_ok = lax.broadcasted_iota(jnp.int32, (dp,), 0) < d
  kv_len = jnp.minimum(kvl_ref[b], s_len)
  key_ok = _kv_tile_mask(key0, block_k, kv_len)
  k = _load_rows(k_ref, b, key0, block_k, hk, key_ok, d_ok, dp)
  v = _load_rows(v_ref, b, key0, block_k, hk, key_ok, d_ok, dp)
  # The query blocks [lo, hi) that can see this key block (dkv_walks), for each head of
  # the group: the walk i = g * span + (qb - lo).
  lo = walk_ref[b, kb, 0]
  span = jnp.maximum(walk_ref[b, kb, 1] - lo, 1)
  total = group * (walk_ref[b, kb, 1] - lo)

  def q_block(i, carry):
    # lax.div/rem, not // and %: jnp's floor-mod inside a loop body failed the
    # Triton lowering on jax 0.11.2 (an i32 % i1 operand mismatch).
    g, qb = lax.div(i, span), lo + lax.rem(i, span)
    h = hk * group + g
    row0 = qb * block_q
    last, row_ok = _last_visible(pos_ref, b, row0, block_q, kv_len, tq=tq)
    sees = row_ok & (last >= 0)  # padding rows load as zeros (see _dq_kernel)

    def update(carry):
      dk, dv = carry
      q = _load_rows(q_ref, b, row0, block_q, h, sees, d_ok, dp)
      do = _load_rows(do_ref, b, row0, block_q, h, sees, d_ok, dp)
      lse = pltriton.load(lse_ref.at[b, h, pl.ds(row0, block_q)], mask=sees, other=0)
      delta = pltriton.load(delta_ref.at[b, h, pl.ds(row0, block_q)], mask=sees, other=0)
      p = _probs(q, k, last, lse, key0, block_k, scale2=scale * LOG2E, precision=precision)
      dv = dv + _dot(p.astype(do.dtype), do, precision, trans_a=True)
      ds = p * (_dot(do, v, precision, trans_b=True) - delta[:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, precision, trans_a=True)
      return dk, dv

    # A block inside [lo, hi) that sees none of these keys (positions that are not
    # increasing) contributes nothing: skip it.
    return lax.cond(jnp.max(last) >= key0, update, lambda c: c, carry)

  zeros = jnp.zeros((block_k, dp), jnp.float32)
  # This program's range of the walk.
  first = split * split_blocks
  dk, dv = lax.fori_loop(first, jnp.minimum(first + split_blocks, total), q_block,
                         (zeros, zeros))
  store_ok = _kv_tile_mask(key0, block_k, s_len)[:, None] & d_ok[None, :]
  if n_split == 1:
    pltriton.store(dk_ref.at[b, pl.ds(key0, block_k), hk, pl.ds(0, dp)],
                   (dk * jnp.float32(scale)).astype(dk_ref.dtype), mask=store_ok)
    pltriton.store(dv_ref.at[b, pl.ds(key0, block_k), hk, pl.ds(0, dp)],
                   dv.astype(dv_ref.dtype), mask=store_ok)
  else:
    # float32 partials [n_split, B, S, Hkv, D]; only the ranges the walk uses are
    # written, and only those are read (by _dkv_sum_kernel).
    store_ok = store_ok & (first < total)
    pltriton.store(dk_ref.at[split, b, pl.ds(key0, block_k), hk, pl.ds(0, dp)], dk,
                   mask=store_ok)
    pltriton.store(dv_ref.at[split, b, pl.ds(key0, block_k), hk, pl.ds(0, dp)], dv,
                   mask=store_ok)


def _sum_ranges_kernel(ranges_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref, *, s_len, d,
                       hkv, scale, block_k):
  """``dk = scale * sum_r dk_r``, ``dv = sum_r dv_r`` over the ranges ``r`` in
  ``[ranges[b, kb, 0], ranges[b, kb, 1])`` of key block ``kb``, in range order (one fixed
  chain of float32 adds per element); no other range is read."""
  dp = padded_head_dim(d)
  kb = pl.program_id(0)
  b = pl.program_id(1) // hkv
  hk = pl.program_id(1) % hkv
  key0 = kb * block_k
  d_ok = lax.broadcasted_iota(jnp.int32, (dp,), 0) < d
  ok = _kv_tile_mask(key0, block_k, s_len)[:, None] & d_ok[None, :]

  def add(r, carry):
    dk, dv = carry
    idx = (r, b, pl.ds(key0, block_k), hk, pl.ds(0, dp))
    return (dk + pltriton.load(dk_part_ref.at[idx], mask=ok, other=0),
            dv + pltriton.load(dv_part_ref.at[idx], mask=ok, other=0))

  zeros = jnp.zeros((block_k, dp), jnp.float32)
  dk, dv = lax.fori_loop(ranges_ref[b, kb, 0], ranges_ref[b, kb, 1], add, (zeros, zeros))
  pltriton.store(dk_ref.at[b, pl.ds(key0, block_k), hk, pl.ds(0, dp)],
                 (dk * jnp.float32(scale)).astype(dk_ref.dtype), mask=ok)
  pltriton.store(dv_ref.at[b, pl.ds(key0, block_k), hk, pl.ds(0, dp)],
                 dv.astype(dv_ref.dtype), mask=ok)


def sum_ranges(dk_part, dv_part, ranges, *, s_len: int, block_k: int, scale: float, dtype,
               interpret: bool):
  """``(scale * sum dk_r, sum dv_r)`` ``[B, s_len, H, D]`` in ``dtype``: the float32 partials
  ``[n_ranges, B, >= s_len, H, D]`` of a dK/dV kernel summed over each ``block_k`` keys'
  used ranges ``[ranges[b, kb, 0], ranges[b, kb, 1])`` (``ranges [B, cdiv(s_len,
  block_k), 2]``) in range order. Ranges outside them are never read (they may hold
  anything); a key block with an empty range gets zeros."""
  _, bsz, _, h, d = dk_part.shape
  out = jax.ShapeDtypeStruct((bsz, s_len, h, d), dtype)
  return pl.pallas_call(
      functools.partial(_sum_ranges_kernel, s_len=s_len, d=d, hkv=h, scale=scale,
                        block_k=block_k),
      grid=(cdiv(s_len, block_k), bsz * h),
      out_shape=(out, out),
      interpret=interpret,
      name="causal_attention_dkv_sum",
      **triton_compiler_params(4, 1, interpret),
  )(ranges, dk_part, dv_part)


def dkv_walks(q_positions, kv_lengths, *, tq: int, s_len: int, block_q: int, block_k: int):
  """``[B, n_key_blocks, 2]`` int32 ``(lo, hi)``: the query blocks ``[lo, hi)`` (of
  ``block_q`` rows) from the first to the last one whose largest ``last`` reaches key
  block ``kb`` (keys ``[kb * block_k, (kb + 1) * block_k)``); ``(0, 0)`` when none does
  (keys past ``kv_lengths``, or no query sees them). Causal rows in slots of one document
  each walk only the blocks at or after the key block and before the document's end."""
  bsz = q_positions.shape[0]
  n_qb, n_kb = cdiv(tq, block_q), cdiv(s_len, block_k)
  kv_len = jnp.minimum(kv_lengths, s_len)
  last = jnp.maximum(jnp.minimum(q_positions, kv_len[:, None] - 1), -1)
  last = jnp.pad(last, ((0, 0), (0, n_qb * block_q - tq)), constant_values=-1)
  block_last = last.reshape(bsz, n_qb, block_q).max(axis=2)
  key0 = jnp.arange(n_kb, dtype=jnp.int32) * block_k
  sees = block_last[:, None, :] >= key0[None, :, None]  # [B, n_kb, n_qb]
  lo = jnp.argmax(sees, axis=2)
  hi = n_qb - jnp.argmax(sees[:, :, ::-1], axis=2)
  any_ = jnp.any(sees, axis=2)
  return jnp.stack([jnp.where(any_, lo, 0), jnp.where(any_, hi, 0)], axis=2).astype(jnp.int32)


def fold_groups(x: jax.Array, group: int) -> jax.Array:
  """``[B, T, Hkv * G, ...]`` as ``[B, T * G, Hkv, ...]`` (a transposed copy): row
  ``t * G + g`` of kv head ``h`` is query ``t`` of query head ``h * G + g``. The layout in
  which the query heads of a group are rows of one head (``causal_attention``'s GQA fold)."""
  bsz, t, hq = x.shape[:3]
  x = x.reshape(bsz, t, hq // group, group, *x.shape[3:])
  return jnp.swapaxes(x, 2, 3).reshape(bsz, t * group, hq // group, *x.shape[4:])


def unfold_groups(x: jax.Array, group: int) -> jax.Array:
  """The inverse of :func:`fold_groups`: ``[B, T * G, Hkv, ...]`` -> ``[B, T, Hkv * G, ...]``."""
  bsz, tg, hkv = x.shape[:3]
  x = x.reshape(bsz, tg // group, group, hkv, *x.shape[3:])
  return jnp.swapaxes(x, 2, 3).reshape(bsz, tg // group, hkv * group, *x.shape[4:])


def delta_rows(out, d_out):
  """``delta = rowsum(dO * O)`` ``[B, Hq, Tq]`` in float32, the backward's per-row term, in
  XLA (the dq kernels, Triton's and Mosaic's, compute their own for the dK/dV kernel; this
  feeds a dK/dV kernel on its own, as its tests do).

  Each row's products (exact in float32 for 16-bit inputs) are summed in one fixed order
  (``pallas.fixed_order.reduce_rows``: elementwise adds XLA cannot reassociate), so a row's
  bits depend on its own ``D`` values only. XLA's own row reduction picks its order by the
  shape: the same rows in another layout (the GQA fold) gave other bits on Hopper, and
  with them other ``dq`` bits.
  """
  bsz, tq, hq, d = out.shape
  prod = d_out.astype(jnp.float32) * out.astype(jnp.float32)
  rows = fixed_order.reduce_rows(prod.reshape(bsz * tq * hq, d), op="sum",
                                 lanes=contract.REDUCE_LANES, out_dtype=jnp.float32)
  return jnp.swapaxes(rows.reshape(bsz, tq, hq), 1, 2)


def backward_dq(q, k, v, q_positions, kv_lengths, out, d_out, lse, *, scale: float,
                interpret: bool, config: BackwardConfig | None = None):
  """``(dq, delta)``: ``dQ = scale dS K`` (q's dtype) from the forward's ``out`` and ``lse``
  and ``d_out`` (q's dtype), and the ``delta = rowsum(dO * O)`` ``[B, Hq, Tq]`` float32 it
  computed on the way (0 for rows that see no key), for the dK/dV kernel."""
  check_operands("backward_dq", q, k, v, q_positions, kv_lengths,
                 {"out": out.shape, "d_out": d_out.shape}, {"lse": lse.shape})
  cfg = config or default_backward_config(q.dtype, q.shape[3])
  bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  return pl.pallas_call(
      functools.partial(_dq_kernel, hq=hq, block_q=cfg.dq_block_q, block_k=cfg.dq_block_k,
                        tq=tq, s_len=s_len, d=d, group=hq // hkv, scale=scale,
                        precision=dot_precision(q.dtype, interpret)),
      grid=(cdiv(tq, cfg.dq_block_q), bsz * hq),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((bsz, hq, tq), jnp.float32)),
      interpret=interpret,
      name="causal_attention_dq",
      **triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(q, k, v, q_positions, kv_lengths, d_out, out, lse)


def backward(q, k, v, q_positions, kv_lengths, out, lse, d_out, *, scale: float,
             interpret: bool, config: BackwardConfig | None = None,
             every_row_sees_a_key: bool = False):
  """``(dq, dk, dv)`` in the input dtypes, from the forward's ``out`` and ``lse``.

  ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale dS K``,
  ``dK = scale dS^T Q`` (summed over the query heads of a kv head), ``dV = P^T dO``.
  ``every_row_sees_a_key`` (``AttentionBackend``'s hint) changes nothing here: the
  kernels' loads mask padding rows themselves, at no extra pass.
  """
  check_operands("backward", q, k, v, q_positions, kv_lengths,
                 {"out": out.shape, "d_out": d_out.shape}, {"lse": lse.shape})
  cfg = config or default_backward_config(q.dtype, q.shape[3])
  bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  d_out = d_out.astype(q.dtype)
  dq, delta = backward_dq(q, k, v, q_positions, kv_lengths, out, d_out, lse, scale=scale,
                          interpret=interpret, config=cfg)
  precision = dot_precision(q.dtype, interpret)
  walks = dkv_walks(q_positions, kv_lengths, tq=tq, s_len=s_len, block_q=cfg.dkv_block_q,
                    block_k=cfg.dkv_block_k)
  split_blocks = cfg.dkv_split_rows // cfg.dkv_block_q
  n_split = cdiv(group * cdiv(tq, cfg.dkv_block_q), split_blocks)
  if n_split == 1:
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
  else:
    out_shape = 2 * (jax.ShapeDtypeStruct((n_split, *k.shape), jnp.float32),)
  grid = (cdiv(s_len, cfg.dkv_block_k), bsz * hkv)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, tq=tq, s_len=s_len, d=d, hkv=hkv, group=group, scale=scale,
                        precision=precision, block_q=cfg.dkv_block_q, block_k=cfg.dkv_block_k,
                        split_blocks=split_blocks, n_split=n_split),
      grid=(*grid, n_split),
      out_shape=out_shape,
      interpret=interpret,
      name="causal_attention_dkv",
      **triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
  )(q, k, v, q_positions, kv_lengths, walks, d_out, lse, delta)
  if n_split > 1:
    # The ranges program (kb, ., r) wrote: r < cdiv(group * (hi - lo), split_blocks).
    used = (group * (walks[..., 1] - walks[..., 0]) + split_blocks - 1) // split_blocks
    ranges = jnp.stack([jnp.zeros_like(used), used], axis=-1)
    dk, dv = sum_ranges(dk, dv, ranges, s_len=s_len, block_k=cfg.dkv_block_k, scale=scale,
                        dtype=k.dtype, interpret=interpret)
  return dq, dk, dv
