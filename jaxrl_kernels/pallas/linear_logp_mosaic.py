"""Fused LM-head forward for Hopper in Pallas Mosaic GPU: wgmma logits, softmax-partials epilogue.

The main loop is ``gemm_mosaic``'s (:func:`mosaic_loop.persistent_matmul`:
persistent grid, one TMA memory warpgroup and ``num_wgs`` (two by default) wgmma
compute warpgroups, ``TILE_K = 64`` ascending over H); its epilogue here computes
the per-vocab-tile partials of :func:`linear_logp_fwd.tile_partials` instead of
storing the tile. A CTA owns ``tile_m`` token rows and ``num_wgs`` vocab tiles
(``num_wgs * VOCAB_TILE`` columns); compute warpgroup ``g`` holds the float32
accumulator of vocab tile ``num_wgs n + g`` (``[tile_m, VOCAB_TILE]``, wgmma register
layout) and reduces it, ``EPI_ROWS`` rows at a time, with :func:`tile_epilogue`:

    z   = (acc + b) / temperature,  -inf on columns >= valid_vocab
    m   = max_v z_v,  s = sum_v exp(z_v - m),  u = sum_v exp(z_v - m) (z_v - m)
    tz  = z[t]  if the row's target t is in this tile, else 0 (an exact masked sum)

The four ``[EPI_ROWS]`` row vectors go through shared memory to ``[n_tiles,
T]`` outputs by TMA. ``tz`` is a per-tile array with exactly one non-zero
term per row, summed over tiles (exact in any order).

Bits: each logit is the wgmma accumulation over ascending 64-wide K tiles
(``gemm_mosaic``'s contract: independent of M, N, the tile position and the
CTA walk), and each row's reductions run on one ``[EPI_ROWS, VOCAB_TILE]``
array in the wgmma layout, whose per-row reduction tree (a fixed per-thread
order, then a fixed 4-lane shuffle) is the same for every row. So a row's
partials depend only on its own hidden row, the tile's weight columns and
the constants: not on T, its position, other rows, ``tile_m`` or the vocab
shard holding the tile (tested bitwise). The bits differ from the Triton
kernel's (another GEMM and another reduction layout).

Sampler side (``nn.lm_head``): :func:`logits` runs the same kernel with a
store epilogue (the ``z`` above, before the mask) and :func:`partials_from_logits`
loads logit tiles into the same register layout and runs the same
:func:`tile_epilogue`, so ``logits -> logp`` is bitwise the fused result.
:func:`logits_draw` stores no logits: the same epilogue also runs the race of
:mod:`draw` on the exponentials it computes (three more row vectors per tile: the
best race key, its column, its logit) and the tiles' races are merged after the
kernel, so a sampler step draws its token with no ``[T, V]`` array in memory.

Shapes Mosaic's TMA tiling cannot take (H not a multiple of 64, vocab extent
not a multiple of 64 for ``"hv"`` / 8 for ``"vh"``, fewer than one CTA tile of
rows or columns, T not a multiple of 8) are zero-padded (a copy); padding
columns are masked and padding rows dropped, so the bits do not change.
LM heads in practice (H = 4096, V = 151936, T % 8 = 0) are read in place, and
so are a decode step's hidden rows with ``Config.hidden_in_place`` (the TMA
box reads zeros past them). The stored logits keep the rows TMA takes in place
(``mosaic_loop.stored_rows``: a decode step's ``T < 8``, or a multiple of 8): the stores
of the CTA tile's padding rows are clipped, so a decode step writes no
``[padding rows, V]`` logits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels import contract
from jaxrl_kernels.pallas import _common, draw, mosaic_loop
from jaxrl_kernels.pallas import softmax_partials as sp

TILE_K = contract.GEMM_TILE_K
VOCAB_TILE = contract.VOCAB_TILE
# Rows reduced at once by tile_epilogue (see contract.EPI_ROWS); both kernels use it.
EPI_ROWS = contract.EPI_ROWS
# Row statistics leave the kernels as [EPI_ROWS, PACK] float32 arrays in the wgmma layout
# (a 2-D store; storing the [EPI_ROWS] row vectors to shared memory directly gave wrong
# rows on jax 0.11.2): columns 4 c .. 4 c + 3 hold (m, s, u, tz) of the c-th 64-row chunk
# of a 128-row CTA tile. See _unpack.
PACK = 8
DRAW_PACK = 16  # with a draw: seven statistics per 64-row chunk, in 8 columns


@dataclasses.dataclass(frozen=True)
class Config:
  """Free knobs: none changes a row's bits (tests/linear_logp/test_linear_logp_mosaic_gpu.py).

  Attributes:
    tile_m: token rows per CTA (64 or 128).
    max_concurrent_steps: TMA pipeline depth (lowered to fit shared memory).
    grid_minor: the faster index of the persistent CTA walk ("m" or "n").
    grid_tile_width: band width of the snake walk (L2 reuse).
    num_wgs: compute warpgroups per CTA (1 or 2), one vocab tile each: each vocab tile's
      logits and statistics are one warpgroup's whatever the CTA holds.
    tile_k: hidden columns per pipeline step, a multiple of ``TILE_K`` (the same k16
      instructions in the same order into the same accumulator, fewer waits between them;
      ``mosaic_loop``). A call whose padded H is not a multiple of it is refused by name.
    hidden_in_place: the logits' (:func:`logits`) hidden rows, fewer than a CTA tile, are
      read in place where TMA takes them (``mosaic_loop.rows_in_place``): the box reads
      zeros past them, so no padded copy of the rows is made. Otherwise they are
      zero-padded to the CTA tile. The partials and the draw refuse it by name.
    num_ctas: the persistent grid's size (None: one CTA per SM; ``mosaic_loop.LoopConfig``):
      the same bits at every size.
  """

  tile_m: int = 128
  max_concurrent_steps: int = 4
  grid_minor: str = "m"
  grid_tile_width: int = 8
  num_wgs: int = 2
  tile_k: int = TILE_K
  hidden_in_place: bool = False
  num_ctas: int | None = None

  def __post_init__(self):
    _common.check_num_ctas("linear_logp_mosaic.Config", self.num_ctas)
    if not isinstance(self.hidden_in_place, bool):
      raise ValueError(f"linear_logp_mosaic.Config: hidden_in_place must be a bool, got "
                       f"{self.hidden_in_place!r}")
    if self.num_wgs not in (1, 2):
      raise ValueError(f"linear_logp_mosaic.Config: num_wgs must be 1 or 2, got {self.num_wgs!r}")
    if (not isinstance(self.tile_k, int) or isinstance(self.tile_k, bool)
        or self.tile_k < TILE_K or self.tile_k % TILE_K):
      raise ValueError(f"linear_logp_mosaic.Config: tile_k must be a positive multiple of "
                       f"{TILE_K}, got {self.tile_k!r}")

  @property
  def cta_n(self) -> int:
    """The CTA's vocabulary columns: ``num_wgs`` vocab tiles."""
    return self.num_wgs * VOCAB_TILE

  @property
  def loop(self) -> mosaic_loop.LoopConfig:
    """The main loop: ``num_wgs`` compute warpgroups side by side in N, one vocab tile each."""
    return mosaic_loop.LoopConfig(
        tile_m=self.tile_m, tile_n=VOCAB_TILE, num_compute_wgs=self.num_wgs, wg_split="n",
        max_concurrent_steps=self.max_concurrent_steps, grid_minor=self.grid_minor,
        grid_tile_width=self.grid_tile_width, tile_k=self.tile_k, num_ctas=self.num_ctas)


