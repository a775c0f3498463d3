"""det_matmul on the CPU: accuracy against float64, gradients, transformations, errors.

The invariance contract (batch, position, padding, chunking, mode, run to run, and
the stock path's control) is tests/test_contract.py, for every implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_kernels import _backend, det_matmul
from jaxrl_kernels.gemm import api as gemm_api
from jaxrl_kernels.gemm import matmul2d
from jaxrl_kernels.gemm import mosaic as gemm_mosaic_backend
from jaxrl_kernels.gemm.api import resolve_implementation
from jaxrl_kernels.gemm.reference import matmul_grads_reference, matmul_reference

IMPL = "interpret"  # the Pallas kernel's semantics; "cpu" joins where noted
DTYPES = ["float32", "bfloat16", "float16"]
CPU_IMPLS = ["cpu", "interpret"]


def _inputs(dtype, m=70, k=150, n=90, seed=0, transpose_b=False):
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, k) if transpose_b else (k, n), jnp.float32).astype(dtype)
  return a, b


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
def test_forward_matches_float64_reference(dtype, transpose_b, impl):
  a, b = _inputs(dtype, transpose_b=transpose_b)
  out = det_matmul(a, b, transpose_b=transpose_b, implementation=impl)
  assert out.dtype == jnp.dtype(dtype) and out.shape == (70, 90)
  ref = matmul_reference(a, b, transpose_b=transpose_b)
  assert rel_err(out, ref) <= TOL[dtype][0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_out_dtype_float32_keeps_the_accumulator(dtype):
  a, b = _inputs(dtype)
  out = det_matmul(a, b, out_dtype=jnp.float32, implementation=IMPL)
  assert out.dtype == jnp.float32
  # fp32 output of half inputs: only the product rounding remains.
  assert rel_err(out, matmul_reference(a, b)) <= 1e-5


def test_leading_dims_are_flattened():
  a, b = _inputs("float32", m=24)
  a3 = a.reshape(2, 3, 4, 150)
  out = det_matmul(a3, b, implementation=IMPL)
  assert out.shape == (2, 3, 4, 90)
  assert_bitwise_equal(out.reshape(24, 90), det_matmul(a, b, implementation=IMPL), "3-D vs 2-D")


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gradients_match_float64_reference(dtype, transpose_b, impl):
  a, b = _inputs(dtype, m=50, k=70, n=40, seed=3, transpose_b=transpose_b)
  g = jax.random.normal(jax.random.key(11), (50, 40), jnp.float32).astype(dtype)
  _, vjp = jax.vjp(lambda a, b: det_matmul(a, b, transpose_b=transpose_b, implementation=impl),
                   a, b)
  da, db = vjp(g)
  assert da.dtype == a.dtype and db.dtype == b.dtype and db.shape == b.shape
  rda, rdb = matmul_grads_reference(a, b, g, transpose_b=transpose_b)
  assert rel_err(da, rda) <= TOL[dtype][1]
  assert rel_err(db, rdb) <= TOL[dtype][1]


def test_backward_uses_no_xla_dot():
  a, b = _inputs("float32", m=16, k=32, n=24)
  jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: det_matmul(a, b, implementation=IMPL).sum(),
                                  argnums=(0, 1)))(a, b)
  text = str(jaxpr)
  assert "pallas_call" in text
  # dot_generals appear only inside the Pallas kernels' bodies.
  outer = [str(e.primitive) for e in jaxpr.jaxpr.eqns]
  assert "dot_general" not in outer


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_grad_rows_are_batch_invariant(impl):
  k, n = 64, 96
  x = wide_rows(jax.random.key(12), 150, k, jnp.float32)
  w = jax.random.normal(jax.random.key(13), (k, n), jnp.float32)
  gout = wide_rows(jax.random.key(14), 150, n, jnp.float32)

  def da(xs, gs):
    _, vjp = jax.vjp(lambda a: det_matmul(a, w, implementation=impl), xs)
    return vjp(gs)[0]

  full = da(x, gout)
  for r in (0, 75, 149):
    assert_bitwise_equal(da(x[r:r + 1], gout[r:r + 1]), full[r:r + 1], f"dA row {r}")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_db_is_run_to_run_deterministic(impl):
  a, b = _inputs("bfloat16", m=130, k=64, n=72)
  f = jax.jit(jax.grad(lambda b: det_matmul(a, b, implementation=impl).astype(jnp.float32).sum()))
  first = bits(f(b))
  for _ in range(5):
    assert np.array_equal(bits(f(b)), first)


def test_jit_vmap_grad_compose():
  a, b = _inputs("float32", m=12, k=40, n=20)
  batched = jnp.stack([a, 2 * a, -a])
  f = lambda x: det_matmul(x, b, implementation=IMPL)
  vm = jax.jit(jax.vmap(f))(batched)
  for i in range(3):
    assert_bitwise_equal(vm[i], f(batched[i]), f"vmap slice {i}")
  g = jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(a)
  ref = 2 * matmul_reference(a, b) @ np.asarray(b, np.float64).T
  assert rel_err(g, ref) <= 1e-4


def test_empty_and_degenerate_shapes():
  b = jnp.ones((16, 8), jnp.float32)
  assert det_matmul(jnp.ones((0, 16)), b, implementation=IMPL).shape == (0, 8)
  assert det_matmul(jnp.ones((2, 0, 16)), b, implementation=IMPL).shape == (2, 0, 8)
  out = det_matmul(jnp.ones((3, 16)), b, implementation=IMPL)
  np.testing.assert_array_equal(np.asarray(out), np.full((3, 8), 16.0))
  da = jax.grad(lambda x: det_matmul(x, b, implementation=IMPL).sum())(jnp.ones((0, 16)))
  assert da.shape == (0, 16)


def test_bad_inputs_raise_clear_errors():
  a = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"K=8 .* K=9"):
    det_matmul(a, jnp.ones((9, 3), jnp.float32))
  with pytest.raises(ValueError, match=r"\[N, K\] has K=3"):
    det_matmul(a, jnp.ones((8, 3), jnp.float32), transpose_b=True)
  with pytest.raises(TypeError, match="same dtype"):
    det_matmul(a, jnp.ones((8, 3), jnp.bfloat16))
  with pytest.raises(TypeError, match="int32"):
    det_matmul(a.astype(jnp.int32), jnp.ones((8, 3), jnp.int32))
  with pytest.raises(ValueError, match="2-D"):
    det_matmul(a, jnp.ones((8,), jnp.float32))
  with pytest.raises(ValueError, match="implementation must be one of"):
    det_matmul(a, jnp.ones((8, 3)), implementation="cublas")
  with pytest.raises(TypeError, match="transpose_b"):
    det_matmul(a, jnp.ones((8, 3)), transpose_b=1)
  with pytest.raises(TypeError, match=r"out_dtype must be one of .*got 'nonsense'"):
    det_matmul(a, jnp.ones((8, 3)), out_dtype="nonsense")
  with pytest.raises(TypeError, match=r"out_dtype must be one of .*got int32"):
    det_matmul(a, jnp.ones((8, 3)), out_dtype=jnp.int32)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU error path")
@pytest.mark.parametrize("impl", ["mosaic", "triton", "cuda"])
def test_gpu_implementations_explain_what_is_missing_on_cpu(impl):
  with pytest.raises(_backend.ImplementationUnavailableError,
                     match="needs a CUDA GPU.*use implementation='cpu'"):
    det_matmul(jnp.ones((4, 8)), jnp.ones((8, 3)), implementation=impl)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_default_implementation_on_cpu_is_cpu():
  assert resolve_implementation(None, jnp.bfloat16, 128, 128) == "cpu"
  a, b = _inputs("float32", m=9, k=40, n=24)
  assert_bitwise_equal(det_matmul(a, b), det_matmul(a, b, implementation="cpu"), "default")


def test_dispatch_table_names_every_backend():
  """One table: every implementation name maps to a backend object of that name, and
  the 2-D entry point other ops call runs it."""
  assert set(gemm_api.BACKENDS) == set(_backend.IMPLEMENTATIONS)
  for name, backend in gemm_api.BACKENDS.items():
    assert backend.name == name
    assert backend.batch_invariant == (name != "xla")
  a, b = _inputs("float32", m=5, k=40, n=24)
  out = matmul2d(a, b.T, lhs_transposed=False, rhs_transposed=True, out_dtype=jnp.float32,
                 implementation="interpret")
  assert_bitwise_equal(out, det_matmul(a, b, implementation="interpret"), "matmul2d")
  db = matmul2d(a, jnp.ones((5, 24)), lhs_transposed=True, rhs_transposed=False,
                out_dtype=jnp.float32, implementation="interpret")
  assert rel_err(db, np.asarray(a, np.float64).T @ np.ones((5, 24))) <= 1e-5


def test_mosaic_support_is_decided_by_the_weight_only():
  """The Mosaic backend's support check takes N, K and dtype (never M); the default
  falls back to Triton for a weight it does not take, an explicit request is refused."""
  assert gemm_mosaic_backend.supported(256, 192, jnp.bfloat16) is None
  assert "K=100" in gemm_mosaic_backend.supported(256, 100, jnp.bfloat16)
  assert "float32" in gemm_mosaic_backend.supported(256, 192, jnp.float32)


def test_inside_a_users_shard_map():
  """det_matmul traced inside shard_map (and jit) on the 8-device host mesh: each
  shard's rows are the bits of the unsharded call."""
  from jax.sharding import PartitionSpec as P

  from jaxrl_kernels._compat import shard_map
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("dp",))
  a, b = _inputs("float32", m=64, k=40, n=24)
  f = shard_map(lambda x: det_matmul(x, b), mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                check_vma=False)
  assert_bitwise_equal(f(a), det_matmul(a, b), "eager shard_map")
  assert_bitwise_equal(jax.jit(f)(a), det_matmul(a, b), "jit(shard_map)")


@pytest.mark.slow  # ten interpreted compilations of random shapes
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 80), k=st.integers(1, 150), n=st.integers(1, 140),
       dtype=st.sampled_from(DTYPES), transpose_b=st.booleans(), seed=st.integers(0, 2**16))
def test_hypothesis_shapes(m, k, n, dtype, transpose_b, seed):
  a, b = _inputs(dtype, m=m, k=k, n=n, seed=seed, transpose_b=transpose_b)
  out = det_matmul(a, b, transpose_b=transpose_b, implementation=IMPL)
  assert out.shape == (m, n)
  assert rel_err(out, matmul_reference(a, b, transpose_b=transpose_b)) <= TOL[dtype][0]
  r = m // 2
  assert_bitwise_equal(out[r:r + 1],
                       det_matmul(a[r:r + 1], b, transpose_b=transpose_b, implementation=IMPL),
                       "single row")
