"""The GEMM-based linear_logp backward (det_matmul kernels for its three products; on Hopper
they are the Mosaic ones), checked on the CPU with the interpret-mode GEMM, and the
BackwardConfig that selects it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err, wide_rows

from jaxrl_kernels.linear_logp import (
  BackwardConfig,
  gemm_backward,
  linear_logp,
  merge_partials,
  tile_partials,
)
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
  implementation = implementation or "interpret"
  m, s, u, _ = tile_partials(x, w, b, tg, weight_layout=layout, temperature=0.9,
                             compute_dtype=dtype, implementation=implementation)
  lse, mean_z, _ = merge_partials(m, s, u, implementation=implementation)
  return x, w, b, tg, lse, mean_z, gl, ge


@pytest.mark.parametrize("dtype,layout", [("float32", "hv"), ("bfloat16", "vh")])
def test_matches_fused_backward_and_dh_rows_are_batch_invariant(dtype, layout):
  args = _case(dtype, 40, layout)
  kw = dict(layout=layout, temperature=0.9, compute_dtype=dtype)
  ref = linear_logp_bwd.backward(*args, interpret=True, **kw)
  fn = jax.jit(lambda *a: gemm_backward.backward(*a, gemm="interpret", chunk=128, **kw))
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
  blocked = jax.jit(lambda *a: gemm_backward.backward(*a, gemm="interpret", chunk=128,
                                                      dh_rows=16, **kw))(*args)
  assert_bitwise_equal(blocked[0], out[0], "dH in token blocks")


def test_vocab_shard_with_padding_columns():
  """valid_vocab masks the padding columns (dz = 0, so dW there is exactly 0)."""
  x, w, b, tg, lse, mean_z, gl, ge = _case("float32", 24, "hv", seed=3)
  kw = dict(layout="hv", temperature=0.9, compute_dtype="float32")
  wp = jnp.pad(w, ((0, 0), (0, 64)))
  bp = jnp.pad(b, (0, 64))
  dh, dw, db = gemm_backward.backward(x, wp, bp, tg, lse, mean_z, gl, ge, gemm="interpret",
                                      chunk=256, valid_vocab=V, **kw)
  ref = linear_logp_bwd.backward(x, w, b, tg, lse, mean_z, gl, ge, interpret=True, **kw)
  assert rel_err(dh, ref[0]) < TOL["float32"][1]
  assert rel_err(dw[:, :V], ref[1]) < TOL["float32"][1]
  assert np.all(np.asarray(dw[:, V:]) == 0) and np.all(np.asarray(db[V:]) == 0)


@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_mosaic_epilogue_accumulation_keeps_the_gradients_bits(layout):
  """On Hopper dH accumulates in place in the dH GEMM's epilogue;
  the gradients are bitwise those of the product + add path."""
  t = 300
  # V = 4 full 1024-column chunks and a 640-column tail.
  args = _case("bfloat16", t, layout, seed=4, h=256, v=4096 + 640, implementation="triton")
  w = args[1]
  # dh_rows=128: without the epilogue accumulation dH is added in 128-row blocks.
  kw = dict(layout=layout, temperature=0.9, compute_dtype="bfloat16", gemm="mosaic",
            chunk=1024, dh_rows=128)

  def run(acc, dz, *a):
    fn = lambda *a: gemm_backward.backward(*a, accumulate=acc, fuse_dz=dz, **kw)  # noqa: E731
    return jax.jit(fn)(*(a or args))

  fused, split = run(True, False), run(False, False)
  for name, f, s_ in zip(("dh", "dw", "db"), fused, split):
    assert_bitwise_equal(f, s_, f"{name}: epilogue accumulation vs product + add")
  ref = linear_logp_bwd.backward(*args, layout=layout, temperature=0.9,
                                 compute_dtype="bfloat16", interpret=False)
  # dz in the logits GEMM's epilogue (the default): the gradients within bf16
  # tolerance of the reference (exp may round differently from XLA's), dH rows
  # batch-invariant (a 37-row slice alone has the bits of the same rows in the batch).
  full = run(True, True)
  for name, f, r in zip(("dh", "dw", "db"), full, ref):
    assert rel_err(f, r) < TOL["bfloat16"][1], (name, rel_err(f, r))
  sl = slice(100, 137)
  part = run(True, True, *(a[sl] if a.ndim and a.shape[0] == t and a is not w else a
                         for a in args))
  assert_bitwise_equal(part[0], full[0][sl], "fused dz: dH rows alone vs in the batch")


@pytest.mark.parametrize("config", [BackwardConfig(kernel="gemm", chunk=128),
                                    BackwardConfig(kernel="gemm", chunk=256, dh_rows=8),
                                    BackwardConfig(kernel="fused", chunk=128)])
def test_backward_config_keeps_dh_row_bits_and_accuracy(config):
  """Every BackwardConfig of one implementation: dH rows bitwise batch-invariant, gradients
  within tolerance of the default; a config is part of the jit cache key (no env vars)."""
  x, w, b, tg, *_ = _case("float32", 40, "hv", seed=5)

  def grads(cfg, x, tg):
    def loss(x, w, b):
      return jnp.sum(linear_logp(x, w, tg, bias=b, temperature=0.9, implementation="interpret",
                                 config=cfg))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)

  ref = grads(None, x, tg)
  out = grads(config, x, tg)
  for name, o, r in zip(("dh", "dw", "db"), out, ref):
    assert rel_err(o, r) < TOL["float32"][1], (name, rel_err(o, r))
  sl = slice(7, 19)
  part = grads(config, x[sl], tg[sl])
  assert_bitwise_equal(part[0], out[0][sl], f"{config}: dH rows alone vs in the batch")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kernel="tiled"), "kernel must be one of"),
    (dict(chunk=100), "multiple of VOCAB_TILE"),
    (dict(chunk=0), "chunk must be a positive int"),
    (dict(dh_rows=2.5), "dh_rows must be a positive int"),
])
def test_backward_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    BackwardConfig(**kwargs)
  with pytest.raises(TypeError, match="accumulate must be a bool"):
    BackwardConfig(accumulate=1)
  with pytest.raises(TypeError, match="config must be a BackwardConfig"):
    linear_logp(jnp.zeros((2, 4)), jnp.zeros((4, 8)), jnp.array([1, 2]),
                implementation="interpret", config={"chunk": 128})


def test_backward_without_entropy_reads_no_entropy_cotangent():
  """``entropy=False`` (the op returned no entropy): dz has no entropy term, so ``g_ent`` and
  ``mean_z`` are not read; the gradients are those of ``g_ent = 0`` (equal values; only
  the sign of an exact zero may differ). With NaN in both, nothing reaches the
  gradients; the control shows the entropy-reading backward would carry it."""
  x, w, b, tg, lse, mean_z, gl, ge = _case("float32", 24, "hv", seed=5)
  kw = dict(layout="hv", temperature=0.9, compute_dtype="float32", gemm="interpret", chunk=128)
  want = gemm_backward.backward(x, w, b, tg, lse, mean_z, gl, jnp.zeros_like(ge), **kw)
  nan = jnp.full_like(ge, jnp.nan)
  got = gemm_backward.backward(x, w, b, tg, lse, nan, gl, nan, entropy=False, **kw)
  for name, g, r in zip(("dh", "dw", "db"), got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
  with_entropy = gemm_backward.backward(x, w, b, tg, lse, nan, gl, nan, **kw)
  assert np.isnan(np.asarray(with_entropy[0])).all()