def decode_config(rows: int, hidden: int, layout: str, *,
                  draws: bool = False) -> Config | None:
  """The sampler head's config at a decode step's few rows (``rows <= 64``), else None.

  64-row CTAs halve the padding rows' tensor-core work and logit stores (numbers:
  ``benchmarks/results/head_decode.md``):

  * the logits of an ``"hv"`` weight ``[H, V]``: two warpgroups (a 256-column CTA tile,
    512-byte runs of each weight row) with the hidden rows read in place;
  * otherwise (the ``"vh"`` weight ``[V, H]``, a tied embedding, whose CTA tile is one
    contiguous block; and the draw): where the padded hidden size allows, CTAs of one vocab
    tile stepping 128 hidden columns (one warpgroup's registers, the draw's most live
    values).

  Free knobs: the same bits (``tests/linear_logp/test_linear_logp_mosaic_gpu.py``).
  """
  if rows > 64:
    return None
  if layout == "hv" and not draws:
    return Config(tile_m=64, hidden_in_place=True)
  if _common.round_up(hidden, TILE_K) % (2 * TILE_K):
    return Config(tile_m=64)
  return Config(tile_m=64, num_wgs=1, tile_k=2 * TILE_K)


def tile_epilogue(z, col_ids, tg, *, valid_vocab: int, keys=None, entropy: bool = True):
  """Per-row ``(m, s, u, tz)`` of one float32 logits tile ``z [EPI_ROWS, VOCAB_TILE]``.

  ``col_ids``: int32 local column index per element; ``tg``: int32 ``[rows]``
  local target ids (anything when not in the tile), or None for rows without targets
  (the logits, the draw): ``tz`` is then 0, the value the masked sum gives a row whose
  target is elsewhere, without the reduction. Columns ``>= valid_vocab``
  are masked to -inf. The one definition shared by the fused kernel and the
  from-logits kernel: the same ops on the same register layout.

  With ``keys`` (the rows' two draw key words, ``[rows]`` int32 each), also the tile's
  draw ``(key, col, logit)`` (:func:`draw.tile_draw`) from the same exponentials:
  seven statistics.

  ``entropy=False``: ``u`` is zeros, not reduced (``m``, ``s`` and ``tz`` keep their
  bits): for callers that return no entropy. The column mask stays on every tile, also
  where every column is valid: its select rounds ``z`` before ``z - m``, which the
  compiler would otherwise contract with a temperature's multiply into one FMA (other bits
  than the sampler's, whose ``z`` comes from memory, on Hopper).
  """
  col_ok = col_ids < valid_vocab
  if keys is None:
    z, m, s, u = sp.tile_stats_2d(z, col_ok, entropy=entropy)
  else:
    z, m, s, u, e = sp.tile_stats_2d(z, col_ok, with_exp=True, entropy=entropy)
  if tg is None:  # rows without targets (the logits, the draw): no target logit to reduce
    tz = jnp.zeros_like(m)
  else:
    tg = jnp.where(tg < valid_vocab, tg, -1)  # a target in a masked column has no logit here
    tz = sp.target_logit(z, col_ids == lax.broadcast_in_dim(tg, z.shape, [0]))
  if keys is None:
    return m, s, u, tz
  k1, k2 = (lax.broadcast_in_dim(k, z.shape, [0]) for k in keys)
  return (m, s, u, tz, *draw.tile_draw(z, m, e, col_ids, k1, k2))


