"""The "cpu" det_matmul (jaxrl_kernels/gemm/cpu.py): fixed-shape XLA dots.

Its invariance checks here straddle this implementation's row block (CPU_ROW_BLOCK - 1,
CPU_ROW_BLOCK, CPU_ROW_BLOCK + 1 rows), which the contract suite (tests/test_contract.py)
does not aim at. In-process tests run under the suite's XLA flags; tests/test_cpu_fma.py
repeats the invariance checks in a subprocess with FMA contraction on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels import det_matmul
from jaxrl_kernels.contract import CPU_COL_BLOCK, CPU_ROW_BLOCK
from jaxrl_kernels.gemm import cpu

# implementation="cpu" runs where JAX's default backend is the CPU.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="implementation='cpu' needs JAX's CPU backend")

K, N = 96, 160


def _mm(a, b, *, rhs_transposed=False, out_dtype=jnp.float32):
  return jax.jit(lambda a, b: cpu.matmul(a, b, lhs_transposed=False,
                                         rhs_transposed=rhs_transposed, out_dtype=out_dtype))(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rhs_transposed", [False, True])
def test_matches_float64(dtype, rhs_transposed):
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (70, K), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (K, N), jnp.float32).astype(dtype)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  out = _mm(a, b.T if rhs_transposed else b, rhs_transposed=rhs_transposed, out_dtype=dtype)
  assert out.dtype == jnp.dtype(dtype)
  assert rel_err(out, ref) <= TOL[dtype][0]


@pytest.mark.parametrize("rhs_transposed", [False, True])
def test_columns_invariant_to_the_column_shard(rhs_transposed):
  """A column-parallel shard of the weight (N / tp columns, as a TP layer holds) gives
  the bits of those columns of the full product: every product is one
  ``[CPU_ROW_BLOCK, K] x [K, CPU_COL_BLOCK]`` dot. Shards narrower than the block, off
  its grid, and wider than it. Control: plain XLA dots pick their K blocking from N."""
  x = wide_rows(jax.random.key(3), 24, 256, jnp.float32)
  n = 2 * CPU_COL_BLOCK + 44
  w = jax.random.normal(jax.random.key(4), (256, n), jnp.float32)
  full = _mm(x, w.T if rhs_transposed else w, rhs_transposed=rhs_transposed)
  for lo, width in ((0, 8), (8, 8), (16, 16), (40, 24), (0, CPU_COL_BLOCK),
                    (CPU_COL_BLOCK - 4, CPU_COL_BLOCK + 12), (n - 44, 44)):
    ws = w[:, lo:lo + width]
    got = _mm(x, ws.T if rhs_transposed else ws, rhs_transposed=rhs_transposed)
    assert_bitwise_equal(got, full[:, lo:lo + width], f"columns {lo}:{lo + width}")
  dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
  stock = dot(x, w)
  assert any(not np.array_equal(bits(dot(x, w[:, :width])), bits(stock[:, :width]))
             for width in (1, 8, 16)), "control: plain XLA dots kept the bits of every shard"


def test_rows_invariant_to_batch_position_padding_and_chunks():
  x = wide_rows(jax.random.key(1), 2 * CPU_ROW_BLOCK + 44, K, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (K, N), jnp.bfloat16)
  full = _mm(x, w)
  for m in (1, 3, CPU_ROW_BLOCK - 1, CPU_ROW_BLOCK, CPU_ROW_BLOCK + 1, 200):
    assert_bitwise_equal(_mm(x[:m], w), full[:m], f"batch {m}")
  for r in (0, 137, x.shape[0] - 1):  # each row alone
    assert_bitwise_equal(_mm(x[r:r + 1], w), full[r:r + 1], f"row {r}")
  # A row at positions 0, 137 and 255 of a 256-row batch.
  row = x[5:6]
  base = x[:256]
  for pos in (0, 137, 255):
    out = _mm(base.at[pos].set(row[0]), w)
    assert_bitwise_equal(out[pos:pos + 1], full[5:6], f"position {pos}")
  # Padding rows before and after; chunks 100/156 and 1/255.
  pad = jax.random.normal(jax.random.key(3), (9, K), jnp.bfloat16)
  out = _mm(jnp.concatenate([pad, x[:50], pad]), w)
  assert_bitwise_equal(out[9:59], full[:50], "padding")
  for cut in (100, 1):
    out = jnp.concatenate([_mm(x[:cut], w), _mm(x[cut:256], w)])
    assert_bitwise_equal(out, full[:256], f"chunks {cut}/{256 - cut}")
  # The "vh" operand ([N, K], read transposed) gives the same bits as [K, N].
  assert_bitwise_equal(_mm(x[:7], w.T, rhs_transposed=True), full[:7], "rhs_transposed")


def test_control_plain_dot_changes_bits_with_batch():
  x = wide_rows(jax.random.key(1), 2 * CPU_ROW_BLOCK + 44, K, jnp.float32)
  w = jax.random.normal(jax.random.key(2), (K, N), jnp.float32)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
  full = np.asarray(dot(x, w))
  changed = [m for m in (1, 3, 7, 50, 129, 200)
             if not np.array_equal(bits(dot(x[:m], w)), bits(full[:m]))]
  assert changed, "plain jnp.dot gave the same bits at every batch size here"


def test_reduction_over_rows_is_deterministic_and_accurate():
  # dB = lhs^T rhs, lhs [K=tokens, M]: summed over token blocks in ascending order.
  ka, kb = jax.random.split(jax.random.key(4))
  a = wide_rows(ka, 300, 48, jnp.float32)
  g = jax.random.normal(kb, (300, 40), jnp.float32)
  f = jax.jit(lambda a, g: cpu.matmul(a, g, lhs_transposed=True, rhs_transposed=False,
                                      out_dtype=jnp.float32))
  first = f(a, g)
  for _ in range(20):
    assert_bitwise_equal(f(a, g), first, "run to run")
  ref = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  assert rel_err(first, ref) <= TOL["float32"][1]
  # rhs given [N, K]
  ft = jax.jit(lambda a, g: cpu.matmul(a, g, lhs_transposed=True, rhs_transposed=True,
                                       out_dtype=jnp.float32))
  assert rel_err(ft(a, g.T), ref) <= TOL["float32"][1]


def test_empty_operands():
  w = jnp.ones((8, 5), jnp.float32)
  assert _mm(jnp.zeros((0, 8)), w).shape == (0, 5)
  out = cpu.matmul(jnp.zeros((3, 0)), jnp.zeros((0, 5)), lhs_transposed=False,
                   rhs_transposed=False, out_dtype=jnp.bfloat16)
  assert out.shape == (3, 5) and out.dtype == jnp.bfloat16 and not np.any(np.asarray(out))


def test_det_matmul_cpu_gradients():
  ka, kb, kg = jax.random.split(jax.random.key(5), 3)
  a = jax.random.normal(ka, (2, 33, K), jnp.float32)
  b = jax.random.normal(kb, (K, N), jnp.float32)
  g = jax.random.normal(kg, (2, 33, N), jnp.float32)

  def loss(a, b):
    return jnp.sum(det_matmul(a, b, implementation="cpu") * g)

  da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
  a64, b64, g64 = (np.asarray(x, np.float64) for x in (a, b, g))
  assert rel_err(da, g64 @ b64.T) <= TOL["float32"][1]
  assert rel_err(db, a64.reshape(-1, K).T @ g64.reshape(-1, N)) <= TOL["float32"][1]
  # dA rows are batch-invariant.
  da1 = jax.jit(jax.grad(lambda a, b: jnp.sum(det_matmul(a, b, implementation="cpu") *
                                              g[0, :1]), argnums=0))(a[0, :1], b)
  assert_bitwise_equal(da1, da[0, :1], "dA row")


def _mesh2():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 CPU devices (--xla_force_host_platform_device_count)")
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))


def test_inside_a_user_shard_map_with_check_vma():
  """The loop carries take the operands' varying axes: the rows of each shard are
  bitwise the unsharded call's."""
  mesh = _mesh2()
  spec = jax.sharding.PartitionSpec("d")
  a = wide_rows(jax.random.key(5), 36, K, jnp.float32)
  b = jax.random.normal(jax.random.key(6), (K, N), jnp.float32)
  f = jax.shard_map(lambda x: det_matmul(x, b, implementation="cpu"), mesh=mesh,
                    in_specs=spec, out_specs=spec, check_vma=True)
  assert_bitwise_equal(f(a), det_matmul(a, b, implementation="cpu"), "det_matmul in shard_map")
  # the dB product (a reduction over the shard's rows) runs there too
  g = jax.shard_map(lambda x, y: cpu.matmul(x, y, lhs_transposed=True, rhs_transposed=False,
                                            out_dtype=jnp.float32)[None],
                    mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=True)
  c = jax.random.normal(jax.random.key(7), (36, N), jnp.float32)
  db = g(a, c)
  for i in range(2):
    rows = slice(18 * i, 18 * (i + 1))
    want = cpu.matmul(a[rows], c[rows], lhs_transposed=True, rhs_transposed=False,
                      out_dtype=jnp.float32)
    assert_bitwise_equal(db[i], want, f"dB of shard {i}")


def test_grad_inside_a_user_shard_map_with_check_vma():
  mesh = _mesh2()
  spec = jax.sharding.PartitionSpec("d")
  a = wide_rows(jax.random.key(5), 36, K, jnp.float32)
  b = jax.random.normal(jax.random.key(6), (K, N), jnp.float32)
  loss = lambda x: jnp.sum(det_matmul(x, b, implementation="cpu") ** 2)  # noqa: E731
  f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
  assert_bitwise_equal(f(a), jax.grad(loss)(a), "dA in shard_map")
