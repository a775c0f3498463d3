"""The Hopper (Mosaic GPU, wgmma) grouped GEMM, ``pallas.gemm_mosaic.ragged_matmul``.

Each CTA tile reads its row block's expert at run time and runs the instructions of the
Mosaic ``det_matmul`` on its rows and that expert's weight, so a row's bits are the dense
kernel's for that row and weight (checked on a Hopper GPU against ``gemm_mosaic.matmul``
per block, both weight layouts, two configs), whatever the routing around it. On the CPU:
the kernel lowers for CUDA at the MoE shapes (the kernel's construction: TMA views, the
per-tile scalar read of the expert), and its arguments are checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err

from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.grouped_gemm import group_layout
from jaxrl_kernels.grouped_gemm.reference import grouped_matmul_reference
from jaxrl_kernels.pallas import gemm_mosaic

BM = GROUPED_GEMM_BLOCK_M


def _ragged(transposed: bool, config=None):
  return jax.jit(lambda x, w, te: gemm_mosaic.ragged_matmul(
      x, w, te, rhs_transposed=transposed, out_dtype=x.dtype, config=config))


@pytest.mark.parametrize("k, n, transposed", [(128, 128, False), (128, 256, True),
                                              (768, 2048, False), (2048, 768, True)])
def test_the_kernel_lowers_for_hopper(k, n, transposed):
  """Lowered for CUDA from this machine: Pallas builds the Mosaic GPU kernel (a CTA tile's
  weight view from a scalar read of its row block's expert) without a GPU."""
  e, p = 8, 3 * BM
  x = jax.ShapeDtypeStruct((p, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((e, n, k) if transposed else (e, k, n), jnp.bfloat16)
  te = jax.ShapeDtypeStruct((p // BM,), jnp.int32)
  text = _ragged(transposed).trace(x, w, te).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("args, match", [
    (((BM, 128), (4, 128, 128), (1,), "float32"), "bfloat16 or float16"),
    (((BM + 8, 128), (4, 128, 128), (1,), "bfloat16"), "P a multiple of 64"),
    (((BM, 128), (4, 64, 128), (1,), "bfloat16"), "rhs \\[E, K, N\\]"),
    (((2 * BM, 128), (4, 128, 128), (1,), "bfloat16"), "tile_expert \\[P / 64\\]"),
    (((BM, 96), (4, 96, 128), (1,), "bfloat16"), "K=96 is not a positive multiple of 64"),
])
def test_arguments_are_checked(args, match):
  xs, ws, ts, dtype = args
  with pytest.raises(ValueError, match=match):
    gemm_mosaic.ragged_matmul(jnp.zeros(xs, dtype), jnp.zeros(ws, dtype),
                              jnp.zeros(ts, jnp.int32), rhs_transposed=False, out_dtype=dtype)


def test_tile_experts_and_out_dtype_are_checked_and_no_rows_give_no_rows():
  x, w = jnp.zeros((BM, 128), jnp.bfloat16), jnp.zeros((4, 128, 128), jnp.bfloat16)
  with pytest.raises(TypeError, match="tile_expert must be an integer array, got float32"):
    gemm_mosaic.ragged_matmul(x, w, jnp.zeros((1,), jnp.float32), rhs_transposed=False,
                              out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="out_dtype must be"):
    gemm_mosaic.ragged_matmul(x, w, jnp.zeros((1,), jnp.int32), rhs_transposed=False,
                              out_dtype=None)
  out = gemm_mosaic.ragged_matmul(jnp.zeros((0, 128), jnp.bfloat16), w,
                                  jnp.zeros((0,), jnp.int32), rhs_transposed=True,
                                  out_dtype=jnp.float32)
  assert out.shape == (0, 128) and out.dtype == jnp.float32


# ------------------------------------------------------------------------ on a Hopper GPU


def _layout_inputs(seed, a, k, n, e, transposed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((a, k)) * 2.0 ** rng.integers(-6, 7, (a, 1))
  w = rng.standard_normal((e, n, k) if transposed else (e, k, n)) * 0.02
  ids = rng.integers(0, e, a)
  lay = group_layout(jnp.asarray(ids, jnp.int32), e)
  xp = jnp.zeros((lay.rows, k), jnp.bfloat16).at[lay.dest].set(jnp.asarray(x, jnp.bfloat16))
  return xp, jnp.asarray(w, jnp.bfloat16), lay, ids


@pytest.mark.hopper
@pytest.mark.parametrize("k, n, transposed", [(2048, 1536, False), (768, 2048, False),
                                              (1536, 2048, True), (2048, 768, True),
                                              (256, 320, True), (256, 320, False)])
def test_rows_are_the_dense_kernels_rows_bitwise(k, n, transposed):
  """Every used row block equals ``gemm_mosaic.matmul`` of that block with its expert's
  weight, bit for bit (the dense kernel's contract), and the float64 truth within bf16
  tolerance; a second config (the training tile) gives the same bits. N = 320 (not a
  multiple of the CTA tile): a transposed weight's last column tile reads into the next
  expert's rows, and past the last expert's (every expert is routed), which the stores
  clip."""
  e, a = 16, 700
  xp, w, lay, ids = _layout_inputs(0, a, k, n, e, transposed)
  out = np.asarray(_ragged(transposed)(xp, w, lay.tile_expert))
  other = gemm_mosaic.Config(tile_m=BM, tile_n=128, num_compute_wgs=2, wg_split="n",
                             max_concurrent_steps=4)
  assert_bitwise_equal(_ragged(transposed, other)(xp, w, lay.tile_expert), out, "config")
  dense = jax.jit(lambda x, w: gemm_mosaic.matmul(
      x, w, lhs_transposed=False, rhs_transposed=transposed, out_dtype=x.dtype))
  te = np.asarray(lay.tile_expert)
  used = int(np.asarray(lay.tile_start)[-1] + np.asarray(lay.tile_count)[-1])
  for i in range(used):
    assert_bitwise_equal(out[i * BM:(i + 1) * BM], dense(xp[i * BM:(i + 1) * BM], w[te[i]]),
                         f"row block {i} (expert {te[i]})")
  wk = np.swapaxes(np.asarray(w, np.float32), 1, 2) if transposed else np.asarray(w, np.float32)
  ref = grouped_matmul_reference(np.asarray(xp, np.float32)[np.asarray(lay.dest)], wk, ids)
  assert rel_err(out[np.asarray(lay.dest)], ref) < TOL["bfloat16"][0]


@pytest.mark.hopper
def test_rows_do_not_depend_on_the_routing_around_them():
  rng = np.random.default_rng(1)
  k, n, e = 2048, 1536, 128
  w = jnp.asarray(rng.standard_normal((e, k, n)) * 0.02, jnp.bfloat16)
  probe = jnp.asarray(rng.standard_normal((16, k)), jnp.bfloat16)
  probe_ids = rng.integers(0, e, 16)
  f = _ragged(False)

  def rows(x, ids):
    lay = group_layout(jnp.asarray(ids, jnp.int32), e)
    xp = jnp.zeros((lay.rows, k), x.dtype).at[lay.dest].set(x)
    return f(xp, w, lay.tile_expert)[lay.dest]

  alone = rows(probe, probe_ids)
  for others in (48, 2032, 16368):
    x = jnp.concatenate([jnp.asarray(rng.standard_normal((others, k)), jnp.bfloat16), probe])
    ids = np.concatenate([rng.integers(0, e, others), probe_ids])
    assert_bitwise_equal(rows(x, ids)[-16:], alone, f"{others} other rows")
