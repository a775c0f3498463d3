"""The persistent main loop of the Hopper Mosaic GPU kernels (GEMM and LM head).

One CTA per SM walks the ``[M, N]`` output in CTA tiles (``plgpu.nd_loop``
over the SMs, a planar snake for L2 reuse). Per CTA tile, a warp-specialized
pipeline runs: one memory warpgroup issues the TMA loads of ``A`` and ``B``
K tiles into swizzled shared memory, and each of ``num_compute_wgs`` compute
warpgroups issues wgmma into its own float32 accumulator, ``[tile_m, tile_n]``
in registers:

    acc = 0;  for kk = 0, 1, ..., ceil(K / TILE_K) - 1:
      acc += A[:, kk TILE_K : (kk + 1) TILE_K] @ B[kk TILE_K : (kk + 1) TILE_K, :]

each K tile as 4 k16 wgmma instructions in ascending order (a pipeline step of
``cfg.tile_k`` columns issues the instructions of ``tile_k / TILE_K`` consecutive K tiles:
the same sequence); no split-K, no stream-K. An element's K order depends on K
only, never on M, N, the tile's position or the config. The caller's
``epilogue`` then receives each finished accumulator; the kernels differ only
there (``gemm_mosaic`` stores the tile, ``linear_logp_mosaic`` reduces it to
softmax partials).

Per-row and per-column epilogue operands (``operands``) are fetched by TMA
while the K pipeline runs and are waited for before the epilogue starts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels._backend import num_sms
from jaxrl_kernels.contract import GEMM_TILE_K
from jaxrl_kernels.pallas._common import (
  HOPPER_SMEM_BYTES,
  cdiv,
  check_num_ctas,
  mosaic_warpgroup_params,
  smem_load,
  smem_transforms,
)

# The contract's K tile (128 bytes of bf16/fp16, one 128B swizzle row). Each
# wgmma step consumes it as 4 k16 instructions in ascending order.
TILE_K = GEMM_TILE_K

# Shared memory a CTA may fill with pipeline stages and epilogue buffers: the
# Hopper limit less 2 KiB for what the estimates leave out (barriers, small
# operand vectors, the 1 KiB alignment of each allocation).
SMEM_BUDGET = HOPPER_SMEM_BYTES - 2048

# Epilogue operand kinds: a ``[M]`` vector sliced to the warpgroup's rows, a
# ``[N]`` vector sliced to its columns, or a small vector copied whole.
ROW, COL, WHOLE = "row", "col", "whole"

@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The main loop's free knobs; none of them touches an element's K order.

  Attributes:
    tile_m, tile_n: one compute warpgroup's accumulator (``tile_m`` 64 or 128:
      multiples of wgmma's m64).
    num_compute_wgs: compute warpgroups per CTA, side by side along ``wg_split``.
    wg_split: "m" (warpgroups stack rows) or "n" (warpgroups stack columns).
    max_concurrent_steps: TMA pipeline depth (see :func:`pipeline_depth`).
    grid_minor: the faster-moving CTA tile index of the persistent walk ("m" or "n").
    grid_tile_width: band width of the planar snake walk.
    tree_registers: with ``chunks`` (:func:`persistent_matmul`), how many of the chunk
      tree's lowest levels keep their pending tile in registers (the rest in shared memory).
    tile_k: the K columns of one pipeline step, a multiple of ``TILE_K``: the same k16
      instructions in the same order into the same accumulator (a wider step issues more of
      them between waits), so the same bits.
    num_ctas: the persistent grid's size (None: one CTA per SM of the device). Each CTA
      tile's instructions are the same whichever CTA runs it, so GPUs of one architecture
      with other SM counts (an H20's 78, an H100's 132) give the same bits.
  """

  tile_m: int
  tile_n: int
  num_compute_wgs: int
  wg_split: str
  max_concurrent_steps: int
  grid_minor: str
  grid_tile_width: int
  tree_registers: int = 0
  tile_k: int = TILE_K
  num_ctas: int | None = None

  def __post_init__(self):
    check_num_ctas("mosaic_loop.LoopConfig", self.num_ctas)

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (self.num_compute_wgs if self.wg_split == "m" else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (self.num_compute_wgs if self.wg_split == "n" else 1)


@dataclasses.dataclass(frozen=True)
class Tile:
  """Where one compute warpgroup's finished accumulator sits in the output.

  ``wg``, ``mi``, ``ni``, ``row0`` and ``col0`` are traced int32 scalars: the
  compute warpgroup, the CTA tile's row and column index, and the first output
  row and column of the accumulator. ``cta_rows``/``cta_cols`` slice the CTA
  tile out of an ``[M, N]`` array, ``wg_rows``/``wg_cols`` this warpgroup's
  part out of the CTA tile.
  """

  wg: Any
  mi: Any
  ni: Any
  row0: Any
  col0: Any
  cta_rows: Any
  cta_cols: Any
  wg_rows: Any
  wg_cols: Any

  def window(self, ref):
    """This warpgroup's ``[tile_m, tile_n]`` window of an ``[M, N]`` ref."""
    return ref.at[self.cta_rows, self.cta_cols].at[self.wg_rows, self.wg_cols]


# epilogue(acc, tile, vec_smem, bufs): see persistent_matmul.
Epilogue = Callable[[Any, Tile, tuple, dict], None]


def pipeline_depth(cfg: LoopConfig, itemsize: int, epilogue_bytes: int,
                   tile_k: int = TILE_K) -> int:
  """``cfg.max_concurrent_steps``, lowered (not below 2) until the pipeline
  stages (the CTA's A and B K tiles of ``tile_k`` columns, ``itemsize`` bytes each) and
  the epilogue's ``epilogue_bytes`` fit in :data:`SMEM_BUDGET`."""
  stage = (cfg.cta_tile_m + cfg.cta_tile_n) * tile_k * itemsize
  steps = cfg.max_concurrent_steps
  while steps > 2 and steps * stage + epilogue_bytes > SMEM_BUDGET:
    steps -= 1
  return steps


def grid_size(cfg: LoopConfig) -> int:
  """The persistent grid's CTA count: ``cfg.num_ctas``, else one per SM."""
  return int(cfg.num_ctas) if cfg.num_ctas is not None else num_sms()


def _grid(cfg: LoopConfig, name: str | None = None) -> dict:
  # One CTA per SM (or cfg.num_ctas); one memory warpgroup plus the compute warpgroups.
  # ``name``: the kernel's symbol (what profiles list), nothing else.
  grid = dict(grid=(grid_size(cfg),), grid_names=("sm",), num_threads=cfg.num_compute_wgs + 1,
              thread_name="wg")
  return grid if name is None else {**grid, "kernel_name": name}


def kernel(body: Callable, *, out_type, cfg: LoopConfig, name: str) -> Callable:
  """``plgpu.kernel`` of ``body`` (which calls :func:`persistent_matmul`) on the
  persistent grid of ``cfg``, named ``name``."""
  return plgpu.kernel(body, out_type=out_type, compiler_params=mosaic_warpgroup_params(),
                      **_grid(cfg, name))


def mesh(cfg: LoopConfig) -> plgpu.Mesh:
  """The persistent grid of ``cfg`` as a mesh, for ``pl.kernel`` (mutable-ref outputs; its
  ``name`` names the kernel)."""
  return plgpu.Mesh(**_grid(cfg))


def chunk_step(kc: int) -> int:
  """The K step of a chunk view of width ``kc``: the widest of 64, 32 and 16 columns (128, 64
  or 32 bytes of 16-bit elements, one swizzled row) dividing it."""
  for t in (TILE_K, 32, 16):
    if kc % t == 0:
      return t
  raise ValueError(f"chunk_step: a chunk view's width ({kc}) must be a multiple of 16")


def _transpose(ref):
  return ref.transpose((1, 0))


def _fold_chunk(acc_ref, reg_slots, smem_slots, c, ends, chunks: int, levels: int) -> None:
  """At the end of chunk ``c`` (``ends``): fold the accumulator into the chunk tree (see
  :func:`persistent_matmul`). Level ``i``'s pending tile (the sum of ``2^i`` chunks) waits
  in slot ``i``: the register accumulators ``reg_slots`` first, then the float32
  ``smem_slots [levels - len(reg_slots), tile_m, tile_n]``. Level ``i`` is pending after
  chunk ``c`` exactly when bit ``i`` of ``c + 1`` is set. The fold adds the trailing-one
  levels of ``c`` to the accumulator, lowest (newest) first, each as the left operand, then
  parks the sum at the next level and restarts from zero, or, after the last chunk, leaves
  the tree's value in the accumulator."""
  layout = plgpu.Layout.WGMMA
  n_reg = len(reg_slots)

  def read(i):
    if i < n_reg:
      return reg_slots[i][...]
    return smem_load(smem_slots.at[i - n_reg], layout=layout)

  def write(i, value):
    if i < n_reg:
      reg_slots[i][...] = value
    else:
      smem_slots.at[i - n_reg][...] = value

  @pl.when(ends)
  def _():
    for i in range(levels):  # bits 0..i of c all set: level i holds the chunks before c's run
      @pl.when(lax.rem(c + 1, 2 << i) == 0)
      def _(i=i):
        acc_ref[...] = read(i) + acc_ref[...]

    @pl.when(c < chunks - 1)
    def _():
      for i in range(levels):  # c has exactly i trailing ones: the sum parks at level i
        @pl.when(lax.rem(c + 1, 2 << i) == 1 << i)
        def _(i=i):
          write(i, acc_ref[...])

      acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def rows_in_place(rows: int) -> bool:
  """Whether TMA can view an operand of ``rows`` rows in place through the 8-row shared
  memory tile: fewer than 8 (one partial tile) or a multiple of 8; past the rows, a box reads
  zeros and a store is clipped."""
  return 0 < rows < 8 or (rows > 0 and rows % 8 == 0)


def stored_rows(rows: int) -> int:
  """The rows of an output that ``rows`` real rows are stored into: ``rows`` where TMA takes
  them in place (:func:`rows_in_place`; the stores of a CTA tile's rows past them are
  clipped), else ``rows`` rounded up to 8."""
  return rows if rows_in_place(rows) else cdiv(rows, 8) * 8


def persistent_matmul(a_gmem, b_gmem, *, m: int, n: int, k: int, cfg: LoopConfig,
                      lhs_transposed: bool, rhs_transposed: bool, epilogue: Epilogue,
                      operands: Sequence[tuple[Any, str]] = (),
                      scratch: dict | None = None, group_rows: int | None = None,
                      group_cols: bool = False, chunks: int = 1,
                      tile_group=None) -> None:
  """The body of a persistent GEMM kernel, up to the epilogue.

  For every CTA tile of ``op(A) @ op(B)`` (``op(A)`` ``[M, K]``: ``a_gmem`` is
  ``[M, K]``, or ``[K, M]`` with ``lhs_transposed``; ``op(B)`` ``[K, N]``:
  ``b_gmem`` is ``[K, N]``, or ``[N, K]`` with ``rhs_transposed``), each compute
  warpgroup accumulates its ``[tile_m, tile_n]`` part over ascending K tiles
  and calls ``epilogue(acc, tile, vec_smem, bufs)``:

  - ``acc``: the float32 accumulator ``[tile_m, tile_n]``, in the wgmma
    register layout;
  - ``tile``: a :class:`Tile` (where the accumulator sits);
  - ``vec_smem``: one shared-memory ref ``[num_compute_wgs, length]`` per
    entry of ``operands``, in order, holding this tile's values in row
    ``tile.wg``. ``operands`` pairs a gmem vector with its kind: :data:`ROW`
    (``[M]``, ``length = tile_m``, from ``tile.row0``), :data:`COL` (``[N]``,
    ``length = tile_n``, from ``tile.col0``) or :data:`WHOLE` (copied as is);
  - ``bufs``: the refs allocated for ``scratch`` (a dict of ``plgpu.SMEM`` /
    ``plgpu.Barrier`` specs, same keys), made once per CTA and shared by its
    warpgroups, each of which uses its own part.

  The epilogue stores through TMA (``plgpu.copy_smem_to_gmem``) and must wait
  for the previous tile's stores (``plgpu.wait_smem_to_gmem``) before it
  rewrites a staging buffer; the loop waits for every store before the kernel
  returns. ``m``, ``n``, ``k``: the extents TMA walks (rows, columns and
  reduction; loads past an edge read zeros, stores past one are clipped).

  ``group_rows`` (a multiple of the CTA tile's rows; plain ``A [M, K]`` and ``B`` only):
  a grouped product. ``b_gmem`` is ``[G K, N]``, ``G`` weights stacked, and the rows
  ``[g group_rows, (g + 1) group_rows)`` of ``A`` are multiplied by weight ``g`` (rows
  ``[g K, (g + 1) K)`` of ``b_gmem``); ``k`` must be a multiple of ``TILE_K``, so no K
  tile reaches into the next weight. Each tile runs the instructions of the ungrouped
  product of its rows with its weight: the same bits. With ``group_cols``, ``a_gmem`` is
  ``[Ma, G K]`` instead (``Ma <= group_rows``), the ``G`` products' operands side by side:
  rows ``[g group_rows, (g + 1) group_rows)`` of the output read columns ``[g K, (g + 1) K)``
  of ``a_gmem`` (its rows past ``Ma`` as TMA zeros). The same values reach the same shared
  memory tiles as with the stacked ``[G group_rows, K]``, so the same bits, without the
  stacked copy.

  ``tile_group`` (with ``group_rows``; an int32 gmem ref ``[M / group_rows]``): the weight of
  rows ``[j group_rows, (j + 1) group_rows)`` is ``tile_group[j]`` instead of ``j``, read
  per CTA tile (a mixture-of-experts layout, whose row tiles name their expert at run time).
  ``b_gmem`` is then the ``G`` weights stacked as ``[G K, N]``, or as ``[G N, K]`` with
  ``rhs_transposed`` (weight ``g``'s rows ``[g N, (g + 1) N)``; a CTA tile's columns past
  ``N`` read the next weight's rows and are clipped at the store, so no column reads another
  column's values). Each tile runs the instructions of the ungrouped product of its rows with
  its weight: the same bits.

  ``chunks`` (a power of two dividing the K tiles; plain ``A`` only): the row-parallel
  product's chunk tree (``row_parallel``'s contract). The K walk is cut into ``chunks``
  equal runs of K tiles; each run accumulates from zero (the instructions of the chunk's own
  product) and is folded, when it ends, into the pairwise tree
  ``((P0+P1)+(P2+P3))+...`` like a binary counter: after run ``c``, ``S = P_c``; while
  ``c`` has a trailing one bit, ``S = pending + S`` (the newest pending tile), then ``S``
  is pending. The pending float32 tiles (one per level, ``log2 chunks`` levels) wait in
  registers for the lowest ``cfg.tree_registers`` levels and in shared memory for the others;
  the epilogue receives the whole tree's value.

  Chunk views (``chunks`` > 1): ``a_gmem`` ``[M, C, Kc]`` and ``b_gmem`` ``[C, Kc, N]`` (the
  2-D operands reshaped, no copy), ``C = chunks``, ``k = C Kc``, for a chunk width ``Kc``
  that is not a multiple of ``TILE_K`` but of 32 or 16 (:func:`chunk_step`). Each K step
  then loads ``chunk_step(Kc)`` columns of one chunk (2 or 1 k16 instructions instead of 4),
  and a chunk is ``Kc / chunk_step(Kc)`` steps: the instructions of the chunk's product over
  its K zero-padded to whole ``TILE_K`` tiles, less the trailing k16 instructions whose
  terms are all zeros (each adds exactly 0 to an accumulator that never holds -0), so the
  same bits without a padded copy of ``A`` in memory.
  """
  itemsize = jnp.dtype(a_gmem.dtype).itemsize
  cta_m, cta_n = cfg.cta_tile_m, cfg.cta_tile_n
  views = a_gmem.ndim == 3
  tile_k = cfg.tile_k
  if tile_k < TILE_K or tile_k % TILE_K or (tile_k != TILE_K and (views or chunks > 1)):
    raise ValueError(f"persistent_matmul: cfg.tile_k ({tile_k}) must be a multiple of "
                     f"{TILE_K}, and {TILE_K} for a chunk tree")
  if views:
    kc = a_gmem.shape[2]
    if (chunks < 2 or lhs_transposed or rhs_transposed or group_rows is not None
        or a_gmem.shape[1] != chunks or tuple(b_gmem.shape[:2]) != (chunks, kc)
        or k != chunks * kc or kc % 16):
      raise ValueError(f"persistent_matmul: chunk views need plain A [M, {chunks}, Kc] and "
                       f"B [{chunks}, Kc, N], Kc a multiple of 16, K = {chunks} Kc; got A "
                       f"{a_gmem.shape}, B {b_gmem.shape}, K {k}")
    tile_k = chunk_step(kc)
  m_iters, n_iters, k_iters = cdiv(m, cta_m), cdiv(n, cta_n), cdiv(k, tile_k)
  if k % tile_k and not views:
    raise ValueError(f"persistent_matmul: K ({k}) must be a multiple of cfg.tile_k ({tile_k})")
  if group_cols and (group_rows is None or a_gmem.ndim != 2 or m % group_rows
                     or a_gmem.shape[1] != m // group_rows * k
                     or a_gmem.shape[0] > group_rows or not rows_in_place(a_gmem.shape[0])):
    raise ValueError(f"persistent_matmul: group_cols needs group_rows dividing M ({m}) and A "
                     f"[Ma, (M / group_rows) {k}] with Ma <= group_rows ({group_rows}) and "
                     f"rows_in_place(Ma); got A {a_gmem.shape}")
  if group_rows is not None and (lhs_transposed or (rhs_transposed and tile_group is None)
                                 or group_rows % cta_m or k % TILE_K):
    raise ValueError(f"persistent_matmul: a grouped product needs a plain lhs (and a plain "
                     f"rhs unless tile_group is given), group_rows ({group_rows}) a multiple "
                     f"of the CTA tile's {cta_m} rows and K ({k}) a multiple of {TILE_K}")
  if tile_group is not None and (group_rows is None or group_cols or views):
    raise ValueError("persistent_matmul: tile_group needs group_rows, without group_cols or "
                     "chunk views")
  levels = chunks.bit_length() - 1
  if chunks < 1 or chunks & (chunks - 1) or k_iters % chunks or (
      chunks > 1 and (lhs_transposed or group_rows is not None)):
    raise ValueError(f"persistent_matmul: chunks ({chunks}) must be a power of two dividing "
                     f"the {k_iters} K tiles, with a plain, ungrouped A")
  chunk_steps = k_iters // chunks
  tree_regs = min(cfg.tree_registers, levels)
  for _, kind in operands:
    if kind not in (ROW, COL, WHOLE):
      raise ValueError(f"persistent_matmul: operand kind must be one of {(ROW, COL, WHOLE)}, "
                       f"got {kind!r}")

  if views:  # [M, C, Kc] and [C, Kc, N]: step kk is chunk kk // chunk_steps
    view_transforms = smem_transforms(tile_k, itemsize)
    a_spec = plgpu.BlockSpec((cta_m, None, tile_k),
                             lambda kk: (0, kk // chunk_steps, kk % chunk_steps),
                             transforms=view_transforms)
    # wgmma takes both operands in one swizzle: B's columns in A's (narrower) swizzle.
    b_spec = plgpu.BlockSpec((None, tile_k, cta_n),
                             lambda kk: (kk // chunk_steps, kk % chunk_steps, 0),
                             transforms=view_transforms)
  else:
    # wgmma takes both operands in one swizzle: a plain B narrower than one 128-byte swizzle
    # row (a 32-column CTA tile) puts A's K tile in B's swizzle too.
    narrow_b = not rhs_transposed and cta_n * itemsize < 128
    if narrow_b and lhs_transposed:
      raise ValueError(f"persistent_matmul: a CTA tile of {cta_n} columns (under 128 bytes) "
                       "needs a plain (untransposed) lhs")
    if lhs_transposed:  # [K, M]: smem tile [tile_k, cta_m]
      a_spec = plgpu.BlockSpec((tile_k, cta_m), lambda kk: (kk, 0),
                               transforms=smem_transforms(cta_m, itemsize))
    else:  # [M, K]: smem tile [cta_m, tile_k]
      a_spec = plgpu.BlockSpec((cta_m, tile_k), lambda kk: (0, kk),
                               transforms=smem_transforms(cta_n if narrow_b else tile_k,
                                                          itemsize))
    if rhs_transposed:  # [N, K]: smem tile [cta_n, tile_k]
      b_spec = plgpu.BlockSpec((cta_n, tile_k), lambda kk: (0, kk),
                               transforms=smem_transforms(tile_k, itemsize))
    else:  # [K, N]: smem tile [tile_k, cta_n]
      b_spec = plgpu.BlockSpec((tile_k, cta_n), lambda kk: (kk, 0),
                               transforms=smem_transforms(cta_n, itemsize))

  def make_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[a_spec, b_spec],
        wg_axis="wg",
        num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  def vec_length(ref, kind):
    if kind == ROW:
      return cfg.tile_m
    return cfg.tile_n if kind == COL else ref.shape[0]

  # run_scoped allocates in sorted key order: pipeline stages, epilogue buffers, operands.
  scoped = dict(
      allocs=make_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      bufs=dict(scratch or {}),
  )
  if levels > tree_regs:
    scoped["tree_smem"] = plgpu.SMEM(
        (cfg.num_compute_wgs, levels - tree_regs, cfg.tile_m, cfg.tile_n), jnp.float32)
  if operands:
    scoped["vec_smem"] = tuple(
        plgpu.SMEM((cfg.num_compute_wgs, vec_length(ref, kind)), ref.dtype)
        for ref, kind in operands)
    scoped["vec_barriers"] = plgpu.Barrier(num_arrivals=len(operands),
                                           num_barriers=cfg.num_compute_wgs)

  @functools.partial(pl.run_scoped, **scoped, collective_axes="wg")
  def _scope(allocs, bufs, vec_smem=(), vec_barriers=None, tree_smem=None):
    wg = lax.axis_index("wg")
    minor = 0 if cfg.grid_minor == "m" else 1

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (lin,) = info.index
      mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, cfg.grid_tile_width)
      cta_m_slice = pl.ds(mi * cta_m, cta_m)
      cta_n_slice = pl.ds(ni * cta_n, cta_n)
      if cfg.wg_split == "m":
        wg_m, wg_n = pl.ds(wg * cfg.tile_m, cfg.tile_m), slice(None)
      else:
        wg_m, wg_n = slice(None), pl.ds(wg * cfg.tile_n, cfg.tile_n)

      def compute_context(run_pipeline):
        acc_shape = (cfg.tile_m, cfg.tile_n)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(acc_shape, jnp.float32),
                           reg_slots=[plgpu.ACC(acc_shape, jnp.float32)] * tree_regs)
        def _acc_scope(acc_ref, reg_slots):
          # This warpgroup's rows and columns of the output.
          row0 = mi * cta_m + (wg * cfg.tile_m if cfg.wg_split == "m" else 0)
          col0 = ni * cta_n + (wg * cfg.tile_n if cfg.wg_split == "n" else 0)
          # Epilogue operands, fetched during the K pipeline.
          for (src, kind), dst in zip(operands, vec_smem):
            if kind == ROW:
              src = src.at[pl.ds(row0, cfg.tile_m)]
            elif kind == COL:
              src = src.at[pl.ds(col0, cfg.tile_n)]
            plgpu.copy_gmem_to_smem(src, dst.at[wg], vec_barriers.at[wg])
          run_pipeline((acc_ref, tuple(reg_slots)))
          acc = acc_ref[...]
          if operands:
            plgpu.barrier_wait(vec_barriers.at[wg])
          tile = Tile(wg=wg, mi=mi, ni=ni, row0=row0, col0=col0, cta_rows=cta_m_slice,
                      cta_cols=cta_n_slice, wg_rows=wg_m, wg_cols=wg_n)
          epilogue(acc, tile, vec_smem, bufs)

      def mma(idxs, a_smem, b_smem, carry):
        acc_ref, reg_slots = carry
        if lhs_transposed:
          a_op = _transpose(a_smem.at[:, wg_m])
        else:
          a_op = a_smem.at[wg_m, :]
        if rhs_transposed:
          b_op = _transpose(b_smem.at[wg_n, :])
        else:
          b_op = b_smem.at[:, wg_n]
        plgpu.wgmma(acc_ref, a_op, b_op)
        plgpu.wgmma_wait(0)
        if chunks > 1:
          (kk,) = idxs
          _fold_chunk(acc_ref, reg_slots, None if tree_smem is None else tree_smem.at[wg],
                      lax.div(kk, chunk_steps), lax.rem(kk, chunk_steps) == chunk_steps - 1,
                      chunks, levels)
        return carry

      if group_cols:  # this CTA tile's rows of its group, in the group's columns of A
        group = (mi * cta_m) // group_rows
        a_view = a_gmem.at[pl.ds(mi * cta_m - group * group_rows, cta_m),
                           pl.ds(group * k, k)]
      elif lhs_transposed:
        a_view = a_gmem.at[:, cta_m_slice]
      else:
        a_view = a_gmem.at[cta_m_slice]
      if views:
        b_view = b_gmem.at[:, :, cta_n_slice]
      elif group_rows is not None:  # this CTA tile's weight of the stacked ones
        group = (mi * cta_m) // group_rows
        if tile_group is not None:  # named at run time (a scalar load per CTA tile)
          group = tile_group[group]
        if rhs_transposed:  # [G N, K]: the weight's rows, then this tile's columns
          b_view = b_gmem.at[pl.ds(group * n + ni * cta_n, cta_n), :]
        else:
          b_view = b_gmem.at[pl.ds(group * k, k), cta_n_slice]
      elif rhs_transposed:
        b_view = b_gmem.at[cta_n_slice, :]
      else:
        b_view = b_gmem.at[:, cta_n_slice]
      make_pipeline(mma, compute_context)(a_view, b_view, allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
