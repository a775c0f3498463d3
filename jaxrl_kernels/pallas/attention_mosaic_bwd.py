"""The attention backward for Hopper in Pallas Mosaic GPU (TMA + wgmma): dK/dV and dQ.

Semantics and residuals are those of ``attention_triton.backward`` (``lse`` the
forward's base-2 logsumexp, ``delta = rowsum(dO * O)``). Gradients are run-to-run
deterministic (no atomics; fixed orders), not part of the forward's invariance
contract. dQ (:func:`dq`, run first): the forward's structure (query rows per compute
warpgroup, K/V tiles streamed from key 0; see its docstring); it also writes ``delta`` for
the dK/dV kernel.

dK/dV kernel (:func:`dkv`): a CTA holds ``wgs * BWD_BLOCK_K`` keys of one (row, kv
head) (``BWD_BLOCK_K = 64`` per compute warpgroup, the wgmma M) and walks query
blocks of ``BWD_BLOCK_Q = 64`` rows in ascending order; a memory warpgroup streams
each block's ``Q``, ``dO`` tiles and ``lse``, ``delta``, ``last`` vectors into a
``STAGES``-deep ring. Per block, each compute warpgroup (keys on the rows, queries on
the columns):

    S^T = K Q^T,  P^T = 2^(scale2 S^T - lse) where key <= last (else 0),
    dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T (dP^T - delta) where visible (else 0),
    dK += dS^T Q

with ``P^T`` and ``dS^T`` cast to the input dtype in registers as the wgmma lhs.
The walk runs from the first to the last query block whose largest ``last``
reaches the CTA's first key (``attention_triton.dkv_walks``, in XLA from the
positions; blocks outside see none of the CTA's keys), each block once per query head
of the kv head's group (heads inner), and is cut into ranges of ``split_rows`` query rows
of all the group's heads (``max(1, split_rows // (BWD_BLOCK_Q * G))`` blocks of each
head), one CTA each; the ranges that meet the walk store
float32 partials, summed in range order by ``attention_triton.sum_ranges`` (a
fixed chain of adds; the others are neither written nor read). With a single range
the kernel stores the gradients itself. Blocks in the walk
that see none of a warpgroup's keys (non-monotone positions) add exact zeros: every
masked term is a select.

Garbage: ``Q`` and ``dO`` rows of queries that see no key (padding; position -1)
are zeroed before the kernel, since ``0 * NaN`` inside a wgmma would reach every
key's ``dK``/``dV`` (a pass that ``every_row_sees_a_key`` skips: with
``causal_attention``'s default positions no row is padding); keys past ``kv_len`` only
reach masked (selected) terms of their own rows, and rows past ``S`` are TMA zero-fill.

Supported: bf16 / fp16, ``D`` in ``HEAD_DIMS``, ``Hq`` a multiple of ``Hkv`` (grouped
heads as they are: a dQ CTA reads its query head's kv head; a dK/dV CTA walks each query
block once per head of its group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels.pallas import attention_mosaic, attention_triton
from jaxrl_kernels.pallas._common import LOG2E, cdiv, round_up, smem_load, smem_transforms

# Free knobs of the backward (gradients are not part of the forward's contract): keys per
# dK/dV compute warpgroup (the wgmma M) and query rows per step (per dQ warpgroup).
BWD_BLOCK_K = 64
BWD_BLOCK_Q = 64
NUM_COMPUTE_WGS = 2
# Free knob: depth of the Q/dO ring (no bit depends on it).
STAGES = 2
# Head dims whose backward runs these kernels; others run the Triton backward (a free
# choice: gradients are deterministic either way). At D = 128 these kernels take less time
# than the Triton backward; at D = 64 with grouped heads at the training step's document
# slots (Qwen2.5-0.5B, Llama-3.2-1B) they take more, most of it in this file's dQ kernel
# (numbers: benchmarks/results/attention.md).
BACKWARD_HEAD_DIMS = (128,)


def _kernel(q_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref, last_ref, qstart_ref, qend_ref,
            dk_ref, dv_ref, smem, loaded, kv_loaded, free, *, n_qb, split_blocks, n_split, d,
            scale, scale2, wgs, direct, group):
  q_smem, do_smem, lse_smem, delta_smem, last_smem, k_smem2, v_smem2, out_smem2 = smem
  q_loaded, do_loaded, lse_loaded, delta_loaded, last_loaded = loaded
  k_loaded, v_loaded = kv_loaded
  dtype = q_ref.dtype
  b = lax.axis_index("batch")
  hs = lax.axis_index("heads")
  hk = lax.div(hs, jnp.int32(n_split))
  split = lax.rem(hs, jnp.int32(n_split))
  kc = lax.axis_index("kv_seq")
  wg = lax.axis_index("wg")
  # This CTA's query blocks: its range of the walk, from the first to the last block
  # that sees its keys.
  first = jnp.maximum(split * split_blocks, qstart_ref[b, kc])
  end = jnp.minimum(jnp.minimum((split + 1) * split_blocks, n_qb), qend_ref[b, kc])
  # Each block once per query head of the kv head's group (the heads inner).
  n_steps = jnp.maximum(end - first, 0) * group

  @pl.when(wg < wgs)
  def _compute_wg():
    plgpu.set_max_registers(232, action="increase")
    k_smem, v_smem, out_smem = k_smem2.at[wg], v_smem2.at[wg], out_smem2.at[wg]
    key0 = kc * (wgs * BWD_BLOCK_K) + wg * BWD_BLOCK_K
    window = (b, pl.ds(key0, BWD_BLOCK_K), hk)
    plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem, k_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem, v_loaded.at[wg])
    plgpu.barrier_wait(k_loaded.at[wg])
    plgpu.barrier_wait(v_loaded.at[wg])
    shape = (BWD_BLOCK_K, BWD_BLOCK_Q)
    col = plgpu.Layout.WGMMA.reduce(0)  # a [BWD_BLOCK_Q] vector along the columns
    keys = key0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    zeros = plgpu.layout_cast(jnp.full((BWD_BLOCK_K, d), 0, jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry):
      dk, dv = carry
      slot = lax.rem(i, jnp.int32(STAGES))
      plgpu.barrier_wait(q_loaded.at[slot])

      def st_scope(acc_ref):
        plgpu.wgmma(acc_ref, k_smem, q_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      s_t = pl.run_scoped(st_scope, plgpu.ACC(shape, jnp.float32))
      plgpu.barrier_wait(last_loaded.at[slot])
      plgpu.barrier_wait(lse_loaded.at[slot])
      last = smem_load(last_smem.at[slot], layout=col)
      lse = smem_load(lse_smem.at[slot], layout=col)
      visible = keys <= lax.broadcast_in_dim(last, shape, [1])
      p_t = jnp.where(visible, jnp.exp2(s_t * scale2 - lax.broadcast_in_dim(lse, shape, [1])),
                      0.0)
      plgpu.barrier_wait(do_loaded.at[slot])

      def dv_dp(refs):
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, p_t.astype(dtype), do_smem.at[slot])
        plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))

      zero_t = plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)
      dv, dp_t = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zero_t)))
      plgpu.barrier_wait(delta_loaded.at[slot])
      delta = smem_load(delta_smem.at[slot], layout=col)
      ds_t = jnp.where(visible, p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1])), 0.0)

      def dk_update(dk_ref):
        plgpu.wgmma(dk_ref, ds_t.astype(dtype), q_smem.at[slot])

      dk = pl.run_state(dk_update)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(free.at[slot])  # the slot's five buffers are read
      return dk, dv

    # Ascending query blocks: a fixed order of float32 accumulation.
    dk, dv = lax.fori_loop(0, n_steps, step, (zeros, zeros))
    if direct:
      # One range per key CTA: the gradients themselves (zeros outside the walk), as
      # attention_triton.sum_ranges would give from the one partial (up to the sign of a
      # zero: it adds the partial to +0).
      out = (b, pl.ds(key0, BWD_BLOCK_K), hk)
      out_smem[...] = (dk * jnp.float32(scale)).astype(out_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, dk_ref.at[out])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = dv.astype(out_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, dv_ref.at[out])
      plgpu.wait_smem_to_gmem(0)
      return
    out = (split, b, pl.ds(key0, BWD_BLOCK_K), hk)

    # A range outside the walk is neither written nor read (attention_triton.sum_ranges).
    @pl.when(n_steps > 0)
    def _store():
      out_smem[...] = dk
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, dk_ref.at[out])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = dv
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, dv_ref.at[out])
      plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _memory_wg():
    plgpu.set_max_registers(40, action="decrease")

    def issue(i, slot):
      rows = pl.ds((first + lax.div(i, jnp.int32(group))) * BWD_BLOCK_Q, BWD_BLOCK_Q)
      hq = hk * group + lax.rem(i, jnp.int32(group))
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hq], q_smem.at[slot], q_loaded.at[slot])
      plgpu.copy_gmem_to_smem(last_ref.at[b, rows], last_smem.at[slot], last_loaded.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[b, hq, rows], lse_smem.at[slot], lse_loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, hq], do_smem.at[slot], do_loaded.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, hq, rows], delta_smem.at[slot],
                              delta_loaded.at[slot])

    # Loops, not Python unrolls: block starts stay traced values.
    @pl.loop(0, jnp.minimum(n_steps, STAGES))
    def _(i):
      issue(i, i)

    @pl.loop(0, jnp.maximum(n_steps - STAGES, 0))
    def _(i):
      slot = lax.rem(i, jnp.int32(STAGES))
      plgpu.barrier_wait(free.at[slot])
      issue(i + STAGES, slot)


def _dq_kernel(q_ref, do_ref, k_ref, v_ref, lse_ref, o_ref, last_ref, ntiles_ref,
               kvlen_ref, dq_ref, delta_ref, smem, loaded, row_loaded, free, *, d, scale, scale2,
               wgs, group):
  q_smem2, do_smem2, o_smem2, lse_smem2, delta_smem2, last_smem2, k_smem, v_smem = smem
  k_loaded, v_loaded = loaded
  q_loaded, do_loaded, o_loaded, lse_loaded, last_loaded = row_loaded
  dtype = q_ref.dtype
  b = lax.axis_index("batch")
  hq = lax.axis_index("heads")
  hkv = lax.div(hq, jnp.int32(group))  # K and V of the query head's group
  qb = lax.axis_index("q_seq")
  wg = lax.axis_index("wg")
  n_tiles = ntiles_ref[b, qb]  # key tiles up to the one holding the CTA's largest `last`
  kv_len = kvlen_ref[b]

  @pl.when(wg < wgs)
  def _compute_wg():
    plgpu.set_max_registers(232, action="increase")
    q_smem, do_smem, o_smem = q_smem2.at[wg], do_smem2.at[wg], o_smem2.at[wg]
    row0 = qb * (wgs * BWD_BLOCK_Q) + wg * BWD_BLOCK_Q
    rows = (b, pl.ds(row0, BWD_BLOCK_Q), hq)
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_loaded.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_loaded.at[wg])
    plgpu.copy_gmem_to_smem(o_ref.at[rows], o_smem, o_loaded.at[wg])
    span = pl.ds(row0, BWD_BLOCK_Q)
    plgpu.copy_gmem_to_smem(lse_ref.at[b, hq, span], lse_smem2.at[wg], lse_loaded.at[wg])
    plgpu.copy_gmem_to_smem(last_ref.at[b, span], last_smem2.at[wg], last_loaded.at[wg])
    plgpu.barrier_wait(lse_loaded.at[wg])
    plgpu.barrier_wait(last_loaded.at[wg])
    row = plgpu.Layout.WGMMA.reduce(1)  # a [BWD_BLOCK_Q] vector along the rows
    lse = smem_load(lse_smem2.at[wg], layout=row)
    last = smem_load(last_smem2.at[wg], layout=row)
    plgpu.barrier_wait(q_loaded.at[wg])
    plgpu.barrier_wait(do_loaded.at[wg])
    plgpu.barrier_wait(o_loaded.at[wg])
    # delta = rowsum(dO * O) (0 where the row sees no key), one in-register row reduction,
    # the same for every row; written out for the dK/dV kernel.
    d_o = smem_load(do_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    o = smem_load(o_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    delta = jnp.where(last >= 0, jnp.sum(d_o * o, axis=1), 0.0)
    delta_smem2.at[wg][...] = delta
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(delta_smem2.at[wg], delta_ref.at[b, hq, span])
    shape = (BWD_BLOCK_Q, BWD_BLOCK_K)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    dq = plgpu.layout_cast(jnp.full((BWD_BLOCK_Q, d), 0, jnp.float32), plgpu.Layout.WGMMA)

    def tile(t, dq):
      slot = lax.rem(t, jnp.int32(STAGES))
      key0 = t * BWD_BLOCK_K
      plgpu.barrier_wait(k_loaded.at[slot])

      @pl.when(key0 + BWD_BLOCK_K > kv_len)
      def _zero_k_tail():
        # The tile holding kv_len: K rows at or past it may be garbage (NaN), and the
        # dS @ K wgmma would compute 0 * NaN. Both warpgroups select them to 0 in place.
        k_tile = k_smem.at[slot][...]
        keys = plgpu.broadcasted_iota(jnp.int32, (BWD_BLOCK_K, d), 0, layout=plgpu.Layout.WGMMA)
        k_smem.at[slot][...] = jnp.where(keys < kv_len - key0, k_tile, jnp.zeros_like(k_tile))
        plgpu.commit_smem()

      def s_scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(s_scope, plgpu.ACC(shape, jnp.float32))
      visible = cols + key0 <= lax.broadcast_in_dim(last, shape, [0])
      p = jnp.where(visible, jnp.exp2(s * scale2 - lax.broadcast_in_dim(lse, shape, [0])), 0.0)
      plgpu.barrier_wait(v_loaded.at[slot])

      def dp_scope(acc_ref):
        plgpu.wgmma(acc_ref, do_smem, v_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      dp = pl.run_scoped(dp_scope, plgpu.ACC(shape, jnp.float32))
      ds = jnp.where(visible, p * (dp - lax.broadcast_in_dim(delta, shape, [0])), 0.0)

      def dq_update(dq_ref):
        plgpu.wgmma(dq_ref, ds.astype(dtype), k_smem.at[slot])

      dq = pl.run_state(dq_update)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(free.at[slot])  # K and V of the slot are read
      return dq

    # Ascending key tiles from key 0: a fixed order of float32 accumulation.
    dq = lax.fori_loop(0, n_tiles, tile, dq)
    q_smem[...] = (dq * jnp.float32(scale)).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)  # and the delta store

  @pl.when(wg == wgs)
  def _memory_wg():
    plgpu.set_max_registers(40, action="decrease")

    def issue(t, slot):
      window = (b, pl.ds(t * BWD_BLOCK_K, BWD_BLOCK_K), hkv)
      plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem.at[slot], k_loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem.at[slot], v_loaded.at[slot])

    @pl.loop(0, jnp.minimum(n_tiles, STAGES))
    def _(t):
      issue(t, t)

    @pl.loop(0, jnp.maximum(n_tiles - STAGES, 0))
    def _(t):
      slot = lax.rem(t, jnp.int32(STAGES))
      plgpu.barrier_wait(free.at[slot])
      issue(t + STAGES, slot)


def dkv(q, k, v, q_positions, kv_lengths, d_out, lse, delta, *, scale: float,
        split_rows: int = 2048, every_row_sees_a_key: bool = False):
  """``(dk, dv)`` in k's and v's dtypes: ``dK = scale dS^T Q``, ``dV = P^T dO``.

  ``q [B, Tq, Hq, D]`` and ``d_out`` (q's dtype), ``k, v [B, S, Hkv, D]`` (``Hq = G *
  Hkv``; query head ``h`` reads kv head ``h // G``), ``lse`` and ``delta`` ``[B, Hq, Tq]``
  float32 (the forward's residual and :func:`dq`'s). A key CTA walks each query block once
  per query head of its group (the heads inner). ``split_rows``: query rows of all the
  group's heads per CTA range (a free knob of the backward; a multiple of ``BWD_BLOCK_Q``):
  ``max(1, split_rows // (BWD_BLOCK_Q * G))`` blocks of each head. When one range holds all
  of a row's query blocks (and k and v share a dtype), the kernel writes ``dk``, ``dv``
  itself; otherwise float32 partials per range, summed in range order.
  ``every_row_sees_a_key=True`` promises no padding rows (``causal_attention``'s default
  positions and lengths): ``q`` and ``d_out`` reach the kernel without the pass that
  zeroes padding rows (a read and write of both; its select is then the identity, so the
  bits are the same).
  """
  return _dkv(q, k, v, q_positions, kv_lengths, d_out, lse, delta, scale=scale,
              split_rows=split_rows, direct=None, every_row_sees_a_key=every_row_sees_a_key)


def _dkv(q, k, v, q_positions, kv_lengths, d_out, lse, delta, *, scale, split_rows, direct,
         every_row_sees_a_key=False):
  """:func:`dkv`, with ``direct`` (the kernel writing the gradients; ``None``: whenever it
  can) a choice for the tests."""
  attention_triton.check_operands("dkv", q, k, v, q_positions, kv_lengths,
                                  {"d_out": d_out.shape}, {"lse": lse.shape, "delta": delta.shape})
  why = attention_mosaic.supported(q.shape[3], q.dtype)
  if why is not None:
    raise ValueError(f"causal_attention(mosaic) backward: {why}")
  if split_rows < BWD_BLOCK_Q or split_rows % BWD_BLOCK_Q:
    raise ValueError(f"dkv: split_rows must be a positive multiple of {BWD_BLOCK_Q}, got "
                     f"{split_rows}")
  bsz, tq, hq, d = q.shape
  s_len, h = k.shape[1], k.shape[2]
  group = hq // h
  wgs = NUM_COMPUTE_WGS
  n_qb = cdiv(tq, BWD_BLOCK_Q)
  tq_pad = n_qb * BWD_BLOCK_Q
  kv_len = jnp.minimum(kv_lengths.astype(jnp.int32), s_len)
  last = jnp.maximum(jnp.minimum(q_positions.astype(jnp.int32), kv_len[:, None] - 1), -1)
  d_out = d_out.astype(q.dtype)
  if not every_row_sees_a_key:
    # Rows that see no key: zeros, not whatever they hold (0 * NaN inside a wgmma).
    sees = (last >= 0)[:, :, None, None]
    q = jnp.where(sees, q, jnp.zeros((), q.dtype))
    d_out = jnp.where(sees, d_out, jnp.zeros((), q.dtype))
  if tq_pad != tq:
    rows = ((0, 0), (0, tq_pad - tq))
    q = jnp.pad(q, (*rows, (0, 0), (0, 0)))
    d_out = jnp.pad(d_out, (*rows, (0, 0), (0, 0)))
    last = jnp.pad(last, rows, constant_values=-1)
    lse = jnp.pad(lse, ((0, 0), *rows))
    delta = jnp.pad(delta, ((0, 0), *rows))
  s_pad = max(wgs * BWD_BLOCK_K, round_up(s_len, 8))
  if s_pad != s_len:
    # As the forward: TMA needs S a multiple of 8 rows and at least one CTA of keys.
    pad = ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  n_kc = cdiv(s_len, wgs * BWD_BLOCK_K)
  # The query blocks [qstart, qend) from the first to the last whose largest `last`
  # reaches each key CTA's first key (int32 only; attention_triton.dkv_walks).
  walks = attention_triton.dkv_walks(q_positions.astype(jnp.int32), kv_len, tq=tq,
                                     s_len=s_len, block_q=BWD_BLOCK_Q,
                                     block_k=wgs * BWD_BLOCK_K)
  qstart, qend = walks[..., 0], walks[..., 1]
  split_blocks = max(1, split_rows // (BWD_BLOCK_Q * group))  # of each head
  n_split = cdiv(n_qb, split_blocks)
  # The ranges a CTA column writes: those meeting [qstart, qend) (none when it is empty).
  ranges = jnp.stack([qstart // split_blocks, (qend + split_blocks - 1) // split_blocks], -1)
  can_direct = n_split == 1 and k.dtype == v.dtype
  if direct is None:
    direct = can_direct
  elif direct and not can_direct:
    raise ValueError(f"dkv: direct stores need one range ({n_split} here) and k, v of one "
                     f"dtype ({k.dtype}, {v.dtype})")

  tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def entry(*refs):
    scratch = (
        plgpu.SMEM((STAGES, BWD_BLOCK_Q, d), q.dtype, transforms=tile),
        plgpu.SMEM((STAGES, BWD_BLOCK_Q, d), q.dtype, transforms=tile),
        plgpu.SMEM((STAGES, BWD_BLOCK_Q), jnp.float32),
        plgpu.SMEM((STAGES, BWD_BLOCK_Q), jnp.float32),
        plgpu.SMEM((STAGES, BWD_BLOCK_Q), jnp.int32),
        plgpu.SMEM((wgs, BWD_BLOCK_K, d), q.dtype, transforms=tile),
        plgpu.SMEM((wgs, BWD_BLOCK_K, d), q.dtype, transforms=tile),
        plgpu.SMEM((wgs, BWD_BLOCK_K, d), k.dtype, transforms=tile) if direct else
        plgpu.SMEM((wgs, BWD_BLOCK_K, d), jnp.float32, transforms=smem_transforms(d, 4)),
    )
    loaded = tuple(plgpu.Barrier(num_barriers=STAGES) for _ in range(5))
    kv_loaded = (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs))
    free = plgpu.Barrier(num_arrivals=wgs, num_barriers=STAGES)
    kernel = functools.partial(_kernel, n_qb=n_qb, split_blocks=split_blocks,
                               n_split=n_split, d=d, scale=scale, scale2=scale * LOG2E,
                               wgs=wgs, direct=direct, group=group)
    pl.run_scoped(lambda *scoped: kernel(*refs, *scoped), scratch, loaded, kv_loaded, free,
                  collective_axes="wg")

  if direct:
    part = jax.ShapeDtypeStruct((bsz, s_pad, h, d), k.dtype)
  else:
    part = jax.ShapeDtypeStruct((n_split, bsz, s_pad, h, d), jnp.float32)
  dk, dv = plgpu.kernel(
      entry,
      out_type=(part, part),
      grid=(h * n_split, n_kc, bsz),
      grid_names=("heads", "kv_seq", "batch"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="causal_attention_dkv_mosaic",
  )(q, d_out, k, v, lse, delta, last, qstart, qend)
  if direct:
    return (dk[:, :s_len], dv[:, :s_len]) if s_pad != s_len else (dk, dv)
  # The used ranges' partials in range order: one fixed chain of float32 adds per element.
  return attention_triton.sum_ranges(dk, dv, ranges, s_len=s_len, block_k=wgs * BWD_BLOCK_K,
                                     scale=scale, dtype=k.dtype, interpret=False)


def dq(q, k, v, q_positions, kv_lengths, d_out, lse, out, *, scale: float):
  """``(dq, delta)``: ``dQ = scale dS K`` (q's dtype), per query row over ascending key
  tiles of ``BWD_BLOCK_K`` keys from key 0 up to the tile holding its CTA's largest
  ``last``, and ``delta = rowsum(dO * O)`` ``[B, Hq, Tq]`` float32 it computes on the way
  (one in-register row reduction; 0 for rows that see no key) for :func:`dkv`.

  Arguments as :func:`dkv`'s, with the forward's ``out`` in place of ``delta``. A CTA
  holds ``2 * BWD_BLOCK_Q`` query rows (one compute warpgroup each) and a memory
  warpgroup streams K/V tiles through a ``STAGES``-deep ring; the tile holding ``kv_len``
  has its K rows at or past it zeroed in shared memory before ``dS K`` (garbage past
  ``kv_len``: ``0 * NaN``); every masked term is a select.
  """
  attention_triton.check_operands("dq", q, k, v, q_positions, kv_lengths,
                                  {"d_out": d_out.shape, "out": out.shape}, {"lse": lse.shape})
  why = attention_mosaic.supported(q.shape[3], q.dtype)
  if why is not None:
    raise ValueError(f"causal_attention(mosaic) backward: {why}")
  bsz, tq, h, d = q.shape
  s_len = k.shape[1]
  wgs = NUM_COMPUTE_WGS
  cta_rows = wgs * BWD_BLOCK_Q
  n_qb = cdiv(tq, cta_rows)
  tq_pad = n_qb * cta_rows
  kv_len = jnp.minimum(kv_lengths.astype(jnp.int32), s_len)
  last = jnp.maximum(jnp.minimum(q_positions.astype(jnp.int32), kv_len[:, None] - 1), -1)
  d_out = d_out.astype(q.dtype)
  out = out.astype(q.dtype)
  if tq_pad != tq:
    rows = ((0, 0), (0, tq_pad - tq))
    q = jnp.pad(q, (*rows, (0, 0), (0, 0)))
    d_out = jnp.pad(d_out, (*rows, (0, 0), (0, 0)))
    out = jnp.pad(out, (*rows, (0, 0), (0, 0)))
    last = jnp.pad(last, rows, constant_values=-1)
    lse = jnp.pad(lse, ((0, 0), *rows))
  s_pad = max(BWD_BLOCK_K, round_up(s_len, 8))
  if s_pad != s_len:
    pad = ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  n_tiles = (jnp.max(last.reshape(bsz, n_qb, cta_rows), axis=2) + BWD_BLOCK_K) // BWD_BLOCK_K

  tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def entry(*refs):
    scratch = (
        plgpu.SMEM((wgs, BWD_BLOCK_Q, d), q.dtype, transforms=tile),
        plgpu.SMEM((wgs, BWD_BLOCK_Q, d), q.dtype, transforms=tile),
        plgpu.SMEM((wgs, BWD_BLOCK_Q, d), q.dtype, transforms=tile),
        plgpu.SMEM((wgs, BWD_BLOCK_Q), jnp.float32),
        plgpu.SMEM((wgs, BWD_BLOCK_Q), jnp.float32),
        plgpu.SMEM((wgs, BWD_BLOCK_Q), jnp.int32),
        plgpu.SMEM((STAGES, BWD_BLOCK_K, d), q.dtype, transforms=tile),
        plgpu.SMEM((STAGES, BWD_BLOCK_K, d), q.dtype, transforms=tile),
    )
    loaded = (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES))
    row_loaded = tuple(plgpu.Barrier(num_barriers=wgs) for _ in range(5))
    free = plgpu.Barrier(num_arrivals=wgs, num_barriers=STAGES)
    kernel = functools.partial(_dq_kernel, d=d, scale=scale, scale2=scale * LOG2E, wgs=wgs,
                               group=h // k.shape[2])
    pl.run_scoped(lambda *scoped: kernel(*refs, *scoped), scratch, loaded, row_loaded, free,
                  collective_axes="wg")

  dq_, delta = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((bsz, tq_pad, h, d), q.dtype),
                jax.ShapeDtypeStruct((bsz, h, tq_pad), jnp.float32)),
      grid=(h, n_qb, bsz),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="causal_attention_dq_mosaic",
  )(q, d_out, k, v, lse, out, last, n_tiles.astype(jnp.int32), kv_len)
  if tq_pad != tq:
    return dq_[:, :tq], delta[:, :, :tq]
  return dq_, delta


def backward(q, k, v, q_positions, kv_lengths, out, lse, d_out, *, scale: float,
             config: attention_triton.BackwardConfig | None = None,
             every_row_sees_a_key: bool = False):
  """``(dq, dk, dv)`` by :func:`dq` and :func:`dkv` (the Triton kernels where
  :func:`attention_mosaic.supported` says no or the head dim is not in
  ``BACKWARD_HEAD_DIMS``). Grouped query heads (``Hq = G * Hkv``) reach the kernels as
  they are: dQ and delta are per query row (the bits of the same rows in the folded
  layout); each key CTA walks its group's heads (dK, dV sums in that order).
  ``every_row_sees_a_key``: :func:`dkv`'s, from ``causal_attention``'s default positions."""
  if (attention_mosaic.supported(q.shape[3], q.dtype) is not None
      or q.shape[3] not in BACKWARD_HEAD_DIMS):
    return attention_triton.backward(q, k, v, q_positions, kv_lengths, out, lse, d_out,
                                     scale=scale, interpret=False, config=config)
  cfg = config or attention_triton.default_backward_config(q.dtype, q.shape[3])
  d_out = d_out.astype(q.dtype)
  dq_, delta = dq(q, k, v, q_positions, kv_lengths, d_out, lse, out, scale=scale)
  dk, dv = dkv(q, k, v, q_positions, kv_lengths, d_out, lse, delta, scale=scale,
               split_rows=cfg.dkv_split_rows, every_row_sees_a_key=every_row_sees_a_key)
  return dq_, dk, dv
