"""The Hopper Mosaic kernels trace on any host: both run mosaic_loop's main loop (one
persistent loop, two epilogues), and their Python kernel bodies build (no GPU needed)."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from jaxrl_kernels.linear_logp import gemm_backward
from jaxrl_kernels.pallas import gemm_mosaic, linear_logp_mosaic, mosaic_loop

S = jax.ShapeDtypeStruct


def _traced_loops(fn, *args):
  """Traces ``fn`` and returns the configs mosaic_loop.persistent_matmul ran with."""
  seen = []
  real = mosaic_loop.persistent_matmul

  def spy(*a, **kw):
    seen.append(kw["cfg"])
    return real(*a, **kw)

  with mock.patch.object(mosaic_loop, "persistent_matmul", spy):
    jax.make_jaxpr(fn)(*args)
  return seen


@pytest.mark.parametrize("rhs_transposed", [False, True])
@pytest.mark.parametrize("mode", ["store", "acc", "epilogue", "weight_grad"])
def test_gemm_runs_the_shared_main_loop(mode, rhs_transposed):
  m, k, n = (512, 300, 1024) if mode == "weight_grad" else (300, 512, 1024)
  kw = dict(lhs_transposed=mode == "weight_grad", rhs_transposed=rhs_transposed,
            out_dtype=jnp.float32 if mode in ("acc", "weight_grad") else jnp.bfloat16)
  a = S((k, m) if mode == "weight_grad" else (m, k), jnp.bfloat16)
  b = S((n, k) if rhs_transposed else (k, n), jnp.bfloat16)
  if mode == "acc":
    fn = lambda a, b, c: gemm_mosaic.matmul(a, b, acc=c, **kw)  # noqa: E731
    args = (a, b, S((m, n), jnp.float32))
  elif mode == "epilogue":
    fn = lambda a, b, r, c: gemm_mosaic.matmul(  # noqa: E731
        a, b, **kw, row_operands=(r,), col_operands=(c,),
        epilogue=lambda z, rows, cols, ids: z * rows[0] + cols[0])
    args = (a, b, S((m,), jnp.float32), S((n,), jnp.float32))
  else:
    fn, args = (lambda a, b: gemm_mosaic.matmul(a, b, **kw)), (a, b)
  (cfg,) = _traced_loops(fn, *args)
  want = gemm_mosaic.default_config(m, n, k)
  assert (cfg.tile_m, cfg.tile_n, cfg.num_compute_wgs, cfg.wg_split) == (
      want.tile_m, want.tile_n, want.num_compute_wgs, want.wg_split)


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_lm_head_runs_the_shared_main_loop(layout):
  t, h, v = 300, 512, 3001
  w = S((h, v) if layout == "hv" else (v, h), jnp.bfloat16)
  x, b, tg = S((t, h), jnp.bfloat16), S((v,), jnp.bfloat16), S((t,), jnp.int32)
  kw = dict(layout=layout, temperature=0.7, compute_dtype=jnp.bfloat16)
  loops = _traced_loops(lambda x, w, b, tg: linear_logp_mosaic.tile_partials(x, w, b, tg, **kw),
                        x, w, b, tg)
  loops += _traced_loops(
      lambda x, w, b: linear_logp_mosaic.logits(x, w, b, return_stats=True, **kw), x, w, b)
  for cfg in loops:
    assert (cfg.tile_n, cfg.num_compute_wgs, cfg.wg_split) == (
        linear_logp_mosaic.VOCAB_TILE, 2, "n")


def _head_calls(t, h, config=None, v=3001):
  """The LM head's three Mosaic kernels at ``t`` rows, ``H = h``: ``{name: (fn, args)}`` for
  the fused partials, the logits with statistics and the draw (``config``: the default's
  when None)."""
  x, w = S((t, h), jnp.bfloat16), S((h, v), jnp.bfloat16)
  kw = dict(layout="hv", temperature=0.7, compute_dtype=jnp.bfloat16, config=config)
  return {
      "partials": (lambda x, w, tg: linear_logp_mosaic.tile_partials(x, w, None, tg, **kw),
                   (x, w, S((t,), jnp.int32))),
      "logits": (lambda x, w: linear_logp_mosaic.logits(x, w, None, return_stats=True, **kw),
                 (x, w)),
      "draw": (lambda x, w, sd: linear_logp_mosaic.logits_draw(x, w, None, sd, **kw),
               (x, w, S((2,), jnp.int32)))}


@pytest.mark.parametrize("t", [1, 64, 300])
def test_lm_head_one_warpgroup_ctas_lower_for_cuda(t):
  """``Config(num_wgs=1)``: CTAs of one vocab tile (one compute warpgroup) run the
  same main loop and epilogue for the fused partials, the logits with statistics and the
  draw, and build CUDA kernels; anything but 1 or 2 warpgroups is refused by name. Bits:
  tests/linear_logp/test_linear_logp_mosaic_gpu.py."""
  cfg = linear_logp_mosaic.Config(tile_m=64 if t <= 64 else 128, num_wgs=1)
  assert cfg.cta_n == linear_logp_mosaic.VOCAB_TILE
  for fn, args in _head_calls(t, 512, cfg).values():
    (loop,) = _traced_loops(fn, *args)
    assert (loop.tile_n, loop.num_compute_wgs) == (linear_logp_mosaic.VOCAB_TILE, 1)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()
  for bad in (0, 3):
    with pytest.raises(ValueError, match="num_wgs must be 1 or 2"):
      linear_logp_mosaic.Config(num_wgs=bad)


def test_lm_head_decode_configs():
  """The sampler head's default at <= 64 rows: 64-row CTAs; the draw, and the logits of a
  ``"vh"`` weight, take CTAs of one vocab tile stepping 128 hidden columns where the padded
  H allows (else two warpgroups at 64); the logits of an ``"hv"`` weight take two
  warpgroups at 64 (with the hidden rows in place). More rows keep the two-warpgroup,
  64-column config."""
  for t, h, want in ((1, 512, (64, 1, 128)), (64, 896, (64, 1, 128)), (8, 320, (64, 2, 64)),
                     (65, 512, (128, 2, 64))):
    calls = _head_calls(t, h)
    x, w = S((t, h), jnp.bfloat16), S((3001, h), jnp.bfloat16)
    vh = (lambda x, w: linear_logp_mosaic.logits(
        x, w, None, return_stats=True, layout="vh", temperature=0.7,
        compute_dtype=jnp.bfloat16), (x, w))
    for name, (fn, args) in (("hv logits", calls["logits"]), ("hv draw", calls["draw"]),
                             ("vh logits", vh)):
      (loop,) = _traced_loops(fn, *args)
      got = (loop.tile_m, loop.num_compute_wgs, loop.tile_k)
      if t > 64 and name == "hv draw":  # the draw keeps 64-row CTAs at every T
        assert got == (64, 2, 64), (t, h)
      elif t <= 64 and name == "hv logits":
        assert got == (64, 2, 64), (t, h)
      else:
        assert got == want, (t, h, name)


@pytest.mark.parametrize("t,rows", [(1, 1), (3, 3), (8, 8), (13, 16), (40, 40)])
def test_decode_rows_store_no_padding_rows(t, rows):
  """A decode step's few rows (``t`` below one 64-row CTA tile): the LM head's logits and a
  GEMM's output are ``[rows, N]`` arrays in the module (``t``, or ``t`` rounded up to 8 where
  TMA cannot store ``t`` rows in place), their padding rows' stores clipped, not ``[64, N]``
  arrays sliced afterwards; the lhs is still padded to the CTA tile. Bits:
  tests/linear_logp/test_linear_logp_mosaic_gpu.py, tests/gemm/test_det_matmul_gpu.py."""
  head = jax.export.export(jax.jit(lambda x, w: linear_logp_mosaic.logits(
      x, w, None, return_stats=True, layout="hv", temperature=0.7, compute_dtype=jnp.bfloat16)),
      platforms=["cuda"])(S((t, 512), jnp.bfloat16), S((512, 3072), jnp.bfloat16))
  gemm = jax.export.export(jax.jit(lambda a, b: gemm_mosaic.matmul(
      a, b, lhs_transposed=False, rhs_transposed=False, out_dtype=jnp.bfloat16)),
      platforms=["cuda"])(S((t, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16))
  for exported, out in ((head, "3072xf32"), (gemm, "1024xbf16")):
    module = exported.mlir_module()
    assert "mosaic_gpu" in module
    assert f"tensor<{rows}x{out}>" in module and f"tensor<64x{out}>" not in module, out
  assert "tensor<64x512xbf16>" in gemm.mlir_module()  # the lhs: one CTA tile of rows


@pytest.mark.parametrize("t,in_place", [(1, True), (8, True), (13, False), (64, True)])
def test_head_decode_reads_hidden_in_place(t, in_place):
  """The sampler head's logits at a decode step's rows, ``"hv"`` weight: the hidden rows
  are read in place where TMA takes them (no padded copy; 13 rows are padded),
  and the logits' statistics take no target-id operand (no fill of -1 targets per call:
  the kernel holds them as a constant). A ``"vh"`` weight keeps the padded rows (its
  decode config: ``linear_logp_mosaic.decode_config``). Bits:
  tests/linear_logp/test_linear_logp_mosaic_gpu.py."""
  def module(layout, shape):
    return jax.export.export(jax.jit(lambda x, w: linear_logp_mosaic.logits(
        x, w, None, return_stats=True, layout=layout, temperature=1.0,
        compute_dtype=jnp.bfloat16)), platforms=["cuda"])(
            S((t, 512), jnp.bfloat16), S(shape, jnp.bfloat16)).mlir_module()
  hv, vh = module("hv", (512, 3072)), module("vh", (3072, 512))
  assert "mosaic_gpu" in hv and "mosaic_gpu" in vh
  padded = t < 64  # the only pad: H and V are TMA-aligned
  assert ("stablehlo.pad" in hv) == (padded and not in_place), t
  assert ("stablehlo.pad" in vh) == padded, t
  for m in (hv, vh):
    assert "xi32>" not in m  # no target ids
  cfg = linear_logp_mosaic.decode_config(t, 512, "hv")
  assert cfg.hidden_in_place and cfg.num_wgs == 2
  assert not linear_logp_mosaic.decode_config(t, 512, "hv", draws=True).hidden_in_place
  assert not linear_logp_mosaic.decode_config(t, 512, "vh").hidden_in_place
  assert linear_logp_mosaic.decode_config(65, 512, "hv") is None
  with pytest.raises(ValueError, match="hidden_in_place must be a bool"):
    linear_logp_mosaic.Config(hidden_in_place=1)
  # The partials and the draw read their rows padded: the knob is refused by name there.
  in_place = linear_logp_mosaic.Config(tile_m=64, hidden_in_place=True)
  calls = _head_calls(t, 512, in_place)
  for name in ("partials", "draw"):
    fn, args = calls[name]
    with pytest.raises(ValueError, match="hidden_in_place is for the logits"):
      jax.eval_shape(fn, *args)


@pytest.mark.parametrize("t,tile_k,wgs", [(1, 128, 1), (64, 128, 1), (300, 128, 1)])
def test_lm_head_wide_k_steps_lower_for_cuda(t, tile_k, wgs):
  """``Config(tile_k=...)``: the LM head's main loop steps that many hidden columns
  (the loop traced with it) for the partials, the logits and the draw, and builds CUDA
  kernels; a step off the contract's 64 columns, or one that does not divide the padded H,
  is refused by name. Bits: tests/linear_logp/test_linear_logp_mosaic_gpu.py."""
  cfg = linear_logp_mosaic.Config(tile_m=64 if t <= 64 else 128, num_wgs=wgs,
                                            tile_k=tile_k)
  for fn, args in _head_calls(t, 512, cfg).values():
    (loop,) = _traced_loops(fn, *args)
    assert (loop.tile_k, loop.num_compute_wgs) == (tile_k, wgs)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()
  for bad in (0, 32, 96, 64.0, True):
    with pytest.raises(ValueError, match="tile_k must be a positive multiple of 64"):
      linear_logp_mosaic.Config(tile_k=bad)
  odd = linear_logp_mosaic.Config(tile_m=64, num_wgs=1, tile_k=128)  # H = 320
  with pytest.raises(ValueError, match=r"tile_k \(128\) must divide the hidden size"):
    linear_logp_mosaic.logits(jnp.zeros((4, 320), jnp.bfloat16), jnp.zeros((320, 3001),
                              jnp.bfloat16), None, layout="hv", temperature=1.0,
                              compute_dtype=jnp.bfloat16, config=odd)
  big = linear_logp_mosaic.Config(tile_m=64, tile_k=128)  # 2 x 80 KiB + the logits
  with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
    linear_logp_mosaic.logits(jnp.zeros((4, 512), jnp.bfloat16), jnp.zeros((512, 3001),
                              jnp.bfloat16), None, layout="hv", temperature=1.0,
                              compute_dtype=jnp.bfloat16, config=big)


@pytest.mark.parametrize("m,kc,with_bias", [(300, 128, False), (64, 640, True),
                                            (1024, 608, True), (1024, 112, False)])
def test_chunk_tree_kernel_lowers_for_cuda(m, kc, with_bias):
  """The row-parallel chunk-tree kernel (the pending tree tiles in registers and shared
  memory, folded at each chunk's last K tile) builds a CUDA module on any host; chunks off the
  K tile (608, 112 columns) read x and w in place through chunk views (no pad in the module).
  Its bits are tested on a Hopper GPU
  (test_row_parallel.py::test_chunk_tree_kernel_is_the_chunk_products_and_the_tree)."""
  fn = jax.jit(lambda x, w, b: gemm_mosaic.chunk_tree_matmul(x, w, b, chunks=8,
                                                             out_dtype=jnp.bfloat16))
  args = (S((m, 8 * kc), jnp.bfloat16), S((8 * kc, 896), jnp.bfloat16),
          S((896,), jnp.float32) if with_bias else None)
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert exported.out_avals[0].shape == (m, 896)
  module = exported.mlir_module()
  assert "mosaic_gpu" in module
  if m % 128 == 0:  # whole CTA tiles of rows: nothing is copied around the kernel
    assert "stablehlo.pad" not in module
  with pytest.raises(ValueError, match="chunks"):
    jax.eval_shape(lambda x, w: gemm_mosaic.chunk_tree_matmul(
        x, w, None, chunks=8, out_dtype=jnp.bfloat16), S((m, 8 * 40), jnp.bfloat16),
        S((8 * 40, 896), jnp.bfloat16))
  with pytest.raises(ValueError, match="power of two"):
    jax.eval_shape(lambda x, w: gemm_mosaic.chunk_tree_matmul(
        x, w, None, chunks=6, out_dtype=jnp.bfloat16), S((m, 6 * kc), jnp.bfloat16),
        S((6 * kc, 896), jnp.bfloat16))


@pytest.mark.parametrize("out_shape,wgs", [
    ((896, 9728), 3),    # 266 tiles of 128 x 256: 2.02 waves of 132 CTAs
    ((4864, 896), 3),    # 152 tiles: 1.15 waves
    ((16384, 896), 2),   # 512 tiles: 3.9 waves, nearly full
    ((16384, 9728), 2),
    ((1024, 14336), 2),  # 448 tiles: 3.4 waves, 85% used: 192 x 192 would be worse
    ((2048, 3072), 2),   # 192 tiles: 192 x 192 tiles fill no more of the waves
])
def test_wide_tiles_only_where_large_tiles_leave_a_wave_empty(out_shape, wgs):
  """192 x 192 CTA tiles (three compute warpgroups) where the 128 x 256 tiles fill less than
  three quarters of their waves and the wide ones fill more; a shape's rule (the config is a
  function of the shape alone), and the wide config builds a CUDA weight-gradient kernel."""
  m, n = out_shape
  cfg = gemm_mosaic.default_config(m, n, 16384)
  assert cfg.num_compute_wgs == wgs, cfg
  if wgs == 3:
    assert (cfg.cta_tile_m, cfg.cta_tile_n) == (192, 192)
    assert gemm_mosaic.wave_use(m, n, 192, 192) > 0.85 > 0.75 > gemm_mosaic.wave_use(
        m, n, 128, 256)
    fn = jax.jit(lambda a, g: gemm_mosaic.matmul(a, g, lhs_transposed=True,
                                                 rhs_transposed=False, out_dtype=jnp.float32))
    args = (S((1000, m), jnp.bfloat16), S((1000, n), jnp.bfloat16))
    (traced,) = _traced_loops(fn, *args)
    assert traced.num_compute_wgs == 3
    exported = jax.export.export(fn, platforms=["cuda"])(*args)
    assert exported.out_avals[0].shape == (m, n)


@pytest.mark.parametrize("n,tile_n", [(1152, 64), (3072, 64), (8448, 64), (8512, 128),
                                        (9728, 128), (16384, 128)])
def test_decode_tiles_widen_past_one_wave(n, tile_n):
  """At decode M (<= 64) the CTA tile is 64 wide until 64-wide tiles exceed one wave of
  the SMs (132 x 64 = 8448 columns), 128 wide past it (8512 = 133 x 64): a shape's rule
  (the 128-wide config gives the 64-wide one's bits, tests/gemm/test_det_matmul_gpu.py).
  Either config builds a CUDA kernel named by its K and N."""
  cfg = gemm_mosaic.default_config(64, n, 2048)
  assert (cfg.tile_m, cfg.cta_tile_n, cfg.num_compute_wgs) == (64, tile_n, 1), cfg
  fn = jax.jit(lambda a, b: gemm_mosaic.matmul(a, b, lhs_transposed=False,
                                               rhs_transposed=False, out_dtype=jnp.bfloat16))
  args = (S((64, 2048), jnp.bfloat16), S((2048, n), jnp.bfloat16))
  (traced,) = _traced_loops(fn, *args)
  assert traced.tile_n == tile_n
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert f"det_matmul_k2048_n{n}" in exported.mlir_module()


@pytest.mark.parametrize("m,k,n,tile_n,tile_k", [
    (64, 896, 1152, 64, 128),   # K a multiple of 128: 128-column K steps
    (1, 4096, 4096, 64, 128),
    (64, 960, 1152, 64, 64),    # K = 15 x 64: 64-column steps
    (64, 896, 9728, 128, 64),   # past one wave of 64-wide tiles: 64-column steps
])
def test_decode_tiles_take_wide_k_steps_where_k_allows(m, k, n, tile_n, tile_k):
  """At decode M the 64-wide tiles step 128 K columns where K is a multiple of 128 (the
  same k16 instructions in the same order; tests/gemm/test_det_matmul_gpu.py checks the
  bits): the traced loop runs that step and the kernel builds for CUDA."""
  cfg = gemm_mosaic.default_config(m, n, k)
  assert (cfg.cta_tile_n, cfg.tile_k) == (tile_n, tile_k), cfg
  fn = jax.jit(lambda a, b: gemm_mosaic.matmul(a, b, lhs_transposed=False,
                                               rhs_transposed=False, out_dtype=jnp.bfloat16))
  args = (S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16))
  (traced,) = _traced_loops(fn, *args)
  assert (traced.tile_n, traced.tile_k) == (cfg.tile_n, tile_k)
  jax.export.export(fn, platforms=["cuda"])(*args)


def test_k_steps_off_the_contract_tile_are_refused_by_name():
  """A K step that is not a multiple of the 64-column tile, one that does not divide K, a
  wide step in a chunk tree, and a tile narrower than one 128-byte swizzle row under a
  transposed lhs are refused, each naming what is wrong."""
  a, b = jnp.zeros((64, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
  kw = dict(lhs_transposed=False, rhs_transposed=False, out_dtype=jnp.bfloat16)
  cfg = gemm_mosaic.Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n")
  with pytest.raises(ValueError, match=r"tile_k \(96\) must be a positive multiple of 64"):
    dataclasses.replace(cfg, tile_k=96)
  with pytest.raises(ValueError, match="K=512 is not a multiple of the config's K step 384"):
    gemm_mosaic.matmul(a, b, **kw, config=dataclasses.replace(cfg, tile_k=384))
  with pytest.raises(ValueError, match="a CTA tile of 32 columns .* needs a plain"):
    jax.jit(lambda a, b: gemm_mosaic.matmul(
        a, b, lhs_transposed=True, rhs_transposed=False, out_dtype=jnp.float32,
        config=dataclasses.replace(cfg, tile_n=32))).trace(a.T, b)
  with pytest.raises(ValueError, match="64 for a chunk tree"):
    jax.jit(lambda a, b: gemm_mosaic.matmul(
        a, b, **kw, chunks=2, config=dataclasses.replace(cfg, tile_k=128))).trace(a, b)


@pytest.mark.parametrize("m,n,groups,cta", [
    (256, 17920, 1, (128, 128)),  # 140 tiles of 128 x 256: a second wave of 8
    (256, 16384, 1, (128, 256)),  # 128 tiles: one wave
    (256, 2048, 1, (64, 128)),    # 16 tiles of 128 x 256 leave 116 SMs idle
    (256, 1536, 4, (128, 128)),   # four K chunks of a down_proj
    (256, 1536, 8, (128, 256)),   # eight: 96 tiles of 128 x 256
    (512, 14336, 1, (128, 256)),
])
def test_a_few_hundred_rows_take_the_fastest_waves(m, n, groups, cta):
  """64 < M <= 512 (a rollout's decode step over a few hundred sequences): the CTA tile
  whose waves over all the products take the least time, plain and grouped; the chosen
  config builds the CUDA kernel (a shape's rule; every config gives the same bits,
  tests/gemm/test_det_matmul_gpu.py)."""
  cfg = gemm_mosaic.mid_config(m, n, groups)
  assert (cfg.cta_tile_m, cfg.cta_tile_n) == cta
  if groups == 1:
    assert gemm_mosaic.default_config(m, n, 1024) == cfg
    fn = jax.jit(lambda a, b: gemm_mosaic.matmul(a, b, lhs_transposed=False,
                                                 rhs_transposed=False, out_dtype=jnp.bfloat16))
    args = (S((m, 1024), jnp.bfloat16), S((1024, n), jnp.bfloat16))
  else:
    fn = jax.jit(lambda a, b: gemm_mosaic.grouped_matmul(a, b, out_dtype=jnp.float32))
    args = (S((m, groups * 256), jnp.bfloat16), S((groups, 256, n), jnp.bfloat16))
  (traced,) = _traced_loops(fn, *args)
  assert (traced.cta_tile_m, traced.cta_tile_n) == cta
  jax.export.export(fn, platforms=["cuda"])(*args)
  with pytest.raises(ValueError, match="N=128"):
    gemm_mosaic.mid_config(m, 128)


@pytest.mark.parametrize("out_shape,minor", [
    ((16384, 896), "n"),    # 4 column tiles of 256: row by row
    ((16384, 1024), "n"),
    ((16384, 1152), "m"),   # 5 column tiles: bands of 8 row tiles
    ((16384, 4864), "m"),
])
def test_narrow_outputs_walk_row_by_row(out_shape, minor):
  """The 128 x 256 config walks outputs of at most four column tiles N-minor (row by row)
  and wider ones in bands of row tiles (a shape's rule; every walk gives the same bits,
  tests/gemm/test_det_matmul_gpu.py)."""
  m, n = out_shape
  cfg = gemm_mosaic.default_config(m, n, 4096)
  assert (cfg.cta_tile_m, cfg.cta_tile_n, cfg.grid_minor) == (128, 256, minor)


def test_grouped_product_reads_side_by_side_operands_in_place():
  """``grouped_matmul`` takes ``[M, G K]`` (the G operands side by side) and lowers for CUDA
  to one launch reading them in place (no transposed copy) where the 8-row tile views M
  rows (``rows_in_place``: below 8 or a multiple of 8; several row tiles per product, and
  rows ending inside a tile, included), with the stacked copy otherwise (20 rows); columns
  that are not G whole operands are refused by name."""
  f32 = jnp.float32
  fn = jax.jit(lambda a, b: gemm_mosaic.grouped_matmul(a, b, out_dtype=f32))
  w = S((8, 256, 2048), jnp.bfloat16)
  for m in (1, 4, 8, 20, 40, 64, 72, 200, 256):
    exported = jax.export.export(fn, platforms=["cuda"])(S((m, 2048), jnp.bfloat16), w)
    assert exported.out_avals[0].shape == (8, m, 2048)
    copies = "stablehlo.transpose" in exported.mlir_module()
    assert copies == (not mosaic_loop.rows_in_place(m)), m
  assert [m for m in range(0, 70) if mosaic_loop.rows_in_place(m)] == [
      *range(1, 8), *range(8, 70, 8)]
  with pytest.raises(ValueError, match="lhs \\[M, G K\\] needs"):
    jax.eval_shape(fn, S((64, 2000), jnp.bfloat16), w)


@pytest.mark.parametrize("v", [3072, 3001])
def test_lm_head_without_entropy_lowers_for_cuda(v):
  """``entropy=False`` (a caller that returns no entropy): the fused partials' epilogue
  without ``u`` and the GEMM backward's dz epilogue without the entropy term (V = 3072:
  every product on the Mosaic kernel; no Triton call is exported) build CUDA kernels; the
  forward's kernel is another one than the entropy-reducing kernel's. Bits:
  tests/linear_logp/test_linear_logp_mosaic_gpu.py."""
  t, h = 300, 512
  x, w, tg = S((t, h), jnp.bfloat16), S((v, h), jnp.bfloat16), S((t,), jnp.int32)
  kw = dict(layout="vh", temperature=1.0, compute_dtype=jnp.bfloat16)
  modules = {}
  for entropy in (True, False):
    fwd = functools.partial(linear_logp_mosaic.tile_partials, bias=None, entropy=entropy, **kw)
    exported = jax.export.export(jax.jit(lambda x, w, tg, f=fwd: f(x, w, targets=tg)),
                                 platforms=["cuda"])(x, w, tg)
    modules[entropy] = exported.mlir_module()
    assert "mosaic_gpu" in modules[entropy]
  assert modules[True] != modules[False]
  if v % linear_logp_mosaic.VOCAB_TILE:
    return  # the backward's chunk products of V = 3001 run on Triton, without the epilogue
  rows = S((t,), jnp.float32)

  def bwd(x, w, tg, lse, gl):
    return gemm_backward.backward(x, w, None, tg, lse, lse, gl, gl, gemm="mosaic",
                                  entropy=False, **kw)

  exported = jax.export.export(jax.jit(bwd), platforms=["cuda"])(x, w, tg, rows, rows)
  assert "mosaic_gpu" in exported.mlir_module()
