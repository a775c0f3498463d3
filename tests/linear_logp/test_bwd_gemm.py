"""The GEMM-based linear_logp backward (det_matmul kernels for its three products; on Hopper
they are the Mosaic ones), checked on the CPU with the interpret-mode GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err, wide_rows

from jaxrl_kernels.linear_logp import merge
from jaxrl_kernels.pallas import linear_logp_bwd

H, V = 64, 448  # V: 3 full chunks of 128 and a tail of 64


def _case(dtype, t, layout, seed=0, *, h=H, v=V, implementation=None):
  k = jax.random.split(jax.random.key(seed), 6)
  x = wide_rows(k[0], t, h, dtype, spread=3)
  w = (jax.random.normal(k[1], (h, v), jnp.float32) * 0.3).astype(dtype)
  w = w if layout == "hv" else w.T
  b = jax.random.normal(k[2], (v,), jnp.float32)
  tg = jax.random.randint(k[3], (t,), 0, v)
  gl = jax.random.normal(k[4], (t,), jnp.float32)
  ge = jax.random.normal(k[5], (t,), jnp.float32)
  m, s, u, _ = merge.tile_partials(x, w, b, tg, weight_layout=layout, temperature=0.9,
                                   compute_dtype=dtype, implementation=implementation)
  lse, mean_z, _ = merge.merge_partials(m, s, u, implementation=implementation)
  return x, w, b, tg, lse, mean_z, gl, ge


@pytest.mark.parametrize("dtype,layout", [("float32", "hv"), ("bfloat16", "vh")])
def test_matches_fused_backward_and_dh_rows_are_batch_invariant(dtype, layout):
  args = _case(dtype, 40, layout)
  kw = dict(layout=layout, temperature=0.9, compute_dtype=dtype, interpret=True)
  ref = linear_logp_bwd.backward(*args, **kw)
  fn = jax.jit(lambda *a: linear_logp_bwd.backward_gemm(*a, gemm="interpret", chunk=128, **kw))
  out = fn(*args)
  tol = TOL[dtype][1]
  for name, o, r in zip(("dh", "dw", "db"), out, ref):
    assert o.dtype == r.dtype and o.shape == r.shape, name
    assert rel_err(o, r) < tol, (name, rel_err(o, r))
  # dH rows: computed for a 7-row slice alone, the bits of the same rows in the batch.
  x, w, b, tg, lse, mean_z, gl, ge = args
  sl = slice(11, 18)
  part = fn(x[sl], w, b, tg[sl], lse[sl], mean_z[sl], gl[sl], ge[sl])
  assert_bitwise_equal(part[0], out[0][sl], "dH rows alone vs in the batch")
  # dH in token blocks of 16 rows: the same rows, the same bits.
  blocked = jax.jit(lambda *a: linear_logp_bwd.backward_gemm(*a, gemm="interpret", chunk=128,
                                                             dh_rows=16, **kw))(*args)
  assert_bitwise_equal(blocked[0], out[0], "dH in token blocks")


def test_vocab_shard_with_padding_columns():
  """valid_vocab masks the padding columns (dz = 0, so dW there is exactly 0)."""
  x, w, b, tg, lse, mean_z, gl, ge = _case("float32", 24, "hv", seed=3)
  kw = dict(layout="hv", temperature=0.9, compute_dtype="float32", interpret=True)
  wp = jnp.pad(w, ((0, 0), (0, 64)))
  bp = jnp.pad(b, (0, 64))
  dh, dw, db = linear_logp_bwd.backward_gemm(x, wp, bp, tg, lse, mean_z, gl, ge,
                                             gemm="interpret", chunk=256, valid_vocab=V, **kw)
  ref = linear_logp_bwd.backward(x, w, b, tg, lse, mean_z, gl, ge, **kw)
  assert rel_err(dh, ref[0]) < TOL["float32"][1]
  assert rel_err(dw[:, :V], ref[1]) < TOL["float32"][1]
  assert np.all(np.asarray(dw[:, V:]) == 0) and np.all(np.asarray(db[V:]) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_mosaic_epilogue_accumulation_keeps_the_gradients_bits(layout, monkeypatch):
  """On Hopper dH accumulates in place in the dH GEMM's epilogue;
  the gradients are bitwise those of the product + add path."""
  from jaxrl_kernels._backend import is_hopper
  if not is_hopper():
    pytest.skip("the Mosaic GEMMs need a Hopper GPU")
  t = 300
  # V = 4 full 1024-column chunks and a 640-column tail.
  args = _case("bfloat16", t, layout, seed=4, h=256, v=4096 + 640, implementation="triton")
  w = args[1]
  # dh_rows=128: without the epilogue accumulation dH is added in 128-row blocks.
  kw = dict(layout=layout, temperature=0.9, compute_dtype="bfloat16", gemm="mosaic",
            chunk=1024, dh_rows=128)

  def run(acc, dz, *a):
    monkeypatch.setenv("JAXRL_KERNELS_LOGP_BWD_ACC", acc)
    monkeypatch.setenv("JAXRL_KERNELS_LOGP_BWD_DZ", dz)
    return jax.jit(lambda *a: linear_logp_bwd.backward_gemm(*a, **kw))(*(a or args))

  fused, split = run("1", "0"), run("0", "0")
  for name, f, s_ in zip(("dh", "dw", "db"), fused, split):
    assert_bitwise_equal(f, s_, f"{name}: epilogue accumulation vs product + add")
  ref = linear_logp_bwd.backward(*args, layout=layout, temperature=0.9,
                                 compute_dtype="bfloat16", interpret=False)
  # dz in the logits GEMM's epilogue (the default): the gradients within bf16
  # tolerance of the reference (exp may round differently from XLA's), dH rows
  # batch-invariant (a 37-row slice alone has the bits of the same rows in the batch).
  full = run("1", "1")
  for name, f, r in zip(("dh", "dw", "db"), full, ref):
    assert rel_err(f, r) < TOL["bfloat16"][1], (name, rel_err(f, r))
  sl = slice(100, 137)
  part = run("1", "1", *(a[sl] if a.ndim and a.shape[0] == t and a is not w else a
                         for a in args))
  assert_bitwise_equal(part[0], full[0][sl], "fused dz: dH rows alone vs in the batch")
