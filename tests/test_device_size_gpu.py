"""The contract's "device size" row on a Hopper GPU: no bit depends on the persistent grid's
size, so GPUs of one architecture with other SM counts (an H20's 78 SMs, an H800's or
H100's 132, a partitioned GPU's 66) give the same bits.

Each persistent kernel runs with its grid at 132, 78, 66 and 1 CTAs (``num_ctas``) and
at the device's own size (``None``); every output is compared on raw bits with the
device-size call. The kernels whose grids follow the problem and not the device (the
Triton kernels, the Mosaic attention backward, the reductions) have nothing to vary.
A run-to-run control re-runs the default, and a second control shows that the comparison
sees a one-ulp change.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, wide_rows

from jaxrl_kernels.pallas import attention_mosaic, gemm_mosaic
from jaxrl_kernels.pallas import linear_logp_mosaic as lm

pytestmark = pytest.mark.hopper

GRID_SIZES = (132, 78, 66, 1)


def test_the_comparison_sees_one_ulp():
  a = wide_rows(jax.random.key(0), 300, 512, jnp.bfloat16, spread=4)
  b = (jax.random.normal(jax.random.key(1), (512, 384)) * 512 ** -0.5).astype(jnp.bfloat16)
  ref = gemm_mosaic.matmul(a, b, lhs_transposed=False, rhs_transposed=False,
                           out_dtype=jnp.float32)
  flipped = jnp.asarray(np.asarray(ref).view(np.uint32) ^ np.uint32(1)).view(jnp.float32)
  with pytest.raises(AssertionError):
    assert_bitwise_equal(flipped, ref, "one ulp")


# (M, K, N, lhs_transposed, rhs_transposed, out dtype, chunks, with acc): the layer GEMMs
# (NN, NT), the weight gradient (TN, tokens as K), a float32 accumulation and the canonical
# row-parallel chunk tree (8 K chunks in one launch).
GEMMS = [
    (1000, 896, 1152, False, False, jnp.bfloat16, 1, False),
    (64, 896, 4864, False, True, jnp.bfloat16, 1, False),
    (896, 4096, 640, True, False, jnp.float32, 1, False),
    (700, 1024, 896, False, False, jnp.float32, 1, True),
    (512, 4864, 896, False, False, jnp.bfloat16, 8, False),
]


@pytest.mark.parametrize("case", GEMMS, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-t{int(c[3])}"
                         f"{int(c[4])}-c{c[6]}-acc{int(c[7])}")
def test_gemm(case):
  m, k, n, lt, rt, out_dtype, chunks, with_acc = case
  a = wide_rows(jax.random.key(m + k), k if lt else m, m if lt else k, jnp.bfloat16, spread=4)
  b = (jax.random.normal(jax.random.key(n), (n, k) if rt else (k, n)) * k ** -0.5)
  b = b.astype(jnp.bfloat16)
  acc = jax.random.normal(jax.random.key(5), (m, n), jnp.float32) if with_acc else None

  def run(num_ctas):
    cfg = dataclasses.replace(gemm_mosaic.default_config(m, n, k), num_ctas=num_ctas)
    return gemm_mosaic.matmul(a, b, lhs_transposed=lt, rhs_transposed=rt, out_dtype=out_dtype,
                              config=cfg, acc=acc, chunks=chunks)

  ref = run(None)
  assert_bitwise_equal(run(None), ref, "run to run")
  for size in GRID_SIZES:
    assert_bitwise_equal(run(size), ref, f"{size} CTAs vs one per SM")


@pytest.mark.parametrize("m", [40, 300])
def test_grouped_gemm(m):
  g, k, n = 8, 512, 896
  lhs = wide_rows(jax.random.key(m), g * m, k, jnp.bfloat16, spread=4).reshape(g, m, k)
  rhs = (jax.random.normal(jax.random.key(1), (g, k, n)) * k ** -0.5).astype(jnp.bfloat16)
  ref = gemm_mosaic.grouped_matmul(lhs, rhs, out_dtype=jnp.float32)
  for size in GRID_SIZES:
    got = gemm_mosaic.grouped_matmul(lhs, rhs, out_dtype=jnp.float32, num_ctas=size)
    assert_bitwise_equal(got, ref, f"grouped, {size} CTAs")


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_lm_head(layout):
  """The trainer's partials (700 rows), the sampler's logits with statistics (8 rows, the
  decode config) and the draw in the head's epilogue."""
  h, v = 512, 3001
  w = jax.random.normal(jax.random.key(1), (h, v)) * (2.0 / np.sqrt(h))
  w = (w if layout == "hv" else w.T).astype(jnp.bfloat16)
  x = wide_rows(jax.random.key(3), 700, h, jnp.bfloat16, spread=4)
  tg = jax.random.randint(jax.random.key(4), (700,), 0, v)
  kw = dict(layout=layout, temperature=0.7, compute_dtype=jnp.bfloat16)
  seed = jnp.array([3, 11], jnp.int32)
  decode = lm.decode_config(8, h, layout) or lm.Config()

  def run(num_ctas):
    parts = lm.tile_partials(x, w, None, tg, **kw, config=lm.Config(num_ctas=num_ctas))
    z, stats = lm.logits(x[:8], w, None, **kw, return_stats=True,
                         config=dataclasses.replace(decode, num_ctas=num_ctas))
    tokens, tz, dstats = lm.logits_draw(x[:64], w, None, seed, **kw,
                                        config=lm.Config(tile_m=64, num_ctas=num_ctas))
    return (*parts, z, *stats, tokens, tz, *dstats)

  ref = run(None)
  for size in GRID_SIZES:
    for i, (a, b) in enumerate(zip(run(size), ref, strict=True)):
      assert_bitwise_equal(a, b, f"output {i}, {size} CTAs")


@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention(d):
  """Persistent decode CTAs walking (batch group, head) items: 64 entries x 8 heads."""
  b, s, hq, hkv, rows = 64, 700, 8, 2, 1
  ks = jax.random.split(jax.random.key(d), 4)
  q = jax.random.normal(ks[0], (b, rows, hq, d)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(jnp.bfloat16)
  kvl = jax.random.randint(ks[3], (b,), 1, s + 1).astype(jnp.int32)
  pos = (kvl[:, None] - 1).astype(jnp.int32)
  kw = dict(scale=d ** -0.5, persistent=True)
  ref = attention_mosaic.forward(q, k, v, pos, kvl, **kw)
  for size in GRID_SIZES:
    got = attention_mosaic.forward(q, k, v, pos, kvl, num_ctas=size, **kw)
    for name, a, r in zip(("out", "lse"), got, ref, strict=True):
      assert_bitwise_equal(a, r, f"{name}, {size} CTAs")
