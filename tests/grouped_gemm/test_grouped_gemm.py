"""grouped_matmul and its layout: float64 accuracy, row invariance to routing, gradients.

Every implementation that runs here ("cpu", "interpret"), float32 (rounding that
bf16 would hide) and bfloat16. On the tile-aligned layout XLA's CPU ``ragged_dot`` happens
to keep rows invariant too, so the stock control is the MoE layer's
(tests/moe/test_moe_layer.py) and, on a GPU, tests/grouped_gemm/test_grouped_gemm_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err

from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.grouped_gemm import group_layout, grouped_matmul
from jaxrl_kernels.grouped_gemm.layout import group_ranks, num_tiles
from jaxrl_kernels.grouped_gemm.reference import (
  grouped_matmul_grads_reference,
  grouped_matmul_reference,
)

IMPLS = ("cpu", "interpret")
DTYPES = ("float32", "bfloat16")
BM = GROUPED_GEMM_BLOCK_M


def _wide(rng, shape, dtype):
  x = rng.standard_normal(shape).astype(np.float32)
  x *= 2.0 ** rng.integers(-8, 9, size=shape[:-1] + (1,)).astype(np.float32)
  return jnp.asarray(x, dtype)


def _rows_product(x, w, ids, impl, transpose_w=False):
  """``x[a] @ w[ids[a]]`` through the layout: scatter, grouped product, gather."""
  num_experts = w.shape[0]
  lay = group_layout(jnp.asarray(ids, jnp.int32), num_experts)
  xp = jnp.zeros((lay.rows, x.shape[1]), x.dtype).at[lay.dest].set(x)
  return grouped_matmul(xp, w, lay, transpose_w=transpose_w, implementation=impl)[lay.dest]


@pytest.mark.parametrize("seed", range(4))
def test_layout_places_each_expert_in_its_own_tiles(seed):
  rng = np.random.default_rng(seed)
  e = int(rng.integers(1, 9))
  a = int(rng.integers(1, 300))
  ids = rng.integers(0, e, a) if seed else np.zeros(a, np.int64)
  lay = jax.tree.map(np.asarray, group_layout(jnp.asarray(ids), e))
  assert lay.tile_expert.shape == (num_tiles(a, e),)
  assert len(set(lay.dest.tolist())) == a, "two assignments share a row"
  counts = np.bincount(ids, minlength=e)
  np.testing.assert_array_equal(lay.tile_count, -(-counts // BM))
  for ex in range(e):
    rows = lay.dest[ids == ex]
    # ascending assignment order, packed from the group's first tile
    np.testing.assert_array_equal(rows, lay.tile_start[ex] * BM + np.arange(counts[ex]))
    assert (lay.tile_expert[rows // BM] == ex).all()


def _ranks_reference(ids, groups):
  counts = np.zeros(groups, np.int64)
  rank = np.zeros(len(ids), np.int64)
  for i, g in enumerate(ids):
    if g < groups:
      rank[i] = counts[g]
      counts[g] += 1
  return counts, rank


@pytest.mark.parametrize("seed", range(3))
def test_ranks_and_tile_experts_are_the_reference_integers(seed):
  """Ranks (ids past the last group counted nowhere) and each tile's expert (a compare and
  a sum, no search loop) against a plain loop and ``np.searchsorted``, masked assignments
  included."""
  rng = np.random.default_rng(seed)
  e = int(rng.integers(1, 12))
  a = int(rng.integers(1, 400))
  ids = rng.integers(0, e + 2, a)  # ids >= e are counted nowhere
  counts, rank = map(np.asarray, group_ranks(jnp.asarray(ids, jnp.int32), e))
  ref_counts, ref_rank = _ranks_reference(ids, e)
  np.testing.assert_array_equal(counts, ref_counts)
  np.testing.assert_array_equal(rank[ids < e], ref_rank[ids < e])
  valid = ids < e
  lay = jax.tree.map(np.asarray, group_layout(jnp.asarray(np.where(valid, ids, 0), jnp.int32),
                                              e, valid=jnp.asarray(valid)))
  np.testing.assert_array_equal(lay.dest[~valid], lay.rows)  # masked: out of bounds
  np.testing.assert_array_equal(lay.dest[valid], lay.tile_start[ids[valid]] * BM + ref_rank[valid])
  ends = np.cumsum(lay.tile_count)
  expect = np.minimum(np.searchsorted(ends, np.arange(len(lay.tile_expert)), side="right"),
                      e - 1)
  np.testing.assert_array_equal(lay.tile_expert, expect)


@pytest.mark.parametrize("impl", (*IMPLS, "xla"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_forward_and_gradients_match_float64(impl, dtype, transpose_w):
  rng = np.random.default_rng(3)
  a, k, n, e = 150, 96, 80, 5
  x = _wide(rng, (a, k), dtype)
  w = jnp.asarray(rng.standard_normal((e, n, k) if transpose_w else (e, k, n)) * 0.1, dtype)
  ids = rng.integers(0, e, a)
  ids[:7] = 2  # one big group, one expert (4) possibly empty
  ids[ids == 4] = 3
  g = jnp.asarray(rng.standard_normal((a, n)), jnp.float32)
  w_kn = np.swapaxes(np.asarray(w, np.float32), 1, 2) if transpose_w else np.asarray(w, np.float32)
  x32 = np.asarray(x, np.float32)

  def f(x, w):
    return _rows_product(x, w, ids, impl, transpose_w)

  out, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(g.astype(out.dtype))
  ref = grouped_matmul_reference(x32, w_kn, ids)
  rdx, rdw = grouped_matmul_grads_reference(x32, w_kn, ids, np.asarray(g.astype(out.dtype),
                                                                         np.float32))
  if transpose_w:
    rdw = np.swapaxes(rdw, 1, 2)
  fwd_tol, grad_tol = TOL[dtype]
  assert rel_err(out, ref) < fwd_tol
  assert rel_err(dx, rdx) < grad_tol
  assert rel_err(dw, rdw) < grad_tol
  assert not np.asarray(dw[4], np.float32).any(), "an unrouted expert's gradient is not zero"


@pytest.mark.parametrize("impl,dtype", [
    ("cpu", "float32"), ("interpret", "float32"), ("cpu", "bfloat16"),
    pytest.param("interpret", "bfloat16", marks=pytest.mark.slow)])
def test_a_row_does_not_depend_on_the_other_rows(impl, dtype):
  """The same rows routed alone, then among many others (their groups grow, they move
  to other tiles and offsets): outputs and input gradients bitwise equal."""
  rng = np.random.default_rng(5)
  k, n, e = 128, 96, 6
  w = jnp.asarray(rng.standard_normal((e, k, n)) * 0.1, dtype)
  probe = _wide(rng, (9, k), dtype)
  probe_ids = np.array([0, 1, 2, 3, 4, 5, 2, 2, 0])
  g = jnp.asarray(rng.standard_normal((9, n)), dtype)

  def run(x, ids):
    out, vjp = jax.vjp(lambda x: _rows_product(x, w, ids, impl), x)
    return out, vjp(jnp.zeros(out.shape, out.dtype).at[-9:].set(g))[0]

  alone, dalone = run(probe, probe_ids)
  for others in (1, 70, 201):
    x = jnp.concatenate([_wide(rng, (others, k), dtype), probe])
    ids = np.concatenate([rng.integers(0, e, others), probe_ids])
    out, dx = run(x, ids)
    assert_bitwise_equal(out[-9:], alone, f"{others} other rows")
    assert_bitwise_equal(dx[-9:], dalone, f"{others} other rows, dx")


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_gradient_is_deterministic_and_sums_tiles_in_order(impl):
  """dw run to run bitwise; and equal to the per-expert sums of fixed-shape tile products
  added in ascending tile order (float32, exact float32 reference order)."""
  rng = np.random.default_rng(8)
  a, k, n, e = 200, 64, 48, 3
  x = _wide(rng, (a, k), "float32")
  w = jnp.asarray(rng.standard_normal((e, k, n)) * 0.1, jnp.float32)
  ids = np.sort(rng.integers(0, e, a))
  g = jnp.asarray(rng.standard_normal((a, n)), jnp.float32)
  grad = jax.jit(jax.grad(lambda w: jnp.sum(_rows_product(x, w, ids, impl) * g)))
  d1, d2 = grad(w), grad(w)
  assert_bitwise_equal(d1, d2, "dw run to run")
  ref = grouped_matmul_grads_reference(x, w, ids, g)[1]
  assert rel_err(d1, ref) < TOL["float32"][1]


def test_arguments_are_checked():
  lay = group_layout(jnp.zeros((3,), jnp.int32), 2)
  x = jnp.zeros((lay.rows, 8), jnp.float32)
  with pytest.raises(ValueError, match="K=8"):
    grouped_matmul(x, jnp.zeros((2, 4, 5), jnp.float32), lay, implementation="cpu")
  with pytest.raises(ValueError, match="layout has 2 experts but w has 3"):
    grouped_matmul(x, jnp.zeros((3, 8, 5), jnp.float32), lay, implementation="cpu")
  with pytest.raises(ValueError, match="rows"):
    grouped_matmul(x[:-1], jnp.zeros((2, 8, 5), jnp.float32), lay, implementation="cpu")
  with pytest.raises(TypeError, match="same dtype"):
    grouped_matmul(x, jnp.zeros((2, 8, 5), jnp.bfloat16), lay, implementation="cpu")
  with pytest.raises(ValueError, match="1-D integer"):
    group_layout(jnp.zeros((3,), jnp.float32), 2)


def test_out_of_range_expert_ids_are_refused_and_never_take_a_row():
  """An expert id outside [0, E) is a ValueError naming ``expert_ids`` when concrete; traced
  (inside ``jit``, where only ``checkify`` can report it), it takes no row: it is counted for
  no expert and cannot wrap onto the last one or displace another assignment."""
  ids = np.array([0, 1, -1, 1, 5, 0, 2])
  with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 3\), got -1 at index 2"):
    group_layout(jnp.asarray(ids, jnp.int32), 3)
  # Masked-out assignments may hold anything (e.g. -1): only valid ones are checked.
  valid = np.array([True, True, False, True, False, True, True])
  group_layout(jnp.asarray(ids, jnp.int32), 3, valid=jnp.asarray(valid))
  with pytest.raises(ValueError, match="expert_ids must lie in"):
    group_layout(jnp.asarray(ids, jnp.int32), 3, valid=jnp.asarray(~valid))
  lay = jax.tree.map(np.asarray, jax.jit(group_layout, static_argnums=1)(
      jnp.asarray(ids, jnp.int32), 3))
  ref = jax.tree.map(np.asarray, group_layout(jnp.asarray(np.where(valid, ids, 0), jnp.int32),
                                              3, valid=jnp.asarray(valid)))
  for name, got, want in zip(lay._fields, lay, ref, strict=True):
    np.testing.assert_array_equal(got, want, err_msg=name)
  np.testing.assert_array_equal(lay.dest[~valid], lay.rows)
  np.testing.assert_array_equal(lay.tile_count, [1, 1, 1])
  counts, _ = group_ranks(jnp.asarray([-1, 0, 3, 2], jnp.int32), 3)
  np.testing.assert_array_equal(counts, [1, 0, 1])  # -1 and 3 counted nowhere
  with pytest.raises(ValueError, match="num_experts must be >= 1"):
    group_layout(jnp.zeros((3,), jnp.int32), 0)
  with pytest.raises(ValueError, match=r"valid must be a bool array of shape \(3,\)"):
    group_layout(jnp.zeros((3,), jnp.int32), 2, valid=jnp.ones((1,), bool))


@pytest.mark.parametrize("impl", (*IMPLS, "xla"))
def test_no_assignments_give_an_empty_product(impl):
  """Zero assignments (an empty batch): a layout of zero rows, an empty result and zero
  weight gradients, on every implementation."""
  lay = group_layout(jnp.zeros((0,), jnp.int32), 3)
  assert lay.rows == 0
  w = jnp.ones((3, 8, 5), jnp.float32)
  x = jnp.zeros((0, 8), jnp.float32)
  out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, lay, implementation=impl), x, w)
  assert out.shape == (0, 5)
  dx, dw = vjp(jnp.zeros((0, 5), jnp.float32))
  assert dx.shape == (0, 8) and dw.shape == w.shape and not np.asarray(dw).any()
