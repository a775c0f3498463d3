"""Global masked reductions: accuracy, masking, and invariance to device / micro-batch splits.

Claims tested (docs/rl.md): ``masked_count`` of a bool mask is BITWISE invariant to
how tokens are split over devices and micro-batches; ``masked_sum`` and
``masked_mean`` are invariant to float32 tolerance (1e-5 of the sum of |terms|),
not bitwise. The control: averaging per-device (or per-micro-batch) means, the
thing the global denominator replaces, is off by far more than that tolerance.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, wide_rows
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxrl_kernels.reduce.masked as reductions_module
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.reduce.masked import masked_count, masked_mean, masked_sum

N = 96  # tokens; divisible by 1, 2, 3, 4, 8
FP32_TOL = 1e-5


def _data(seed=0, n=N):
  """Wide-dynamic-range values and an uneven mask (most active tokens at the front)."""
  v = np.asarray(wide_rows(jax.random.key(seed), n, 1, jnp.float32)).reshape(n)
  rng = np.random.default_rng(seed)
  p_active = np.where(np.arange(n) < n // 4, 0.95, 0.15)
  m = rng.random(n) < p_active
  return v, m


def _assert_sum_close(out, ref_terms):
  ref = np.sum(np.asarray(ref_terms, np.float64))
  scale = np.sum(np.abs(np.asarray(ref_terms, np.float64)))
  assert np.isfinite(out)
  assert abs(float(out) - ref) <= FP32_TOL * max(scale, 1e-30), (float(out), ref)


def test_doctests():
  res = doctest.testmod(reductions_module, extraglobs={"jnp": jnp}, verbose=False)
  assert res.attempted > 0 and res.failed == 0


def test_matches_float64_reference_bool_mask():
  v, m = _data()
  _assert_sum_close(masked_sum(v, m), np.where(m, v, 0))
  assert float(masked_count(m)) == m.sum()
  mean = float(masked_mean(v, m))
  ref = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  assert abs(mean - ref) <= FP32_TOL * np.abs(np.where(m, v, 0)).sum() / m.sum()


def test_weight_mask_and_axis():
  rng = np.random.default_rng(1)
  v = rng.normal(size=(4, 7)).astype(np.float32)
  w = (rng.random((4, 7)) * (rng.random((4, 7)) < 0.6)).astype(np.float32)
  w[2] = 0.0  # an all-masked row
  out = masked_mean(v, w, axis=-1)
  ref = (v.astype(np.float64) * w).sum(-1) / np.maximum(w.sum(-1), 1e-6)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=FP32_TOL, atol=1e-7)
  assert float(out[2]) == 0.0
  np.testing.assert_allclose(np.asarray(masked_count(w, axis=1)), w.sum(1), rtol=1e-6)
  # Integer masks are weights counted exactly, consistently with masked_sum.
  iw = np.array([0, 2, 1])
  assert float(masked_count(iw)) == 3.0
  assert float(masked_mean(np.array([5.0, 1.0, 4.0], np.float32), iw)) == 2.0


def test_masked_positions_may_hold_nan_and_get_zero_gradient():
  v, m = _data(2)
  v = np.where(m, v, np.nan).astype(np.float32)
  assert np.isfinite(float(masked_mean(v, m)))
  g = jax.grad(lambda x: masked_mean(x, m))(jnp.asarray(v))
  g = np.asarray(g)
  assert np.all(g[~m] == 0.0)
  np.testing.assert_allclose(g[m], 1.0 / m.sum(), rtol=1e-6)


def test_all_masked_is_zero_not_nan():
  v = np.full((3, 5), np.nan, np.float32)
  m = np.zeros((3, 5), bool)
  assert float(masked_sum(v, m)) == 0.0
  assert float(masked_count(m)) == 0.0
  assert float(masked_mean(v, m)) == 0.0
  np.testing.assert_array_equal(np.asarray(masked_mean(v, m, axis=1)), np.zeros(3))
  assert masked_mean(np.zeros((0,), np.float32), np.zeros((0,), bool)).shape == ()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs_reduce_in_float32(dtype):
  # 4096 ones + one 2**-8: a half-precision accumulator would lose the small term.
  v = jnp.concatenate([jnp.ones(4096), jnp.full(1, 2.0**-8)]).astype(dtype)
  m = jnp.ones(v.shape, bool)
  out = masked_sum(v, m)
  assert out.dtype == jnp.float32
  assert float(out) == 4096 + 2.0**-8
  assert masked_mean(v, m).dtype == jnp.float32


def test_errors():
  with pytest.raises(ValueError, match="eps must be > 0"):
    masked_mean(jnp.ones(3), jnp.ones(3, bool), eps=0.0)
  with pytest.raises(ValueError, match=r"mask of shape \(4,\).*values of shape \(3,\)"):
    masked_sum(jnp.ones(3), jnp.ones(4, bool))
  with pytest.raises(ValueError, match="not enlarge"):
    masked_mean(jnp.ones(3), jnp.ones((2, 3), bool))


def test_weight_mask_gradient_ignores_garbage_at_zero_weight():
  # d/dw of sum(w * v) is v: with v = NaN where w = 0, multiplying by zero would give NaN.
  v = np.array([1.0, np.nan, 3.0, np.inf], np.float32)
  w = np.array([0.5, 0.0, 2.0, 0.0], np.float32)
  for f in (masked_sum, masked_mean):
    gv, gw = jax.grad(lambda a, b, f=f: f(a, b), argnums=(0, 1))(jnp.asarray(v), jnp.asarray(w))
    assert np.all(np.isfinite(gv)) and np.all(np.isfinite(gw)), f.__name__
    assert gv[1] == 0 and gv[3] == 0, f.__name__
    if f is masked_sum:  # (a mean's denominator depends on every weight, zero or not)
      assert gw[1] == 0 and gw[3] == 0
  assert float(masked_sum(v, w)) == 6.5
  # Control: the multiply-by-the-mask formulation poisons the weight gradient.
  gw = jax.grad(lambda b: jnp.sum(jnp.asarray(v) * b))(jnp.asarray(w))
  assert np.isnan(gw[1])


def test_lists_and_named_errors():
  assert float(masked_sum([1.0, 2.0, 4.0], [True, False, True])) == 5.0
  assert float(masked_mean([1.0, 2.0, 4.0], [1, 0, 1])) == 2.5
  assert float(masked_count([[True, False]])) == 1.0
  with pytest.raises(TypeError, match="masked_sum: mask must have a bool, integer or float dtype"):
    masked_sum(jnp.ones(2), np.array([1j, 0]))
  with pytest.raises(TypeError, match="masked_mean: values must have a bool, integer or float"):
    masked_mean(np.array(["a", "b"]), np.ones(2, bool))
  with pytest.raises(ValueError, match="masked_sum: axis 2 is out of range for values of rank 2"):
    masked_sum(jnp.ones((2, 3)), jnp.ones((2, 3), bool), axis=2)
  with pytest.raises(TypeError, match="masked_count: axis must be None, an int or a sequence"):
    masked_count(jnp.ones((2, 3), bool), axis=1.0)
  with pytest.raises(TypeError, match="masked_mean: eps must be a real number"):
    masked_mean(jnp.ones(3), jnp.ones(3, bool), eps="1e-6")
  with pytest.raises(TypeError, match="axis_names must be a mesh axis name"):
    masked_sum(jnp.ones(3), jnp.ones(3, bool), axis_names=1)


def _mesh(shape, names):
  n = int(np.prod(shape))
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices, JAX sees {len(jax.devices())}")
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _sharded(fn, d, *arrays):
  """Runs ``fn`` on ``arrays`` split in ``d`` contiguous token shards along mesh axis 'x'."""
  mesh = _mesh((d,), ("x",))
  f = shard_map(fn, mesh=mesh, in_specs=(P("x"),) * len(arrays), out_specs=P())
  return jax.jit(f)(*arrays)


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_device_split_invariance(d):
  v, m = _data(3)
  count = _sharded(lambda m_: masked_count(m_, axis_names="x"), d, m)
  total = _sharded(lambda v_, m_: masked_sum(v_, m_, axis_names=("x",)), d, v, m)
  mean = _sharded(lambda v_, m_: masked_mean(v_, m_, axis_names="x"), d, v, m)
  # Count: exact, hence bitwise the same for every split.
  assert_bitwise_equal(count, masked_count(m), f"count over {d} devices")
  assert float(count) == m.sum()
  # Sum and mean: float32 tolerance (psum re-associates the additions).
  _assert_sum_close(total, np.where(m, v, 0))
  ref_mean = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  assert abs(float(mean) - ref_mean) <= FP32_TOL * np.abs(np.where(m, v, 0)).sum() / m.sum()


def test_control_average_of_device_means_depends_on_split():
  # Moderate values so the difference cannot be rounding.
  rng = np.random.default_rng(4)
  v = rng.normal(size=N).astype(np.float32) + np.arange(N, dtype=np.float32) / 10
  _, m = _data(4)
  ref = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  mesh = _mesh((4,), ("x",))
  per_device = jax.jit(shard_map(lambda v_, m_: masked_mean(v_, m_)[None], mesh=mesh,
                                 in_specs=(P("x"), P("x")), out_specs=P("x")))(v, m)
  average_of_means = float(np.mean(np.asarray(per_device)))
  assert abs(average_of_means - ref) > 100 * FP32_TOL * abs(ref)
  assert abs(float(_sharded(lambda a, b: masked_mean(a, b, axis_names="x"), 4, v, m)) - ref) <= (
      FP32_TOL * abs(ref))


def test_two_axis_mesh_data_by_tp():
  v, m = _data(5)
  v2, m2 = v.reshape(8, N // 8), m.reshape(8, N // 8)
  mesh = _mesh((2, 4), ("data", "tp"))
  f = shard_map(lambda a, b: (masked_mean(a, b, axis_names=("data", "tp")),
                              masked_count(b, axis_names=("data", "tp"))),
                mesh=mesh, in_specs=(P("data", "tp"), P("data", "tp")), out_specs=(P(), P()))
  mean, count = jax.jit(f)(v2, m2)
  assert_bitwise_equal(count, masked_count(m), "count on a 2x4 mesh")
  ref = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  assert abs(float(mean) - ref) <= FP32_TOL * np.abs(np.where(m, v, 0)).sum() / m.sum()


@pytest.mark.parametrize("splits", [(1, 95), (30, 66), (10, 20, 66), (47, 1, 48)])
def test_micro_batch_split_invariance(splits):
  v, m = _data(6)
  bounds = np.cumsum((0,) + splits)
  parts = [(v[a:b], m[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
  counts = [masked_count(mp) for _, mp in parts]
  sums = [masked_sum(vp, mp) for vp, mp in parts]
  # Integer counts added in any order are exact: bitwise.
  assert_bitwise_equal(sum(counts), masked_count(m), f"count over micro-batches {splits}")
  global_mean = float(sum(sums)) / float(sum(counts))
  ref = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  assert abs(global_mean - ref) <= FP32_TOL * np.abs(np.where(m, v, 0)).sum() / m.sum()


def test_control_average_of_micro_batch_means_is_wrong():
  v = np.arange(N, dtype=np.float32)
  _, m = _data(7)
  parts = [(v[:10], m[:10]), (v[10:], m[10:])]
  ref = np.where(m, v.astype(np.float64), 0).sum() / m.sum()
  avg = np.mean([float(masked_mean(a, b)) for a, b in parts])
  glob = sum(float(masked_sum(a, b)) for a, b in parts) / sum(float(masked_count(b))
                                                              for _, b in parts)
  assert abs(avg - ref) > 0.1 * abs(ref)
  assert abs(glob - ref) <= FP32_TOL * abs(ref)
