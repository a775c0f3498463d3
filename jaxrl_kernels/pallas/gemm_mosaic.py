"""Deterministic, batch-invariant GEMM for Hopper in Pallas Mosaic GPU.

The main loop is :mod:`mosaic_loop`'s: TMA loads into swizzled shared memory,
wgmma with float32 accumulators in registers, a warp-specialized pipeline (one
memory warpgroup issuing TMA, one or two compute warpgroups issuing wgmma) and
a persistent grid (one CTA per SM walking output tiles). Each output tile
walks K in ``TILE_K`` steps in ascending order: no split-K, no stream-K. TMA
zero-fills loads past the edge of M, N or K and clips stores, so operands are
read in place, never padded. This file adds the store epilogue: each finished
accumulator leaves in ``epi_tile_m x epi_tile_n`` pieces through shared
memory, optionally through an elementwise ``epilogue`` and adding ``c``.

What may vary per shape (free knobs): the M and N tile, the number of compute
warpgroups, pipeline depth and the CTA walk order. They do not change any
element's K reduction order; ``tests/gemm/test_det_matmul_gpu.py`` checks
that every config gives the same bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels._backend import DEFAULT_NUM_SMS
from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.pallas import mosaic_loop
from jaxrl_kernels.pallas._common import (
  check_num_ctas,
  mosaic_warpgroup_params,
  round_up,
  smem_transforms,
)

# The contract's K tile (contract.GEMM_TILE_K), walked by mosaic_loop. Never
# derived from the shape.
TILE_K = mosaic_loop.TILE_K


@dataclasses.dataclass(frozen=True)
class Config:
  """Free tuning knobs (none of them touches the K order)."""

  tile_m: int = 128  # rows per compute warpgroup (64 or 128: multiples of wgmma's m64)
  tile_n: int = 128  # columns per compute warpgroup
  num_compute_wgs: int = 2
  wg_split: str = "n"  # how compute warpgroups split the CTA tile: "m" or "n"
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_minor: str = "n"  # the faster-moving tile index of the persistent walk
  grid_tile_width: int = 1
  tree_registers: int = 0  # chunk tree levels pending in registers (chunk_tree_matmul)
  tile_k: int = TILE_K  # K columns per pipeline step (a multiple of TILE_K)
  num_ctas: int | None = None  # persistent grid size (None: one CTA per SM); same bits

  def __post_init__(self):
    check_num_ctas("gemm_mosaic.Config", self.num_ctas)
    if self.tile_k < TILE_K or self.tile_k % TILE_K:
      raise ValueError(f"gemm_mosaic.Config: tile_k ({self.tile_k}) must be a positive multiple "
                       f"of {TILE_K}")

  @property
  def loop(self) -> mosaic_loop.LoopConfig:
    """The main loop's part of this config."""
    return mosaic_loop.LoopConfig(
        tile_m=self.tile_m, tile_n=self.tile_n, num_compute_wgs=self.num_compute_wgs,
        wg_split=self.wg_split, max_concurrent_steps=self.max_concurrent_steps,
        grid_minor=self.grid_minor, grid_tile_width=self.grid_tile_width,
        tree_registers=self.tree_registers, tile_k=self.tile_k, num_ctas=self.num_ctas)

  @property
  def cta_tile_m(self) -> int:
    return self.loop.cta_tile_m

  @property
  def cta_tile_n(self) -> int:
    return self.loop.cta_tile_n


