"""Causal (grouped-query) attention forward for Hopper in Pallas Mosaic GPU, decode = prefill.

Semantics, layouts and the returned base-2 logsumexp are those of
``attention_triton.forward`` (so ``attention_triton.backward`` takes this
kernel's ``out`` and ``lse`` as residuals): ``q [B, Tq, Hq, D]``,
``k, v [B, S, Hkv, D]``; query ``i`` of row ``b`` at position ``p`` sees key
``j`` iff ``j <= p`` and ``j < kv_lengths[b]``; ``last = min(p, kv_len - 1)``.

Kernel (FlashAttention-3 style, warp-specialized): a CTA holds ``CTA_ROWS =
2 * BLOCK_Q`` queries of one (row, query head); two compute warpgroups own
``BLOCK_Q = 64`` rows each (the wgmma M; one warpgroup of ``BLOCK_Q`` rows when the
call has no more rows than that, a decode step: ``compute_wgs_for``), a third issues TMA loads
of K/V tiles of ``KEY_TILE`` keys into a ``STAGES``-deep ring of swizzled
shared-memory buffers. Per tile, each compute warpgroup runs
``S = Q K^T`` (wgmma, float32 accumulators in registers), the fp32 online
softmax in base 2 (``s = log2(e) * scale * q . k``) on the accumulator layout,
and ``acc = alpha acc + P V`` with ``P`` cast to the input dtype and kept in
registers as the wgmma lhs:

    m' = max(m, max_j s_j),  alpha = 2^(m - m'),  p_j = 2^(s_j - m'),
    l' = alpha l + sum_j p_j,  acc' = alpha acc + p @ v_tile,  out = acc / l.

The two warpgroups ping-pong through a schedule barrier so that one's softmax
overlaps the other's wgmma. Query blocks are scheduled heaviest first (causal
work grows with the block index). A decode step with more (batch entry, kv head)
CTAs than SMs runs two *lanes* per CTA instead (``lanes_for``): each compute
warpgroup works alone on its own batch entry through its own K/V ring, the
producer filling both rings.

The invariance contract (the same argument as ``attention_triton``):
``BLOCK_Q``, ``KEY_TILE`` and the instruction sequence per warpgroup are fixed
for every call of a dtype and head dim. Key tiles ``[t * KEY_TILE, (t + 1) *
KEY_TILE)`` are walked in ascending order from key 0 up to the tile holding the
CTA's largest ``last`` (a per-CTA tile count computed in XLA from the int32
``last`` of its rows). Every tile goes through one code path (the visibility
mask is always applied; there is no unmasked fast path whose code could
contract differently). A row that sees no key of a tile keeps ``(m, l, acc)``
through selects, so tiles walked for other rows never touch its bits. A decode
step (``Tq = 1``) runs a block of ``BLOCK_Q`` query rows, those past its own at
position -1 (zeros read past the array in the ``heads_major`` layout, a padded copy in
the row-major one), so its warpgroup runs the very instructions of a prefill block's
warpgroups. A row's bits depend only on
``q[b, i, h]``, ``k/v[b, :last + 1, h // group]``, the dtype and ``scale``.

Garbage past ``kv_len`` (a KV cache may hold NaN there): K rows past ``last``
only reach scores that the mask replaces by ``-inf`` with a select. V rows are
multiplied by ``p = 0`` inside the wgmma, and ``0 * NaN = NaN``, so the tile
that holds ``kv_len`` is cleaned in shared memory before the P @ V wgmma: each
compute warpgroup loads that V tile, selects 0 for rows at or past ``kv_len``,
stores it back and fences (both warpgroups write the same values, and only
after the producer's TMA completed; the producer refills the slot only after
both released it). Rows past ``S`` are zero-filled by TMA. V rows in
``(last, kv_len)`` are real (finite) cache entries and add ``0 * v = 0``.

Supported: bf16 / fp16, ``D`` in ``HEAD_DIMS`` (the smem ring of 2 stages of
128-key K and V tiles and two register accumulators must fit); other cases
run the Triton kernel (``supported``). Mosaic kernels only run on jax >= 0.11
on sm_90; the module imports on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels import contract
from jaxrl_kernels._backend import DEFAULT_NUM_SMS, num_sms
from jaxrl_kernels.pallas._common import (
  LOG2E,
  cdiv,
  check_num_ctas,
  round_up,
  smem_load,
)

# The contract's constants: query rows per compute warpgroup (the wgmma M),
# and the key tile walked in ascending order from key 0. A decode step runs a
# block of BLOCK_Q rows (those past its own see nothing), a prefill block's code.
BLOCK_Q = contract.ATTENTION_MOSAIC_BLOCK_Q
KEY_TILE = contract.ATTENTION_MOSAIC_KEY_TILE
NUM_COMPUTE_WGS = 2
CTA_ROWS = NUM_COMPUTE_WGS * BLOCK_Q
# Free knob (does not change any bits): depth of the K/V shared-memory ring, the default
# of forward's ``stages``.
STAGES = 2
# Shared memory a CTA may hold on Hopper (227 KiB): the bound ``stages`` is checked against.
SMEM_BYTES = 227 * 1024

HEAD_DIMS = (64, 128)
# The widest head dim whose two decode lanes' K/V rings fit in shared memory (lanes_for).
LANES_MAX_D = 64
# Persistent decode CTAs by default up to this many waves of items (persistent_for).
PERSISTENT_MAX_WAVES = 4
DTYPES = ("bfloat16", "float16")


def supported(d: int, dtype) -> str | None:
  """None when the Mosaic kernel runs this head dim and dtype, else why not."""
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not one of {DTYPES}"
  if d not in HEAD_DIMS:
    return f"head dim {d} is not one of {HEAD_DIMS}"
  return None


def compute_wgs_for(rows: int) -> int:
  """Compute warpgroups per CTA for ``rows`` query rows (after the GQA fold): one when they
  fit one warpgroup's ``BLOCK_Q`` (a decode step), else two (ping-pong). A free knob: each
  warpgroup runs the same instructions on its own 64 rows whatever the count, so it changes
  no bit (decode == prefill compares the two, ``tests/test_contract.py``)."""
  return 1 if rows <= BLOCK_Q else NUM_COMPUTE_WGS


def lanes_for(rows: int, bsz: int, heads: int, d: int) -> int:
  """Batch entries per CTA, each on its own compute warpgroup with its own K/V ring.

  A decode step (``rows <= BLOCK_Q``) has one warpgroup of work per (batch entry, head
  of the call: a kv head after ``causal_attention``'s GQA fold), and its CTA holds a
  whole SM (the compute warpgroup's 232 registers per thread leave room for one CTA):
  with more such CTAs than SMs they run in waves, each SM walking one entry's key tiles
  at a time. Two lanes give an SM two independent walks
  (the prefill's two compute warpgroups, each on another batch entry) when the CTAs of
  one lane would fill more than one wave and two K/V rings fit in shared memory
  (``D <= LANES_MAX_D``). A free knob: a lane's warpgroup runs a one-warpgroup CTA's
  instructions on its own rows and tiles, so no bit changes
  (``tests/attention/test_attention_mosaic_gpu.py`` compares the two)."""
  if rows <= BLOCK_Q and d <= LANES_MAX_D and bsz >= 2 and bsz * heads > DEFAULT_NUM_SMS:
    return NUM_COMPUTE_WGS
  return 1


def persistent_for(rows: int, items: int) -> bool:
  """Whether a call of ``rows`` query rows (after the GQA fold) and ``items`` (batch group,
  head) work items runs persistent CTAs by default: a decode step (``rows <= BLOCK_Q``)
  whose items fill more than one wave of CTAs and at most ``PERSISTENT_MAX_WAVES``. There
  one CTA per SM walking the items saves each later item's launch and ring fill
  (``benchmarks/results/attention.md``); past four waves the saving is negligible
  against the step. A free knob: each item runs its own CTA's instructions
  (``tests/attention/test_attention_mosaic_gpu.py`` compares the two)."""
  return rows <= BLOCK_Q and DEFAULT_NUM_SMS < items <= PERSISTENT_MAX_WAVES * DEFAULT_NUM_SMS


def _kernel(q_ref, k_ref, v_ref, last_ref, ntiles_ref, kvlen_ref, out_ref, lse_ref, smem, loaded,
            consumed, schedule, *, n_qblocks, group, d, scale2, wgs, lanes, heads_major,
            stages, items=None):
  # lanes == 1: the CTA's warpgroups share one batch entry's K/V tiles (one ring) and, with
  # two, ping-pong through the schedule barrier. lanes == wgs: warpgroup w works alone on
  # batch entry (CTA index * lanes + w) through its own ring ``[w * stages, (w + 1) * stages)``.
  # items (persistent CTAs, decode only: one query block, wgs == lanes): the CTA walks work
  # items cta, cta + n_cta, ... (item = batch group * heads + head: heads fastest), each
  # warpgroup's ring and barriers continuing from one item to the next.
  qo_smem2, k_smem, v_smem, last_smem2, lse_smem2 = smem
  k_loaded, v_loaded, q_loaded, last_loaded = loaded
  k_free, v_free = consumed
  dtype = q_ref.dtype
  if items is None:
    b0 = lax.axis_index("batch") * lanes
    h = lax.axis_index("heads")
    # Heaviest (highest) query blocks first: causal work grows with the index.
    qb = n_qblocks - 1 - lax.axis_index("q_seq")
  wg = lax.axis_index("wg")
  coupled = lanes == 1  # warpgroups share the tiles and the schedule barrier

  def schedule_sync():
    if coupled:
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

  def ring_slot(ring, t, done):
    # The ring slot of the item's key tile t; ``done``: the tiles this warpgroup's ring held
    # before the item (persistent CTAs), None for a CTA of one item.
    return ring + lax.rem(t if done is None else done + t, jnp.int32(stages))

  def compute_item(b0, h, qb, done):
    lane = 0 if coupled else wg
    b = b0 + lane
    ring = lane * stages  # this lane's first slot of the K/V ring and its barriers
    n_tiles = ntiles_ref[b, qb]  # tiles up to the one holding the block's largest `last`
    kv_len = kvlen_ref[b]
    qo_smem, last_smem, lse_smem = qo_smem2.at[wg], last_smem2.at[wg], lse_smem2.at[wg]
    row0 = (qb * (wgs * BLOCK_Q) + wg * BLOCK_Q) if coupled else qb * BLOCK_Q
    q_rows = (b, h, pl.ds(row0, BLOCK_Q)) if heads_major else (b, pl.ds(row0, BLOCK_Q), h)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], qo_smem, q_loaded.at[wg])
    plgpu.copy_gmem_to_smem(last_ref.at[b, pl.ds(row0, BLOCK_Q)], last_smem,
                            last_loaded.at[wg])
    plgpu.barrier_wait(last_loaded.at[wg])
    plgpu.barrier_wait(q_loaded.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    last = smem_load(last_smem, layout=row_layout)  # int32 [BLOCK_Q], -1: sees nothing
    m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
    den = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0, jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(n_tiles > 0)
    def _():
      plgpu.barrier_wait(k_loaded.at[ring if done is None else ring_slot(ring, 0, done)])

    if coupled:
      pl.when(wg == 1)(schedule_sync)

    def tile(t, carry):
      acc, m, den = carry
      slot = ring_slot(ring, t, done)
      key0 = t * KEY_TILE
      clean = key0 + KEY_TILE <= kv_len

      @pl.when(key0 + KEY_TILE > kv_len)
      def _zero_v_tail():
        # The tile holding kv_len: V rows at or past it may be garbage (NaN),
        # and the wgmma would compute 0 * NaN. Select them to 0 in place.
        plgpu.barrier_wait(v_loaded.at[slot])
        v_tile = v_smem.at[slot][...]
        rows = plgpu.broadcasted_iota(jnp.int32, (KEY_TILE, d), 0, layout=plgpu.Layout.WGMMA)
        v_smem.at[slot][...] = jnp.where(rows < kv_len - key0, v_tile, jnp.zeros_like(v_tile))
        plgpu.commit_smem()

      def qk_scope(acc_ref):
        plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
        schedule_sync()
        return acc_ref[...]

      qk = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_Q, KEY_TILE), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])

      # One code path for every tile: the mask is always applied (a select).
      shape = (BLOCK_Q, KEY_TILE)
      cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
      visible = cols <= lax.broadcast_in_dim(last - key0, shape, [0])
      s = jnp.where(visible, qk * scale2, -jnp.inf)
      active = last >= key0  # the row sees at least one key of this tile
      m_new = jnp.maximum(m, s.max(axis=1))
      m_use = jnp.where(active, m_new, 0.0)  # no (-inf) - (-inf) in rows that see nothing
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_use, shape, [0]))
      den_new = alpha * den + p.sum(axis=1)
      p_in = p.astype(dtype)
      acc_scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      if coupled:
        plgpu.barrier_arrive(schedule)  # softmax done

      @pl.when(clean)
      def _():
        plgpu.barrier_wait(v_loaded.at[slot])

      if coupled:
        plgpu.barrier_wait(schedule)  # the tensor cores are free

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])
        nxt = t + 1

        @pl.when(nxt < n_tiles)
        def _():
          plgpu.barrier_wait(k_loaded.at[ring_slot(ring, nxt, done)])

      acc_new = pl.run_state(pv)(plgpu.ACC.init(acc_scaled))
      plgpu.barrier_arrive(v_free.at[slot])
      # Rows that see nothing here keep their state: the tile is skipped exactly.
      keep = lax.broadcast_in_dim(last, acc.shape, [0]) >= key0
      return (jnp.where(keep, acc_new, acc), jnp.where(active, m_new, m),
              jnp.where(active, den_new, den))

    # Ascending key tiles from key 0: the reduction order of the contract.
    acc, m, den = lax.fori_loop(0, n_tiles, tile, (acc, m, den))
    if coupled:
      pl.when(wg == 0)(schedule_sync)

    den_b = lax.broadcast_in_dim(den, acc.shape, [0])
    # Whether a row sees a key comes from its position (``last``), never from ``den``: a
    # NaN or inf score makes ``den`` NaN, and the row's output and lse must be NaN too.
    seen_b = lax.broadcast_in_dim(last, acc.shape, [0]) >= 0
    out = acc / jnp.where(seen_b, den_b, 1.0)
    # A row that sees no key gives 0; zeros are written as +0.
    out = jnp.where(seen_b & (out != 0), out, 0.0)
    qo_smem[...] = out.astype(dtype)
    seen = last >= 0
    lse_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, den, 1.0)), 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[q_rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(row0, BLOCK_Q)])
    # The next item's loads reuse the staging buffers: they need the stores' reads only.
    plgpu.wait_smem_to_gmem(0, wait_read_only=done is not None)
    return n_tiles

  def stream_item(b0, h, qb, loaded_before):
    hk = lax.div(h, jnp.int32(group))
    counts = [ntiles_ref[b0 + lane, qb] for lane in range(lanes)]

    if loaded_before is not None:
      # Persistent CTAs: lane tile n of the CTA's life (``loaded_before[lane]`` + t) reuses
      # the slot of tile n - stages, so it waits for that one's release once n >= stages.
      # The lanes' loads interleave, one tile each per step, as below.
      def step_loads(t, lane):
        n = loaded_before[lane] + t
        slot = lane * stages + lax.rem(n, jnp.int32(stages))
        window = (b0 + lane, pl.ds(t * KEY_TILE, KEY_TILE), hk)

        @pl.when(n >= stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem.at[slot], k_loaded.at[slot])

        @pl.when(n >= stages)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem.at[slot], v_loaded.at[slot])

      @pl.loop(0, functools.reduce(jnp.maximum, counts))
      def _(t):
        for lane in range(lanes):
          if lanes == 1:
            step_loads(t, lane)
          else:
            pl.when(t < counts[lane])(functools.partial(step_loads, t, lane))

      return [loaded_before[lane] + counts[lane] for lane in range(lanes)]

    # Fill each lane's ring. A loop, not a Python unroll: tile starts stay traced
    # values, so a tile that reaches past S is a TMA zero-fill at run time rather
    # than a static out-of-bounds slice at trace time.
    for lane in range(lanes):
      @pl.loop(0, jnp.minimum(counts[lane], stages))
      def _(t, lane=lane):
        window = (b0 + lane, pl.ds(t * KEY_TILE, KEY_TILE), hk)
        slot = lane * stages + t
        plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem.at[slot], k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem.at[slot], v_loaded.at[slot])

    def refill(step, lane):
      slot = lane * stages + lax.rem(step, jnp.int32(stages))
      window = (b0 + lane, pl.ds((step + stages) * KEY_TILE, KEY_TILE), hk)
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[window], k_smem.at[slot], k_loaded.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[window], v_smem.at[slot], v_loaded.at[slot])

    # The lanes' refills interleaved, one tile each per step: a lane waits only on
    # its own consumer, which waits only on loads already issued.
    @pl.loop(0, jnp.maximum(functools.reduce(jnp.maximum, counts) - stages, 0))
    def _(step):
      if lanes == 1:
        refill(step, 0)
        return
      for lane in range(lanes):
        pl.when(step < counts[lane] - stages)(functools.partial(refill, step, lane))
    return None

  def walk(body, carry):
    """``body(b0, h, qb, carry) -> carry`` over this persistent CTA's items, in order."""
    cta, n_cta = lax.axis_index("cta"), lax.axis_size("cta")
    hq = items[1]

    def one(j, carry):
      item = cta + j * n_cta
      return body(lax.div(item, jnp.int32(hq)) * lanes, lax.rem(item, jnp.int32(hq)), 0,
                  carry)

    return lax.fori_loop(0, lax.div(items[0] - cta + n_cta - 1, n_cta), one, carry)

  @pl.when(wg < wgs)
  def _compute_wg():
    plgpu.set_max_registers(232, action="increase")
    if items is None:
      compute_item(b0, h, qb, None)
    else:
      walk(lambda b0, h, qb, done: done + compute_item(b0, h, qb, done), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == wgs)
  def _memory_wg():
    plgpu.set_max_registers(40, action="decrease")
    if items is None:
      stream_item(b0, h, qb, None)
    else:
      walk(lambda b0, h, qb, loaded: stream_item(b0, h, qb, loaded),
           [jnp.int32(0)] * lanes)


def smem_bytes(d: int, itemsize: int, *, wgs: int, lanes: int, stages: int) -> int:
  """Shared memory of a CTA as Mosaic counts it: the q/output tiles, ``lanes`` K and V rings
  of ``stages`` tiles, the rows' positions and logsumexps (each buffer aligned to 1 KiB),
  the barriers, and the 2 KiB the lowering adds (checked against Mosaic's own count at
  D = 64 and 128, one and two warpgroups and lanes, one to three stages)."""
  tiles = (wgs * BLOCK_Q * d + 2 * lanes * stages * KEY_TILE * d) * itemsize
  rows = 2 * round_up(wgs * BLOCK_Q * 4, 1024)
  barriers = (2 * lanes * stages * 2 + 2 * wgs + 1) * 8
  return tiles + rows + barriers + 2048


def forward(q, k, v, q_positions, kv_lengths, *, scale: float, lanes: int | None = None,
            heads_major: bool = False, stages: int | None = None, persistent: bool | None = None,
            num_ctas: int | None = None):
  """Attention output ``[B, Tq, Hq, D]`` (q's dtype) and base-2 logsumexp ``[B, Hq, Tq]``.

  Exactly the contract and residual format of ``attention_triton.forward``:
  ``lse2 = max_j s_j + log2 sum_j 2^(s_j - max)`` with
  ``s = log2(e) * scale * q . k`` over visible keys (0 for a row that sees none).
  ``q_positions [B, Tq]`` and ``kv_lengths [B]`` are int32. ``lanes`` (batch entries
  per CTA, 1 or 2 for at most ``BLOCK_Q`` rows; default :func:`lanes_for`) is a free
  knob, exposed for the tests that compare its values. ``stages`` (the depth of each K/V
  ring, default ``STAGES``) is another: the tiles are the same, only how many are loaded
  ahead changes. So is ``persistent`` (decode steps only, at most ``BLOCK_Q`` rows; default
  :func:`persistent_for`): one CTA per SM walks the (batch entry group, head) items in turn,
  heads fastest, each item the instructions of its own CTA, its ring continuing from the
  item before. ``num_ctas``: the persistent grid's size (None: one CTA per SM, at most one
  per item); every item runs the same instructions whichever CTA takes it, so the bits do not
  depend on it (nor on the GPU's SM count).

  ``heads_major``: ``q`` is ``[B, Hq, Tq, D]`` and the output is returned so (the
  logsumexp keeps its layout). A free layout knob: each CTA copies the same rows into
  the same shared-memory tile. It is how a decode step's query heads reach the kernel
  with no copy (``[B, 1, Hq, D]`` is ``[B, Hq, 1, D]`` in memory): a query block that
  reaches past ``Tq`` is read as zeros and written back only where it lies inside the
  array (TMA's out-of-bounds fill and clipping), so the rows need no padded copy when
  ``Tq <= 8`` or ``Tq % 8 == 0`` (the 8-row tile of the shared-memory layout).
  """
  if heads_major:
    bsz, hq, tq, d = q.shape
  else:
    bsz, tq, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  why = supported(d, q.dtype)
  if why is not None:
    raise ValueError(f"causal_attention(mosaic): {why}; use implementation='triton'")
  wgs = compute_wgs_for(tq)
  if lanes is None:
    lanes = lanes_for(tq, bsz, hq, d)
  if lanes not in (1, NUM_COMPUTE_WGS) or (lanes > 1 and (wgs > 1 or d > LANES_MAX_D)):
    raise ValueError(f"causal_attention(mosaic): lanes must be 1, or {NUM_COMPUTE_WGS} for at "
                     f"most {BLOCK_Q} query rows and D <= {LANES_MAX_D} (two K/V rings in shared "
                     f"memory), got {lanes} for {tq} rows at D = {d}")
  if persistent is not None and not isinstance(persistent, bool):
    raise ValueError(f"causal_attention(mosaic): persistent must be a bool or None, got "
                     f"{persistent!r}")
  check_num_ctas("causal_attention(mosaic)", num_ctas)
  if persistent and wgs > 1:
    raise ValueError(f"causal_attention(mosaic): persistent CTAs take decode steps (at most "
                     f"{BLOCK_Q} query rows after the GQA fold), got {tq} rows")
  cta_rows = wgs * BLOCK_Q
  wgs = max(wgs, lanes)
  if stages is None:
    stages = STAGES
  if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
    raise ValueError(f"causal_attention(mosaic): stages must be an int >= 1, got {stages!r}")
  if stages < 2 and wgs > lanes:
    # Two warpgroups on one ring (a block of more than BLOCK_Q rows, ping-pong): each waits
    # for the next tile before it releases V of this one, and with one slot the next K
    # load waits for the other warpgroup, which waits on the schedule barrier: a deadlock.
    raise ValueError(f"causal_attention(mosaic): stages must be at least 2 when two warpgroups "
                     f"share one K/V ring ({tq} query rows, more than {BLOCK_Q}), got {stages}")
  need = smem_bytes(d, q.dtype.itemsize, wgs=wgs, lanes=lanes, stages=stages)
  if need > SMEM_BYTES:
    raise ValueError(f"causal_attention(mosaic): stages = {stages} needs {need} bytes of shared "
                     f"memory with {lanes} K/V ring(s) at D = {d} (at most {SMEM_BYTES})")
  n_qblocks = cdiv(tq, cta_rows)
  tq_pad = n_qblocks * cta_rows
  kv_len = jnp.minimum(kv_lengths.astype(jnp.int32), s_len)
  last = jnp.maximum(jnp.minimum(q_positions.astype(jnp.int32), kv_len[:, None] - 1), -1)
  tq_q = tq  # the query rows q holds
  if heads_major and tq > 8 and tq % 8:
    # The shared-memory tile is 8 rows: Mosaic's TMA view of q needs a row count that is
    # a multiple of 8 or below 8 (then one partial tile, the rest of the block OOB zeros).
    tq_q = round_up(tq, 8)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, tq_q - tq), (0, 0)))
  if tq_pad != tq:
    # Padding queries (position -1) fill the CTA: a decode step runs a full block.
    if not heads_major:
      q = jnp.pad(q, ((0, 0), (0, tq_pad - tq), (0, 0), (0, 0)))
      tq_q = tq_pad
    last = jnp.pad(last, ((0, 0), (0, tq_pad - tq)), constant_values=-1)
  s_pad = max(KEY_TILE, round_up(s_len, 8))
  if s_pad != s_len:
    # Mosaic's TMA tiling needs S a multiple of 8 rows and at least one whole
    # box of keys. By the static S only; the zero rows are past kv_len.
    pad = ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  # Per-CTA loop bound from the int32 `last` of its rows (no float data involved).
  n_tiles = (jnp.max(last.reshape(bsz, n_qblocks, cta_rows), axis=2) + KEY_TILE) // KEY_TILE
  bsz_pad = round_up(bsz, lanes)
  if bsz_pad != bsz:
    # A lane past the batch: no key tiles (K/V are never read for it), zero queries,
    # and its output rows are sliced off below.
    extra = bsz_pad - bsz
    q = jnp.pad(q, ((0, extra), (0, 0), (0, 0), (0, 0)))
    last = jnp.pad(last, ((0, extra), (0, 0)), constant_values=-1)
    n_tiles = jnp.pad(n_tiles, ((0, extra), (0, 0)))
    kv_len = jnp.pad(kv_len, (0, extra))

  smem_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  n_items = bsz_pad // lanes * hq  # a persistent CTA's work items: (batch group, head)
  if persistent is None:
    persistent = persistent_for(tq, n_items)
  if num_ctas is not None and not persistent:
    raise ValueError(f"causal_attention(mosaic): num_ctas sizes the persistent grid; this call "
                     f"runs one CTA per item (persistent=False), got num_ctas={num_ctas}")

  def entry(q_ref, k_ref, v_ref, last_ref, ntiles_ref, kvlen_ref, out_ref, lse_ref):
    scratch = (
        plgpu.SMEM((wgs, BLOCK_Q, d), q.dtype, transforms=smem_transforms),
        plgpu.SMEM((lanes * stages, KEY_TILE, d), q.dtype, transforms=smem_transforms),
        plgpu.SMEM((lanes * stages, KEY_TILE, d), q.dtype, transforms=smem_transforms),
        plgpu.SMEM((wgs, BLOCK_Q), jnp.int32),
        plgpu.SMEM((wgs, BLOCK_Q), jnp.float32),
    )
    loaded = (plgpu.Barrier(num_barriers=lanes * stages),
              plgpu.Barrier(num_barriers=lanes * stages),
              plgpu.Barrier(num_barriers=wgs),
              plgpu.Barrier(num_barriers=wgs))
    consumed = (plgpu.Barrier(num_arrivals=wgs // lanes, num_barriers=lanes * stages),) * 2
    schedule = plgpu.Barrier(num_arrivals=wgs)
    kernel = functools.partial(_kernel, n_qblocks=n_qblocks, group=hq // hkv, d=d,
                               scale2=scale * LOG2E, wgs=wgs, lanes=lanes,
                               heads_major=heads_major, stages=stages,
                               **({"items": (n_items, hq)} if persistent else {}))
    pl.run_scoped(
        lambda *scoped: kernel(q_ref, k_ref, v_ref, last_ref, ntiles_ref, kvlen_ref, out_ref,
                               lse_ref, *scoped),
        scratch, loaded, consumed, schedule, collective_axes="wg")

  if persistent:  # one CTA per SM (at most one per item), walking the items heads fastest
    grid = dict(grid=(min(n_items, int(num_ctas or num_sms())),), grid_names=("cta",))
  else:
    # The last grid axis is CUDA's x, the fastest in launch order: the heads of one batch
    # entry run side by side, reading the interleaved K/V rows of one cache region.
    grid = dict(grid=(bsz_pad // lanes, n_qblocks, hq), grid_names=("batch", "q_seq", "heads"))
  out, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(
          (bsz_pad, hq, tq_q, d) if heads_major else (bsz_pad, tq_q, hq, d), q.dtype),
                jax.ShapeDtypeStruct((bsz_pad, hq, tq_pad), jnp.float32)),
      **grid,
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="causal_attention_fwd_mosaic",
  )(q, k, v, last, n_tiles.astype(jnp.int32), kv_len)
  if heads_major:
    out = out[:bsz, :, :tq]
  else:
    out = out[:bsz, :tq]
  return out, lse[:bsz, :, :tq]
