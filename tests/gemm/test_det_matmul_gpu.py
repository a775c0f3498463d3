"""det_matmul's compiled kernels on a CUDA GPU (Triton; Mosaic and the CUTLASS custom call on
Hopper): what only these backends have to prove.

Accuracy of the product and its gradients against float64 (both weight layouts, ragged
shapes), every Mosaic config giving the same bits, the Mosaic epilogue's accumulation,
and the routing of weights off the Mosaic tiling to Triton. Every invariance (the M sweep
up to 8192 rows with dA rows, position, padding, chunking, mode, run to run) is
tests/test_contract.py, at these shapes on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels import det_matmul
from jaxrl_kernels._backend import is_hopper
from jaxrl_kernels.gemm.reference import matmul_grads_reference, matmul_reference

pytestmark = pytest.mark.gpu


# Every compiled kernel in every dtype it takes: Mosaic and CUDA on Hopper, bf16/fp16 only.
CASES = [pytest.param(impl, dt, marks=pytest.mark.hopper if impl != "triton" else (),
                      id=f"{impl}-{dt}")
         for dt in ("bfloat16", "float16", "float32")
         for impl in ("mosaic", "triton", "cuda") if impl == "triton" or dt != "float32"]


@pytest.mark.parametrize("impl,dtype", CASES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("shape", [(999, 1024, 1088), (256, 512, 384), (3, 192, 192)])
def test_accuracy_vs_float64(impl, dtype, transpose_b, shape):
  m, k, n = shape
  ka, kb = jax.random.split(jax.random.key(m + k + n))
  a = jax.random.normal(ka, (m, k)).astype(dtype)
  b = jax.random.normal(kb, (n, k) if transpose_b else (k, n)).astype(dtype)
  out = det_matmul(a, b, transpose_b=transpose_b, implementation=impl)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, matmul_reference(a, b, transpose_b=transpose_b)) <= TOL[dtype][0]


@pytest.mark.hopper
def test_every_mosaic_config_gives_the_same_bits():
  """The free knobs (M/N tile, warpgroups, stages, walk order) keep every bit."""
  from jaxrl_kernels.pallas import gemm_mosaic as gm
  k, n, m = 1024, 2048, 700
  a = wide_rows(jax.random.key(7), m, k, jnp.bfloat16)
  b = jax.random.normal(jax.random.key(8), (k, n)).astype(jnp.bfloat16)
  configs = [
      gm.Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n"),
      gm.Config(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="m", grid_minor="m"),
      gm.Config(tile_m=128, tile_n=128, num_compute_wgs=2, wg_split="m",
                      grid_tile_width=8),
      gm.Config(tile_m=128, tile_n=64, num_compute_wgs=2, wg_split="n"),
      gm.Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m",
                      max_concurrent_steps=4, grid_minor="m", grid_tile_width=8),
      gm.Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="n",
                      max_concurrent_steps=3),
      gm.Config(tile_m=64, tile_n=192, num_compute_wgs=3, wg_split="m",
                      max_concurrent_steps=4, grid_minor="m", grid_tile_width=8),
      # The decode tiles: 64 wide, and 128 wide past one wave of 64-wide ones.
      gm.Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=8),
      gm.Config(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=4),
      # Narrow decode tiles: A's K tile in the weight tile's 64- and 32-byte swizzles.
      gm.Config(tile_m=64, tile_n=32, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=12),
      gm.Config(tile_m=64, tile_n=16, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=16),
      # Wider K steps: more k16 instructions between waits, the same ones in the same order.
      gm.Config(tile_m=64, tile_n=64, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=6, tile_k=128),
      gm.Config(tile_m=64, tile_n=128, num_compute_wgs=1, wg_split="n",
                      max_concurrent_steps=2, tile_k=256),
      gm.Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m",
                      max_concurrent_steps=2, tile_k=128),
      # The tiles of a step of a few hundred rows (gm.mid_config).
      *(cfg for cfg, _ in gm.MID_TILES),
  ]
  outs = [bits(gm.matmul(a, b, lhs_transposed=False, rhs_transposed=False,
                         out_dtype=jnp.bfloat16, config=c)) for c in configs]
  for c, o in zip(configs[1:], outs[1:]):
    assert np.array_equal(o, outs[0]), f"{c} changed bits vs {configs[0]}"
  # A transposed (``[N, K]``) weight in 64- and 128-column K steps.
  bt = b.T
  t64, t128 = (bits(gm.matmul(a, bt, lhs_transposed=False, rhs_transposed=True,
                              out_dtype=jnp.bfloat16,
                              config=gm.Config(tile_m=64, tile_n=128, num_compute_wgs=2,
                                                     wg_split="n", tile_k=tk)))
               for tk in (64, 128))
  assert np.array_equal(t128, t64), "a 128-column K step changed the [N, K] weight's bits"


@pytest.mark.hopper
def test_weight_gradient_configs_give_the_same_bits():
  """A weight gradient ``A^T G`` over 1000 tokens (transposed lhs, float32 out): the wide
  192 x 192 tiles of three compute warpgroups, which the default picks for such outputs,
  against the large and the small configs; and its float64 reference."""
  from jaxrl_kernels.pallas import gemm_mosaic as gm
  t, m, n = 1000, 448, 640
  a = jax.random.normal(jax.random.key(9), (t, m)).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.key(10), (t, n)).astype(jnp.bfloat16)
  configs = [
      gm.Config(tile_m=64, tile_n=192, num_compute_wgs=3, wg_split="m",
                      max_concurrent_steps=4, grid_minor="m", grid_tile_width=8),
      gm.Config(tile_m=64, tile_n=256, num_compute_wgs=2, wg_split="m",
                      max_concurrent_steps=3, grid_minor="m", grid_tile_width=8),
      gm.Config(tile_m=64, tile_n=64, num_compute_wgs=2, wg_split="n"),
      gm.Config(tile_m=64, tile_n=128, num_compute_wgs=2, wg_split="m",
                      max_concurrent_steps=3, tile_k=128),
  ]
  outs = [np.asarray(gm.matmul(a, g, lhs_transposed=True, rhs_transposed=False,
                               out_dtype=jnp.float32, config=c)) for c in configs]
  for c, o in zip(configs[1:], outs[1:]):
    assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)), f"{c} changed bits"
  want = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  np.testing.assert_allclose(outs[0], want, rtol=0, atol=1e-3 * np.abs(want).max())


@pytest.mark.hopper
@pytest.mark.parametrize("rhs_transposed", [False, True])
@pytest.mark.parametrize("m", [3, 13, 40, 700, 4096])
def test_mosaic_epilogue_accumulation_is_bitwise_c_plus_product(rhs_transposed, m):
  """matmul(acc=c) == c + matmul(): one float32 add after the full K reduction,
  for both weight layouts, a ragged M (padded rows) and decode-step M below one CTA
  tile (``c`` read and the output stored without the tile's padding rows)."""
  from jaxrl_kernels.pallas import gemm_mosaic as gm
  k, n = 1024, 2048
  a = wide_rows(jax.random.key(9), m, k, jnp.bfloat16)
  b = jax.random.normal(jax.random.key(10), (n, k) if rhs_transposed else (k, n))
  b = b.astype(jnp.bfloat16)
  c = wide_rows(jax.random.key(11), m, n, jnp.float32) * 4.0
  kw = dict(lhs_transposed=False, rhs_transposed=rhs_transposed, out_dtype=jnp.float32)
  fused = jax.jit(lambda a, b, c: gm.matmul(a, b, acc=c, **kw))(a, b, c)
  split = jax.jit(lambda a, b, c: c + gm.matmul(a, b, **kw))(a, b, c)
  assert_bitwise_equal(fused, split, "epilogue accumulation vs c + product")
  assert not np.array_equal(bits(fused), bits(gm.matmul(a, b, **kw)))  # c was added
  with pytest.raises(ValueError, match="acc must be float32"):
    gm.matmul(a, b, acc=c.astype(jnp.bfloat16), **kw)


@pytest.mark.parametrize("impl,dtype", CASES)
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gradients(impl, dtype, transpose_b):
  m, k, n = 300, 512, 640
  ka, kb, kg = jax.random.split(jax.random.key(9), 3)
  a = jax.random.normal(ka, (m, k)).astype(dtype)
  b = jax.random.normal(kb, (n, k) if transpose_b else (k, n)).astype(dtype)
  g = jax.random.normal(kg, (m, n)).astype(dtype)
  _, vjp = jax.vjp(lambda a, b: det_matmul(a, b, transpose_b=transpose_b, implementation=impl),
                   a, b)
  da, db = vjp(g)
  rda, rdb = matmul_grads_reference(a, b, g, transpose_b=transpose_b)
  assert rel_err(da, rda) <= TOL[dtype][1]
  assert rel_err(db, rdb) <= TOL[dtype][1]


@pytest.mark.parametrize("shape", [(1000, 1000, 1032), (7, 100, 50)])
def test_ragged_weights_route_to_triton(shape):
  """K or N off the Mosaic tiling: the default picks Triton for every M (by weight shape)."""
  from jaxrl_kernels.gemm.api import resolve_implementation
  m, k, n = shape
  assert resolve_implementation(None, jnp.bfloat16, n, k) == "triton"
  a = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (k, n)).astype(jnp.bfloat16)
  out = det_matmul(a, b)
  assert rel_err(out, matmul_reference(a, b)) <= TOL["bfloat16"][0]
  assert_bitwise_equal(det_matmul(a[m // 2:m // 2 + 1], b), out[m // 2:m // 2 + 1], "mid row")
  if is_hopper():
    with pytest.raises(ValueError, match="cannot run a weight"):
      det_matmul(a, b, implementation="mosaic")