def wave_use(m: int, n: int, cta_m: int, cta_n: int, sms: int = DEFAULT_NUM_SMS) -> float:
  """The share of the persistent CTAs' tile slots that an ``[m, n]`` output fills with
  ``cta_m x cta_n`` tiles: its area over (the waves of ``sms`` tiles it takes, times ``sms``
  tiles). A shape's rule, not the device's: the same shape gets the same config anywhere."""
  tiles = -(-m // cta_m) * -(-n // cta_n)
  return m * n / (-(-tiles // sms) * sms * cta_m * cta_n)


def default_config(m: int, n: int, k: int, groups: int = 1) -> Config:
  """Picks free knobs by shape (chosen by benchmarks/tune_gemm_mosaic.py; numbers in
  benchmarks/results/gemm_h100.md).

  Only tiles, warpgroups and walk order change; every config gives the same
  bits (tests/gemm/test_det_matmul_gpu.py::test_every_mosaic_config_gives_the_same_bits).
  ``groups``: ``grouped_matmul``'s ``G`` products of ``m`` rows each, in one launch.
  """
  if m <= 64:
    # Decode-sized M: the weight stream dominates; small N tiles spread it over
    # the SMs and a deep pipeline keeps enough bytes in flight. Once 64-wide tiles
    # would take more than one wave of the SMs, 128-wide ones stream the weight in
    # fewer, longer walks; within one wave the 64-wide tiles spread the weight over more SMs.
    if -(-n // 64) > DEFAULT_NUM_SMS:
      return Config(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n",
                          max_concurrent_steps=4)
    if k % (2 * TILE_K) == 0:
      # 128-column K steps: half the pipeline steps (and waits) per byte of weight. (The
      # 128-wide tiles above keep 64-column steps: their deeper pipeline hides the waits.)
      return Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n",
                          max_concurrent_steps=6, tile_k=2 * TILE_K)
    return Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n",
                        max_concurrent_steps=8)
  if m <= MID_ROWS and n >= 256:
    return mid_config(m, n, groups)
  m *= groups  # larger products: their rows stacked, as one product's
  big_tiles = -(-m // 128) * -(-n // 256)  # CTA tiles of the large config
  if n < 256 or big_tiles < 96:
    # Too few 128x256 tiles to fill the 132 SMs: 64x128 CTA tiles instead, spreading the
    # product over more SMs (also a weight gradient with a small output).
    return Config(tile_m=64, tile_n=64, num_compute_wgs=2, wg_split="n",
                        max_concurrent_steps=6)
  large = wave_use(m, n, 128, 256)
  if m >= 192 and large < 0.75 and wave_use(m, n, 192, 192) > large:
    # The 128 x 256 tiles leave most of the last wave idle; 192 x 192 ones (three compute
    # warpgroups) fill it (the weight gradients of a 896 -> 9728 and a 4864 -> 896 layer
    # over 16384 tokens).
    return Config(tile_m=64, tile_n=192, num_compute_wgs=3, wg_split="m",
                        max_concurrent_steps=4, grid_minor="m", grid_tile_width=8)
  # M = 256 with N >= 14336 (112+ tiles) fills the SMs with the large tile.
  # Outputs of at most 4 column tiles walk row by row (N-minor): the few column tiles of a
  # row band share its A rows in L2; wider ones walk in bands of 8 row tiles, whose B
  # columns stay in L2 across the band.
  minor = "n" if n <= 4 * 256 else "m"
  return Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m",
                      max_concurrent_steps=3, grid_minor=minor, grid_tile_width=8)


# Rows of a step of a few hundred sequences (a rollout's decode step, 64 < M <= MID_ROWS):
# each product is one or two waves of CTA tiles, so the tile is picked by the time of its
# waves (:func:`mid_config`).
MID_ROWS = 512
# (config, its CTA tile's throughput relative to 128 x 256). The ratios fit a sweep at
# M = 256 on Hopper (benchmarks/tune_gemm_mosaic.py --lists mid): the largest tile keeps its
# SM's tensor cores busiest, a smaller one spreads a product over more SMs.
MID_TILES = (
    (Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m",
                  max_concurrent_steps=4, grid_minor="m", grid_tile_width=2), 1.0),
    (Config(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="m",
                  max_concurrent_steps=6, grid_minor="m", grid_tile_width=2), 0.87),
    (Config(tile_m=64, tile_n=64, num_compute_wgs=2, wg_split="n",
                  max_concurrent_steps=6), 0.6),
)


def mid_config(m: int, n: int, groups: int = 1) -> Config:
  """The config of ``groups`` products of ``[m, n]`` outputs (``N >= 256``) whose waves of
  CTA tiles take the least time: waves x tile area / the tile's relative throughput.

  For example, at M = 256 Qwen2.5-1.5B's gate_up (N = 17920) takes 128 x 128 tiles: 128 x 256
  ones give 140 tiles, a second wave of 8 that leaves most SMs idle; a qkv product
  (N = 2048) takes 64 x 128, whose more tiles spread it over more SMs (numbers:
  benchmarks/results/gemm_h100.md). A shape's rule, not the device's.
  """
  if n < 256:
    raise ValueError(f"mid_config: N={n} is below the 256 columns of its widest tile")

  def waves_time(entry):
    cfg, throughput = entry
    tiles = groups * -(-m // cfg.cta_tile_m) * -(-n // cfg.cta_tile_n)
    return -(-tiles // DEFAULT_NUM_SMS) * cfg.cta_tile_m * cfg.cta_tile_n / throughput

  return min(MID_TILES, key=waves_time)[0]


def _kernel(a_gmem, b_gmem, *refs, m, n, k, cfg: Config, lhs_transposed: bool,
            rhs_transposed: bool, in_place: bool = False, n_row_ops: int = 0,
            n_col_ops: int = 0, epilogue=None, group_rows: int | None = None,
            group_cols: bool = False, chunks: int = 1, tile_group: bool = False):
  # refs: [the tile groups (int32, with ``tile_group``)], [row operands], [column operands],
  # then (out,); (c, out) when accumulating into ``c`` (``out = c + a @ b``); (c,) with
  # ``in_place``: ``c += a @ b`` through a mutable ref.
  tile_group_gmem = None
  if tile_group:
    tile_group_gmem, refs = refs[0], refs[1:]
  row_ops, col_ops = refs[:n_row_ops], refs[n_row_ops:n_row_ops + n_col_ops]
  refs = refs[n_row_ops + n_col_ops:]
  if in_place:
    (c_gmem,) = refs
    out_gmem = c_gmem
  else:
    c_gmem, out_gmem = refs if len(refs) == 2 else (None, refs[0])
  out_dtype = out_gmem.dtype

  epi_m, epi_n = min(cfg.epi_tile_m, cfg.tile_m), min(cfg.epi_tile_n, cfg.tile_n)
  num_out_slots = min(2, (cfg.tile_m * cfg.tile_n) // (epi_m * epi_n))
  scratch = dict(out_smem=plgpu.SMEM(
      (cfg.num_compute_wgs, num_out_slots, epi_m, epi_n), out_dtype,
      transforms=smem_transforms(epi_n, jnp.dtype(out_dtype).itemsize)))
  if c_gmem is not None:
    scratch["c_barriers"] = plgpu.Barrier(num_barriers=cfg.num_compute_wgs)

  def store(acc, tile: mosaic_loop.Tile, vec_smem, bufs):
    """Stores the finished tile in ``epi_m x epi_n`` pieces (up to two staging
    slots per warpgroup), each through ``epilogue`` and adding ``c``."""
    wg = tile.wg
    out_smem, c_barriers = bufs["out_smem"], bufs.get("c_barriers")
    row_smem, col_smem = vec_smem[:n_row_ops], vec_smem[n_row_ops:]
    if c_gmem is None and epilogue is None:
      acc = acc.astype(out_dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    n_epi = cfg.tile_n // epi_n
    for em in range(cfg.tile_m // epi_m):
      for en in range(n_epi):
        slot = (em * n_epi + en) % num_out_slots
        window = lambda ref, em=em, en=en: (  # noqa: E731
            tile.window(ref).at[pl.ds(em * epi_m, epi_m), pl.ds(en * epi_n, epi_n)])
        part = acc[em * epi_m:(em + 1) * epi_m, en * epi_n:(en + 1) * epi_n]
        plgpu.wait_smem_to_gmem(num_out_slots - 1, wait_read_only=True)
        if epilogue is not None:
          shape = (epi_m, epi_n)
          rows = tuple(lax.broadcast_in_dim(r[wg, pl.ds(em * epi_m, epi_m)], shape, [0])
                       for r in row_smem)
          cols = tuple(lax.broadcast_in_dim(c[wg, pl.ds(en * epi_n, epi_n)], shape, [1])
                       for c in col_smem)
          col_ids = tile.col0 + en * epi_n + lax.broadcasted_iota(jnp.int32, shape, 1)
          part = epilogue(part, rows, cols, col_ids).astype(out_dtype)
        if c_gmem is not None:
          # out = c + (a @ b): one float32 add per element after the
          # complete K reduction (the bits of ``c + matmul(a, b)``).
          plgpu.copy_gmem_to_smem(window(c_gmem), out_smem.at[wg, slot], c_barriers.at[wg])
          plgpu.barrier_wait(c_barriers.at[wg])
          part = out_smem[wg, slot] + part
        out_smem[wg, slot] = part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], window(out_gmem))

  operands = (*((r, mosaic_loop.ROW) for r in row_ops),
              *((c, mosaic_loop.COL) for c in col_ops))
  mosaic_loop.persistent_matmul(
      a_gmem, b_gmem, m=m, n=n, k=k, cfg=cfg.loop, lhs_transposed=lhs_transposed,
      rhs_transposed=rhs_transposed, epilogue=store, operands=operands, scratch=scratch,
      group_rows=group_rows, group_cols=group_cols, chunks=chunks, tile_group=tile_group_gmem)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, *, out_dtype,
                   num_ctas: int | None = None) -> jax.Array:
  """``lhs [G, M, K] @ rhs [G, K, N] -> [G, M, N]`` in one launch (``G`` independent
  products, e.g. the K chunks of ``row_parallel_matmul``).

  For a 3-D ``lhs``, each product's rows are zero-padded to whole CTA tiles and stacked,
  ``[G Mp, K]``; the kernel walks the stacked rows as one ``[G Mp, N]`` output and points
  each CTA tile at its own weight (``mosaic_loop.persistent_matmul``'s ``group_rows``). A
  tile runs the instructions of ``matmul(lhs[g], rhs[g])``'s tiles: every element has its
  bits (every config gives the same bits; zero rows change no other row). ``K`` must be a
  multiple of ``TILE_K`` and ``N`` one the kernel takes (:func:`supported_shape`).

  ``lhs`` may also be ``[M, G K]``, the ``G`` products' operands side by side (the K
  chunks of one activation, as they lie in memory): the kernel reads each product's
  columns in place (``persistent_matmul``'s ``group_cols``), the same bits with no stacked
  copy. Where Mosaic's 8-row shared-memory tile cannot view ``M`` rows in place (``M``
  above 8 and not a multiple of 8, or 0) the stacked copy is made here instead.
  ``num_ctas``: the persistent grid's size (``Config.num_ctas``; the same bits).
  """
  n = rhs.shape[2]
  side_by_side = lhs.ndim == 2
  if side_by_side:
    g = rhs.shape[0]
    m, gk = lhs.shape
    k = gk // g
    if gk != g * rhs.shape[1]:
      raise ValueError(f"grouped_matmul: lhs [M, G K] needs G K = {g} x {rhs.shape[1]} "
                       f"columns, got {lhs.shape}")
    if not mosaic_loop.rows_in_place(m):
      lhs, side_by_side = lhs.reshape(m, g, k).transpose(1, 0, 2), False
  else:
    g, m, k = lhs.shape
  if rhs.shape != (g, k, n):
    raise ValueError(f"grouped_matmul: rhs must be [G, K, N] = {(g, k, n)}, got {rhs.shape}")
  # Decode-sized products (m <= 64 rows each) take the decode tile of one product: 64 x 64
  # CTA tiles, g N / 64 of them, each streaming its weight columns (the stacked rows'
  # 64 x 128 tiles would give half as many CTAs to stream the weight).
  # Products of a few hundred rows each: the tile whose waves over all G products take the
  # least time (:func:`mid_config`; numbers in benchmarks/results/gemm_h100.md).
  cfg = dataclasses.replace(default_config(m, n, k, groups=g), num_ctas=num_ctas)
  cfg = _fit_smem(cfg, jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize)
  m_pad = max(cfg.cta_tile_m, round_up(m, cfg.cta_tile_m))  # whole CTA tiles, M = 0 too
  why = supported_shape(g * m_pad, n, k, cfg, lhs_transposed=False, rhs_transposed=False)
  if why is not None:
    raise ValueError(f"det_matmul(mosaic): unsupported grouped shape: {why}")
  if side_by_side:
    a = lhs  # rows past M: TMA zeros
  else:
    a = jnp.pad(lhs, ((0, 0), (0, m_pad - m), (0, 0))) if m_pad != m else lhs
    a = a.reshape(g * m_pad, k)
  kernel = functools.partial(_kernel, m=g * m_pad, n=n, k=k, cfg=cfg, lhs_transposed=False,
                             rhs_transposed=False, group_rows=m_pad, group_cols=side_by_side)
  f = mosaic_loop.kernel(kernel, out_type=jax.ShapeDtypeStruct((g * m_pad, n), out_dtype),
                         cfg=cfg.loop, name="det_matmul_grouped")
  out = f(a, rhs.reshape(g * k, n)).reshape(g, m_pad, n)
  return out[:, :m] if m_pad != m else out


def ragged_config(rows: int, n: int, block_m: int) -> Config:
  """The free knobs of :func:`ragged_matmul` for ``rows`` laid-out rows and ``N`` columns.

  A CTA tile never spans two row blocks of ``block_m`` rows (each names its own weight), so
  CTA tiles are ``block_m`` (64) rows high. Few blocks (a decode step's assignments): 64 x 64
  CTA tiles with a deep pipeline, to spread the weight stream over the SMs; many (a
  training step's): 64 x 256 tiles of two warpgroups, each A row tile read once per 256
  columns. Every config gives the same bits."""
  tiles = -(-rows // block_m) * -(-n // 256)
  if tiles >= 2 * DEFAULT_NUM_SMS and n >= 256:
    return Config(tile_m=block_m, tile_n=128, num_compute_wgs=2, wg_split="n",
                  max_concurrent_steps=4)
  return Config(tile_m=block_m, tile_n=64, num_compute_wgs=1, wg_split="n",
                max_concurrent_steps=6)


def ragged_matmul(lhs: jax.Array, rhs: jax.Array, tile_expert: jax.Array, *,
                  rhs_transposed: bool, out_dtype, config: Config | None = None) -> jax.Array:
  """The grouped (mixture-of-experts) product on Hopper: ``out[block i] = lhs[block i] @
  op(rhs[tile_expert[i]])`` for the ``GROUPED_GEMM_BLOCK_M``-row blocks of ``lhs [P, K]``
  (the group layout's row tiles), ``rhs [E, K, N]`` (or ``[E, N, K]`` with
  ``rhs_transposed``, read in place).

  Each CTA tile reads its block's expert (``persistent_matmul``'s ``tile_group``) and runs
  the instructions of :func:`matmul`'s tiles on its rows and that expert's weight: a row's
  bits are those of ``matmul(row, rhs[e])``, whatever the other rows, their experts or the
  config. ``K`` a multiple of ``TILE_K`` and ``N`` one the kernel takes
  (:func:`supported_shape`); ``P`` a multiple of the block. ``tile_expert`` (int
  ``[P / GROUPED_GEMM_BLOCK_M]``) must lie in ``[0, E)``, as ``group_layout`` gives it: the
  kernel reads it unchecked (past the last expert TMA reads zeros). ``P = 0`` gives
  ``[0, N]``.
  """
  block_m = GROUPED_GEMM_BLOCK_M
  if not jnp.issubdtype(jnp.result_type(tile_expert), jnp.integer):
    raise TypeError(f"ragged_matmul: tile_expert must be an integer array, got "
                    f"{jnp.result_type(tile_expert)}")
  if out_dtype is None or jnp.dtype(out_dtype).name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"ragged_matmul: out_dtype must be bfloat16, float16 or float32, got "
                     f"{out_dtype!r}")
  if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype).name not in ("bfloat16", "float16"):
    raise ValueError(f"ragged_matmul: lhs and rhs must both be bfloat16 or float16 (wgmma's "
                     f"16-bit inputs), got {lhs.dtype} and {rhs.dtype}")
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"ragged_matmul: expected lhs [P, K] and rhs [E, K, N] (or [E, N, K]), "
                     f"got lhs {lhs.shape} and rhs {rhs.shape}")
  p, k = lhs.shape
  e = rhs.shape[0]
  n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
  k_w = rhs.shape[2] if rhs_transposed else rhs.shape[1]
  if k_w != k or p % block_m or jnp.shape(tile_expert) != (p // block_m,):
    raise ValueError(f"ragged_matmul: expected lhs [P, K] with P a multiple of {block_m}, rhs "
                     f"[E, K, N] (or [E, N, K] transposed) and tile_expert [P / {block_m}]; got "
                     f"lhs {lhs.shape}, rhs {rhs.shape}, tile_expert {jnp.shape(tile_expert)}")
  cfg = config or ragged_config(p, n, block_m)
  if block_m % cfg.cta_tile_m:
    raise ValueError(f"ragged_matmul: the CTA tile's {cfg.cta_tile_m} rows must divide the "
                     f"{block_m}-row blocks")
  cfg = _fit_smem(cfg, jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize)
  why = supported_shape(p, n, k, cfg, lhs_transposed=False, rhs_transposed=rhs_transposed)
  if why is not None:
    raise ValueError(f"ragged_matmul: unsupported shape: {why}")
  if p == 0:  # no assignments (an empty batch): no tile to run
    return jnp.zeros((0, n), out_dtype)
  b = rhs.reshape(e * n, k) if rhs_transposed else rhs.reshape(e * k, n)
  kernel = functools.partial(_kernel, m=p, n=n, k=k, cfg=cfg, lhs_transposed=False,
                             rhs_transposed=rhs_transposed, group_rows=block_m,
                             tile_group=True)
  f = mosaic_loop.kernel(kernel, out_type=jax.ShapeDtypeStruct((p, n), out_dtype),
                         cfg=cfg.loop, name="ragged_matmul_mosaic")
  return f(lhs, b, jnp.asarray(tile_expert, jnp.int32))


def chunk_tree_matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None, *, chunks: int,
                      out_dtype, config: Config | None = None) -> jax.Array:
  """The row-parallel product in one launch: ``lhs [M, C Kc]`` (the ``C`` K chunks side by
  side), ``rhs [C Kc, N]`` -> ``[M, N]`` in ``out_dtype``:
  ``(((P0 + P1) + (P2 + P3)) + ...) + bias``, one rounding, ``P_c = lhs_c @ rhs_c`` each the
  instructions of ``matmul`` on that chunk (``mosaic_loop.persistent_matmul``'s
  ``chunks``), its K zero-padded to whole ``TILE_K`` tiles: the bits of the (padded) chunk
  products summed by ``row_parallel.pairwise_tree``, with no float32 partials in memory.

  ``Kc`` a multiple of ``TILE_K``, or of 16: then the kernel reads the chunks in place
  through chunk views (``persistent_matmul``; no padded copy of ``lhs``), in K steps of
  ``mosaic_loop.chunk_step(Kc)`` columns."""
  k = lhs.shape[1]
  if rhs.shape[0] != k or k % (chunks * 16):
    raise ValueError(f"chunk_tree_matmul: rhs must be [{k}, N] and K ({k}) {chunks} chunks "
                     f"of a multiple of 16, got rhs {rhs.shape}")
  # 128 x 128 CTA tiles, 64 x 128 accumulators per warpgroup: the pending tiles of the two
  # lowest tree levels in registers, the others (one for 8 chunks) in shared memory next
  # to 4 pipeline stages. The CTAs walk M-minor in bands of 4 row tiles, so the SMs in
  # flight share their A rows in L2 (walking down one column of tiles at a time would
  # re-read every A row once per column tile).
  # Chunk views step 32 or 16 columns: as many more stages keep the same bytes in flight
  # (4 to 16 stages measured the same at down_proj's views).
  steps = 4 * TILE_K // mosaic_loop.chunk_step(k // chunks)
  cfg = config or Config(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="m",
                               max_concurrent_steps=steps, grid_minor="m", grid_tile_width=4,
                               tree_registers=2)
  if bias is None:
    return matmul(lhs, rhs, lhs_transposed=False, rhs_transposed=False, out_dtype=out_dtype,
                  config=cfg, chunks=chunks)
  return matmul(lhs, rhs, lhs_transposed=False, rhs_transposed=False, out_dtype=out_dtype,
                config=cfg, chunks=chunks, col_operands=(bias.astype(jnp.float32),),
                epilogue=lambda z, rows, cols, ids: z + cols[0])


def _fit_smem(cfg: Config, itemsize: int, out_itemsize: int,
              chunks: int = 1, tile_k: int = TILE_K) -> Config:
  """Lowers the pipeline depth until the CTA's buffers (K steps of ``tile_k`` columns; with
  ``chunks``, the chunk tree's pending tiles kept in shared memory) fit in shared memory."""
  epi = min(cfg.epi_tile_m, cfg.tile_m) * min(cfg.epi_tile_n, cfg.tile_n)
  slots = min(2, (cfg.tile_m * cfg.tile_n) // epi)
  out_bytes = cfg.num_compute_wgs * slots * epi * out_itemsize
  smem_levels = max(0, chunks.bit_length() - 1 - cfg.tree_registers)
  out_bytes += cfg.num_compute_wgs * smem_levels * cfg.tile_m * cfg.tile_n * 4
  steps = mosaic_loop.pipeline_depth(cfg.loop, itemsize, out_bytes, tile_k)
  return dataclasses.replace(cfg, max_concurrent_steps=steps)


def supported_shape(m: int, n: int, k: int, cfg: Config, *, lhs_transposed: bool,
                    rhs_transposed: bool) -> str | None:
  """None when the kernel can run this shape, else the reason it cannot.

  Mosaic's TMA tiling needs every dimension that is the minor (contiguous)
  dimension of a swizzled tile to be a multiple of 64 elements, and operands
  at least one CTA tile wide. Row counts are padded to multiples of 8 by
  ``matmul`` itself. Callers route other shapes to the Triton kernel by N and
  K only (fixed for a given weight), never by M.
  """
  if k < TILE_K or k % TILE_K:
    return f"K={k} is not a positive multiple of {TILE_K}"
  if k % cfg.tile_k:
    return f"K={k} is not a multiple of the config's K step {cfg.tile_k}"
  if n < cfg.cta_tile_n or n % 64:
    return f"N={n} is not a multiple of 64 of at least the CTA tile {cfg.cta_tile_n}"
  if lhs_transposed and (m < cfg.cta_tile_m or m % 64):
    return f"transposed lhs: M={m} is not a multiple of 64 of at least {cfg.cta_tile_m}"
  return None


def matmul(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
           out_dtype, config: Config | None = None,
           acc: jax.Array | None = None, epilogue=None, row_operands=(),
           col_operands=(), chunks: int = 1) -> jax.Array:
  """``op(lhs) @ op(rhs)`` on Hopper; shapes as in ``gemm_triton.matmul``.

  With ``acc`` (float32 ``[M, N]``, and ``out_dtype`` float32) the result is
  ``acc + op(lhs) @ op(rhs)``, bitwise ``acc + matmul(lhs, rhs)``: the epilogue
  adds the ``acc`` tile once to the finished float32 product, so a running sum
  needs no separate product buffer or add pass.

  With ``epilogue`` the stored tile is ``epilogue(z, rows, cols, col_ids)``
  for the finished float32 product tile ``z`` ``[tm, tn]``: ``rows`` holds the
  ``row_operands`` (each ``[M]``) and ``cols`` the ``col_operands`` (each
  ``[N]``) broadcast to the tile, ``col_ids`` the int32 global column index.
  Elementwise by contract: a row's outputs depend on its own row only.

  Rows the TMA tiling cannot take are zero-padded: a non-transposed lhs up to
  a multiple of 8 rows (and at least one CTA tile), and for a transposed lhs
  (the weight gradient) the reduction rows of both operands. Zero rows never
  change other rows' bits, and zero reduction terms add exactly 0. The output
  (and ``acc``) keep the rows TMA can take in place (``mosaic_loop.stored_rows``:
  a decode step's ``M < 8``, or a multiple of 8): the stores of the padding rows are
  clipped, so a product of fewer rows than a CTA tile writes (and reads back) no
  padding rows.
  """
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  if lhs_transposed:
    # The reduction runs over lhs rows (tokens); the K tile applies to them.
    k_red = k
    if k_red % TILE_K:
      k_pad = round_up(k_red, TILE_K)
      lhs = jnp.pad(lhs, ((0, k_pad - k_red), (0, 0)))
      rhs = jnp.pad(rhs, ((0, k_pad - k_red), (0, 0)) if not rhs_transposed else
                    ((0, 0), (0, k_pad - k_red)))
      k = k_pad
  # Chunks off the K tile run through chunk views (chunk_tree_matmul); the shape checks see
  # the zero-padded K whose instructions they run.
  tile_k = mosaic_loop.chunk_step(k // chunks) if chunks > 1 else TILE_K
  views = tile_k != TILE_K
  cfg = config or default_config(m, n, k)
  if chunks == 1:
    tile_k = cfg.tile_k
  cfg = _fit_smem(cfg, jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize, chunks,
                  tile_k)
  why = supported_shape(m, n, chunks * round_up(k // chunks, TILE_K) if views else k, cfg,
                        lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed)
  if why is not None:
    raise ValueError(f"det_matmul(mosaic): unsupported shape: {why}")
  if acc is not None and (acc.shape != (m, n) or acc.dtype != jnp.float32
                          or jnp.dtype(out_dtype) != jnp.float32):
    raise ValueError(f"det_matmul(mosaic): acc must be float32 {(m, n)} with a float32 output, "
                     f"got {acc.dtype} {acc.shape} and out_dtype {jnp.dtype(out_dtype)}")
  m_run = m_out = m  # the kernel's rows (lhs, row operands) and the output's
  if not lhs_transposed:
    m_run = max(cfg.cta_tile_m, round_up(m, 8))
    m_out = mosaic_loop.stored_rows(m)
    if m_run != m:
      lhs = jnp.pad(lhs, ((0, m_run - m), (0, 0)))
      row_operands = tuple(jnp.pad(r, (0, m_run - m)) for r in row_operands)
    if acc is not None and m_out != m:
      acc = jnp.pad(acc, ((0, m_out - m), (0, 0)))
  for r in row_operands:
    if r.shape != (m_run,):
      raise ValueError(f"det_matmul(mosaic): row operands must be [{m}], got {r.shape}")
  for c in col_operands:
    if c.shape != (n,):
      raise ValueError(f"det_matmul(mosaic): column operands must be [{n}], got {c.shape}")
  if views:  # [M, C, Kc] and [C, Kc, N]: reshapes, no copies
    lhs = lhs.reshape(m_run, chunks, k // chunks)
    rhs = rhs.reshape(chunks, k // chunks, n)
  kernel = functools.partial(_kernel, m=m_run, n=n, k=k, cfg=cfg,
                             lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed,
                             n_row_ops=len(row_operands), n_col_ops=len(col_operands),
                             epilogue=epilogue, chunks=chunks)
  vec = (*row_operands, *col_operands)
  if acc is not None and hasattr(jax, "new_ref"):
    # In place through a mutable ref (jax >= 0.11): the kernel's output aliases
    # ``acc``, so a running sum in a loop needs one [M, N] buffer, not two.
    acc_ref = jax.new_ref(acc)
    in_place = pl.kernel(functools.partial(kernel, in_place=True), out_type=(),
                         mesh=mosaic_loop.mesh(cfg.loop), compiler_params=mosaic_warpgroup_params(),
                         name="det_matmul_acc")
    in_place(lhs, rhs, *vec, acc_ref)
    out = jax.freeze(acc_ref)
    return out[:m] if m_out != m else out
  f = mosaic_loop.kernel(kernel, out_type=jax.ShapeDtypeStruct((m_out, n), out_dtype),
                         cfg=cfg.loop,
                         name=f"det_matmul_k{k}_n{n}" if acc is None else "det_matmul_acc")
  out = f(lhs, rhs, *vec) if acc is None else f(lhs, rhs, *vec, acc)
  return out[:m] if m_out != m else out