def _pack(packed, pack_ids, stats, c: int):
  """Puts chunk ``c``'s ``[EPI_ROWS]`` row statistics (four, or seven with a draw) in
  columns ``w c ..``, ``w`` = :func:`_width` of their count."""
  w = _width(len(stats))
  for q, vec in enumerate(stats):
    packed = jnp.where(pack_ids == w * c + q, lax.broadcast_in_dim(vec, packed.shape, [0]),
                       packed)
  return packed


def _width(count: int) -> int:
  """Packed columns per 64-row chunk for ``count`` statistics: 4, or 8 (seven with a draw)."""
  return 4 if count <= 4 else 8


def _unpack(packed, n_tiles: int, t: int, tm: int, count: int = 4):
  """``[n, blocks * EPI_ROWS, PACK or DRAW_PACK]`` packed statistics -> ``count`` arrays
  (``(m, s, u, tz_per_tile)``, then a draw's ``(key, col, logit)``), each ``[n_tiles, t]``:
  row ``blk * tm + 64 c + r`` sits at ``[:, blk * 64 + r, w c + q]``."""
  n, rows, width = packed.shape
  w = _width(count)
  nc = tm // EPI_ROWS
  x = packed[:n_tiles].reshape(n_tiles, rows // EPI_ROWS, EPI_ROWS, width // w, w)[:, :, :, :nc]
  x = x.transpose(4, 0, 1, 3, 2).reshape(w, n_tiles, (rows // EPI_ROWS) * nc * EPI_ROWS)
  return tuple(x[q, :, :t] for q in range(count))


def _kernel(h_gmem, w_gmem, *refs, m, n, k, hv: bool, has_bias: bool, has_temp: bool,
            store_logits: bool, stats: bool, valid_vocab: int, cfg: Config,
            draws: bool = False, has_targets: bool = False, entropy: bool = True):
  refs = list(refs)
  b_gmem = refs.pop(0) if has_bias else None
  # The temperature arrives as a [VOCAB_TILE] row, fetched like the bias.
  t_gmem = refs.pop(0) if has_temp else None
  # The rows' target ids (tile_partials); the logits and the draw have none: their rows
  # take -1, a constant in registers (no target in any tile), in the same epilogue code.
  tg_gmem = refs.pop(0) if has_targets else None
  k1_gmem = refs.pop(0) if draws else None  # the rows' draw key words
  k2_gmem = refs.pop(0) if draws else None
  z_gmem = refs.pop(0) if store_logits else None
  # Epilogue operands, fetched during the main loop: the rows' target ids (with
  # has_targets), the draw keys, the tile's bias and the temperature row.
  names, operands = [], []
  for name, ref, kind in (("tg", tg_gmem, mosaic_loop.ROW), ("k1", k1_gmem, mosaic_loop.ROW),
                          ("k2", k2_gmem, mosaic_loop.ROW), ("bias", b_gmem, mosaic_loop.COL),
                          ("temp", t_gmem, mosaic_loop.WHOLE)):
    if ref is not None:
      names.append(name)
      operands.append((ref, kind))
  outs = refs  # [packed statistics] when stats
  tm = cfg.tile_m
  pack = DRAW_PACK if draws else PACK
  scratch = {}
  if store_logits:
    scratch["z_smem"] = plgpu.SMEM((cfg.num_wgs, EPI_ROWS, VOCAB_TILE), jnp.float32)
  if stats:
    scratch["out_smem"] = plgpu.SMEM((cfg.num_wgs, EPI_ROWS, pack), jnp.float32)

  def partials(acc, tile: mosaic_loop.Tile, vec_smem, bufs):
    """Reduces the warpgroup's [tm, VOCAB_TILE] logits tile to packed row statistics,
    EPI_ROWS rows at a time, storing the logits on the way when asked."""
    wg, row0, col0 = tile.wg, tile.row0, tile.col0
    vecs = dict(zip(names, vec_smem))
    z_smem, out_smem = bufs.get("z_smem"), bufs.get("out_smem")
    shape = (EPI_ROWS, VOCAB_TILE)
    col_ids = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    bias_row = None
    if "bias" in vecs:
      bias_row = lax.broadcast_in_dim(vecs["bias"][wg], shape, [1])
    temp_row = None
    if "temp" in vecs:
      temp_row = lax.broadcast_in_dim(vecs["temp"][wg], shape, [1])
    # The previous tile's stores must have read the staging buffer.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    pack_ids = lax.broadcasted_iota(jnp.int32, (EPI_ROWS, pack), 1)
    packed = jnp.zeros((EPI_ROWS, pack), jnp.float32)
    for c in range(tm // EPI_ROWS):
      rows = pl.ds(c * EPI_ROWS, EPI_ROWS)
      z = sp.scale_logits(acc[c * EPI_ROWS:(c + 1) * EPI_ROWS], bias_row, temp_row)
      if store_logits:
        if c:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        z_smem[wg] = z
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            z_smem.at[wg],
            z_gmem.at[pl.ds(row0 + c * EPI_ROWS, EPI_ROWS), pl.ds(col0, VOCAB_TILE)])
      if stats:
        keys = (vecs["k1"][wg, rows], vecs["k2"][wg, rows]) if draws else None
        tg = vecs["tg"][wg, rows] if has_targets else None
        row_stats = tile_epilogue(z, col_ids, tg, valid_vocab=valid_vocab, keys=keys,
                                  entropy=entropy)
        packed = _pack(packed, pack_ids, row_stats, c)
    if stats:
      out_smem[wg] = packed
      plgpu.commit_smem()
      vocab_tile = tile.ni * cfg.num_wgs + wg
      plgpu.copy_smem_to_gmem(out_smem.at[wg],
                              outs[0].at[vocab_tile, pl.ds(tile.mi * EPI_ROWS, EPI_ROWS), :])

  mosaic_loop.persistent_matmul(
      h_gmem, w_gmem, m=m, n=n, k=k, cfg=cfg.loop, lhs_transposed=False, rhs_transposed=not hv,
      epilogue=partials, operands=operands, scratch=scratch)


def _fit(cfg: Config, itemsize: int, *, store_logits: bool,
         stats: bool, draws: bool = False, targets: bool = False) -> Config:
  """Lowers the pipeline depth until the CTA's buffers fit in shared memory."""
  wgs = cfg.num_wgs
  extra = 2 * wgs * VOCAB_TILE * 4  # bias and temperature rows
  if store_logits:
    extra += wgs * EPI_ROWS * VOCAB_TILE * 4
  if stats:  # the rows' target ids (with targets) and the packed statistics' staging tile
    extra += wgs * ((cfg.tile_m if targets else 0) + EPI_ROWS * PACK) * 4
  if draws:  # the rows' two key words, and the packed draw's wider statistics
    extra += wgs * (2 * cfg.tile_m + EPI_ROWS * (DRAW_PACK - PACK)) * 4
  steps = mosaic_loop.pipeline_depth(cfg.loop, itemsize, extra, tile_k=cfg.tile_k)
  need = steps * (cfg.loop.cta_tile_m + cfg.loop.cta_tile_n) * cfg.tile_k * itemsize + extra
  if need > mosaic_loop.SMEM_BUDGET:
    raise ValueError(f"linear_logp_mosaic.Config: {cfg} needs {need} bytes of shared memory at "
                     f"{steps} pipeline stages (at most {mosaic_loop.SMEM_BUDGET}); take a "
                     f"smaller tile_k, tile_m or num_wgs")
  return dataclasses.replace(cfg, max_concurrent_steps=steps)


def supported(compute_dtype) -> bool:
  """Whether the Mosaic forward takes this compute dtype (bf16/fp16; fp32 heads use Triton)."""
  return jnp.dtype(compute_dtype).name in ("bfloat16", "float16")


def _no_hidden_in_place(op: str, cfg: Config) -> None:
  if cfg.hidden_in_place:
    raise ValueError(f"{op}(mosaic): Config.hidden_in_place is for the logits "
                     f"(head_logits) only; {op} reads its hidden rows padded")


def _prepare(hidden, weight, bias, layout: str, compute_dtype, tm: int, cta_n: int,
             hidden_in_place: bool = False):
  """Casts to the compute dtype and zero-pads what TMA tiling cannot take (see module doc).

  Returns ``(hidden, weight, bias_f32_or_None, m_run, n_run)``: ``m_run`` (a multiple of 8,
  at least one CTA tile) is the kernel's row extent. ``hidden`` has ``m_run`` rows, or with
  ``hidden_in_place`` its own rows where TMA takes them (``mosaic_loop.rows_in_place``).
  """
  hv = layout == "hv"
  t, h = hidden.shape
  v = weight.shape[1] if hv else weight.shape[0]
  hidden = hidden.astype(compute_dtype)
  weight = weight.astype(compute_dtype)
  h_run = _common.round_up(h, TILE_K)
  m_run = max(tm, _common.round_up(t, 8))
  m_in = t if hidden_in_place and mosaic_loop.rows_in_place(t) else m_run
  n_run = max(cta_n, _common.round_up(v, 64 if hv else 8))
  if (m_in, h_run) != (t, h):
    hidden = jnp.pad(hidden, ((0, m_in - t), (0, h_run - h)))
  if (n_run, h_run) != (v, h):
    pads = ((0, h_run - h), (0, n_run - v)) if hv else ((0, n_run - v), (0, h_run - h))
    weight = jnp.pad(weight, pads)
  if bias is not None:
    bias = jnp.pad(bias.astype(jnp.float32), (0, n_run - v))
  return hidden, weight, bias, m_run, n_run


def _call(hidden, weight, bias, extra, *, layout, temperature, valid_vocab, m_run, n_run,
          store_logits, stats, cfg: Config, out_type, draws: bool = False,
          has_targets: bool = False, entropy: bool = True):
  """``extra``: the row operands after the bias and temperature: the rows' target ids
  (``has_targets``), then the draw's two key words (``draws``)."""
  k = hidden.shape[1]
  if k % cfg.tile_k:
    raise ValueError(f"linear_logp_mosaic.Config: tile_k ({cfg.tile_k}) must divide the "
                     f"hidden size padded to {TILE_K} columns ({k})")
  temp = sp.temperature_operand(temperature)
  kernel = functools.partial(
      _kernel, m=m_run, n=n_run, k=k, hv=layout == "hv", has_bias=bias is not None,
      has_temp=temp is not None, store_logits=store_logits, stats=stats,
      valid_vocab=valid_vocab, cfg=cfg, draws=draws, has_targets=has_targets,
      entropy=entropy)
  name = ("lm_head_draw" if draws else "lm_head_logits" if store_logits
          else "linear_logp_tiles")
  f = mosaic_loop.kernel(kernel, out_type=out_type, cfg=cfg.loop, name=name)
  vecs = [x for x in (bias, None if temp is None else jnp.broadcast_to(temp, (VOCAB_TILE,)))
          if x is not None]
  return f(hidden, weight, *vecs, *extra)


def tile_partials(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, layout: str, temperature, compute_dtype,
                  vocab_offset: int = 0, valid_vocab: int | None = None,
                  config: Config | None = None, entropy: bool = True):
  """:func:`linear_logp_fwd.tile_partials` (same arguments, outputs and meaning) on Hopper.

  Args:
    hidden2d: ``[T, H]``; weight ``[H, V]`` (``"hv"``) or ``[V, H]`` (``"vh"``);
      bias ``[V]`` or None; targets ``[T]`` int32 global ids.
    compute_dtype: bfloat16 or float16 (accumulation is float32).
    vocab_offset, valid_vocab: this weight's first global id; local columns
      ``>= valid_vocab`` are masked to -inf.
    entropy: False when the caller returns no entropy: ``u`` is then zeros, not reduced
      (``m``, ``s`` and the target logit keep their bits).

  Returns:
    ``(m, s, u, target_logit)``: float32 ``[ceil(V / VOCAB_TILE), T]`` each, and
    ``[T]`` (exactly 0 where this weight does not own the row's target).
  """
  if not supported(compute_dtype):
    raise TypeError(f"linear_logp(mosaic): compute dtype must be bfloat16 or float16, got "
                    f"{jnp.dtype(compute_dtype).name}")
  cfg = config or Config()
  _no_hidden_in_place("linear_logp", cfg)
  t = hidden2d.shape[0]
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  n_tiles = pl.cdiv(v, VOCAB_TILE)
  itemsize = jnp.dtype(compute_dtype).itemsize
  cfg = _fit(cfg, itemsize, store_logits=False, stats=True, targets=True)
  h2, w2, b2, m_run, n_run = _prepare(hidden2d, weight, bias, layout, compute_dtype,
                                      cfg.tile_m, cfg.cta_n)
  tg = jnp.pad(targets.astype(jnp.int32) - jnp.int32(vocab_offset), (0, m_run - t))
  n_pad = pl.cdiv(n_run, cfg.cta_n) * cfg.num_wgs  # the last CTA may hold a tile past V
  m_iters = pl.cdiv(m_run, cfg.tile_m)
  packed = _call(
      h2, w2, b2, (tg,), layout=layout, temperature=temperature,
      valid_vocab=v if valid_vocab is None else valid_vocab, m_run=m_run, n_run=n_run,
      store_logits=False, stats=True, cfg=cfg, has_targets=True, entropy=entropy,
      out_type=(jax.ShapeDtypeStruct((n_pad, m_iters * EPI_ROWS, PACK), jnp.float32),))[0]
  m, s, u, tzp = _unpack(packed, n_tiles, t, cfg.tile_m)
  # One non-zero term per row (the owning tile's), so the sum is exact in any order.
  tz = jnp.sum(tzp, axis=0)
  return m, s, u, tz


def logits(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None, *, layout: str,
           temperature, compute_dtype, return_stats: bool = False,
           config: Config | None = None):
  """Float32 ``[T, V]`` logits ``(h W + b) / temperature``: bitwise the ``z`` that
  :func:`tile_partials` reduces (the same kernel, with a store epilogue).

  With ``return_stats``, also ``(m, s, u)`` (``[n_tiles, T]`` each), reduced
  from the same accumulator registers by the same :func:`tile_epilogue` as in
  :func:`tile_partials`, in the same kernel: the sampler's entropy is then the
  fused op's by construction (the from-logits kernel, whose logits come from
  memory in another kernel, gave a last-bit difference on a few rows).
  """
  if not supported(compute_dtype):
    raise TypeError(f"head_logits(mosaic): compute dtype must be bfloat16 or float16, got "
                    f"{jnp.dtype(compute_dtype).name}")
  t = hidden2d.shape[0]
  cfg = config or decode_config(t, hidden2d.shape[1], layout) or Config(tile_m=128)
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  n_tiles = pl.cdiv(v, VOCAB_TILE)
  cfg = _fit(cfg, jnp.dtype(compute_dtype).itemsize, store_logits=True, stats=return_stats)
  h2, w2, b2, m_run, n_run = _prepare(hidden2d, weight, bias, layout, compute_dtype,
                                      cfg.tile_m, cfg.cta_n, cfg.hidden_in_place)
  n_out = _common.round_up(n_run, 32)  # TMA: the f32 tile's smem tiling is (8, 32)
  # The padding rows' stores are clipped (see the module doc).
  m_out = mosaic_loop.stored_rows(t)
  out_type = [jax.ShapeDtypeStruct((m_out, n_out), jnp.float32)]
  if return_stats:
    # No row has a target (tz unused): the same epilogue code as tile_partials.
    n_pad = pl.cdiv(n_run, cfg.cta_n) * cfg.num_wgs
    m_iters = pl.cdiv(m_run, cfg.tile_m)
    out_type.append(jax.ShapeDtypeStruct((n_pad, m_iters * EPI_ROWS, PACK), jnp.float32))
  outs = _call(h2, w2, b2, (), layout=layout, temperature=temperature, valid_vocab=v,
               m_run=m_run, n_run=n_run, store_logits=True,
               stats=return_stats, cfg=cfg, out_type=tuple(out_type))
  z = outs[0]
  z = z[:t, :v] if (m_out, n_out) != (t, v) else z
  if not return_stats:
    return z
  m, s, u, _ = _unpack(outs[1], n_tiles, t, cfg.tile_m)
  return z, (m, s, u)


def logits_draw(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None,
                seed: jax.Array, *, layout: str, temperature, compute_dtype,
                config: Config | None = None):
  """A token per row drawn from ``softmax((h W + b) / temperature)`` in the LM head's
  epilogue, with the per-tile statistics of :func:`logits` (``return_stats``): no logits
  reach memory.

  Each CTA's epilogue reduces its logit tiles to the softmax statistics of
  :func:`tile_epilogue` and the race of :mod:`draw` (noise keyed by ``seed``, int32
  ``[2]``, and the row index); the tiles' races are merged here (:func:`draw.merge_draws`).
  The statistics are bitwise those of :func:`logits` (the same epilogue code on the same
  registers), and the drawn token's logit is the one the fused op reduces: its log-prob
  from them is bitwise ``linear_logp``'s.

  Returns:
    ``(tokens [T] int32, their logits [T] float32, (m, s, u) [n_tiles, T] each)``.
  """
  if not supported(compute_dtype):
    raise TypeError(f"head_draw(mosaic): compute dtype must be bfloat16 or float16, got "
                    f"{jnp.dtype(compute_dtype).name}")
  t = hidden2d.shape[0]
  # 64-row CTAs at every row count: with the race's temporaries next to a 128-row
  # accumulator the registers spill (benchmarks/results/head_draw_h100.md).
  cfg = (config or decode_config(t, hidden2d.shape[1], layout, draws=True)
         or Config(tile_m=64))
  _no_hidden_in_place("head_draw", cfg)
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  n_tiles = pl.cdiv(v, VOCAB_TILE)
  cfg = _fit(cfg, jnp.dtype(compute_dtype).itemsize, store_logits=False, stats=True,
             draws=True)
  h2, w2, b2, m_run, n_run = _prepare(hidden2d, weight, bias, layout, compute_dtype,
                                      cfg.tile_m, cfg.cta_n)
  k1, k2 = draw.row_keys(seed, jnp.arange(m_run, dtype=jnp.int32))
  extra = (k1, k2)
  n_pad = pl.cdiv(n_run, cfg.cta_n) * cfg.num_wgs
  m_iters = pl.cdiv(m_run, cfg.tile_m)
  packed = _call(h2, w2, b2, extra, layout=layout, temperature=temperature, valid_vocab=v,
                 m_run=m_run, n_run=n_run, store_logits=False, stats=True, cfg=cfg,
                 out_type=(jax.ShapeDtypeStruct((n_pad, m_iters * EPI_ROWS, DRAW_PACK),
                                                jnp.float32),), draws=True)[0]
  m, s, u, _, key, col, logit = _unpack(packed, n_tiles, t, cfg.tile_m, count=7)
  tokens, tz = draw.merge_draws(key, col, logit)
  return tokens, tz, (m, s, u)


def _from_logits_kernel(z_gmem, tg_gmem, *outs, valid_vocab: int):
  i = lax.axis_index("rows")
  j = lax.axis_index("tiles")
  row0 = i * EPI_ROWS
  col0 = j * VOCAB_TILE

  @functools.partial(pl.run_scoped,
                     z_smem=plgpu.SMEM((EPI_ROWS, VOCAB_TILE), jnp.float32),
                     tg_smem=plgpu.SMEM((EPI_ROWS,), jnp.int32),
                     out_smem=plgpu.SMEM((EPI_ROWS, PACK), jnp.float32),
                     barrier=plgpu.Barrier(num_arrivals=2))
  def _scope(z_smem, tg_smem, out_smem, barrier):
    plgpu.copy_gmem_to_smem(z_gmem.at[pl.ds(row0, EPI_ROWS), pl.ds(col0, VOCAB_TILE)], z_smem,
                            barrier)
    plgpu.copy_gmem_to_smem(tg_gmem.at[pl.ds(row0, EPI_ROWS)], tg_smem, barrier)
    plgpu.barrier_wait(barrier)
    # The fused kernel's accumulator layout, so tile_epilogue reduces in its order.
    z = plgpu.layout_cast(z_smem[...], plgpu.Layout.WGMMA)
    col_ids = col0 + lax.broadcasted_iota(jnp.int32, (EPI_ROWS, VOCAB_TILE), 1)
    stats = tile_epilogue(z, col_ids, tg_smem[...], valid_vocab=valid_vocab)
    pack_ids = lax.broadcasted_iota(jnp.int32, (EPI_ROWS, PACK), 1)
    out_smem[...] = _pack(jnp.zeros((EPI_ROWS, PACK), jnp.float32), pack_ids, stats, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, outs[0].at[j, pl.ds(row0, EPI_ROWS), :])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def partials_from_logits(logits2d: jax.Array, targets: jax.Array):
  """``(m, s, u, target_logit)`` of float32 logits ``[T, V]``, as :func:`tile_partials` of
  the head would give them: bitwise, for logits from :func:`logits` of that head.

  Logit tiles are loaded into the wgmma register layout and reduced by
  :func:`tile_epilogue`. Padding (a copy) only when ``V % 4`` or ``T < 64`` /
  ``V < 128`` (TMA boxes must fit the array); otherwise read in place.
  """
  t, v = logits2d.shape
  n_tiles = pl.cdiv(v, VOCAB_TILE)
  # TMA: the f32 tile's smem tiling is (8, 32), so the array's dims must be multiples.
  t_in, v_in = max(_common.round_up(t, 8), EPI_ROWS), max(_common.round_up(v, 32), VOCAB_TILE)
  if (t_in, v_in) != (t, v):
    logits2d = jnp.pad(logits2d, ((0, t_in - t), (0, v_in - v)))
  t_out = max(EPI_ROWS, _common.round_up(t, 8))
  tg = jnp.pad(targets.astype(jnp.int32), (0, max(t_out, t_in) - t))
  n_blocks = pl.cdiv(t, EPI_ROWS)
  part = jax.ShapeDtypeStruct((n_tiles, n_blocks * EPI_ROWS, PACK), jnp.float32)
  f = plgpu.kernel(
      functools.partial(_from_logits_kernel, valid_vocab=v),
      out_type=(part,), grid=(n_blocks, n_tiles), grid_names=("rows", "tiles"),
      compiler_params=_common.mosaic_warpgroup_params(), kernel_name="linear_logp_from_logits")
  (packed,) = f(logits2d, tg)
  m, s, u, tzp = _unpack(packed, n_tiles, t, EPI_ROWS)
  return m, s, u, jnp.sum(tzp, axis=0)
