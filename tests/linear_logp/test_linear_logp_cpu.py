"""The "cpu" LM head (jaxrl_kernels/linear_logp/cpu.py): fixed-shape XLA blocks.

Its invariance checks here straddle this implementation's own blocks (CPU_ROW_BLOCK rows,
CPU_VOCAB_CHUNK vocab columns), which the contract suite's small shapes
(tests/test_contract.py) do not reach. In-process tests run under the suite's XLA flags;
tests/test_cpu_fma.py repeats the invariance checks in a subprocess with FMA contraction on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels import linear_logp
from jaxrl_kernels.contract import CPU_ROW_BLOCK, CPU_VOCAB_CHUNK, VOCAB_TILE
from jaxrl_kernels.linear_logp import cpu
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

# implementation="cpu" runs where JAX's default backend is the CPU.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="implementation='cpu' needs JAX's CPU backend")

H = 64
# Two full vocab chunks and a partial one, not a multiple of VOCAB_TILE.
V = 2 * CPU_VOCAB_CHUNK + 3 * VOCAB_TILE + 37


def _inputs(t, v=V, dtype=jnp.bfloat16, layout="hv", seed=0):
  kh, kw, kt, kb = jax.random.split(jax.random.key(seed), 4)
  h = wide_rows(kh, t, H, jnp.float32, spread=3).astype(dtype)
  w = (jax.random.normal(kw, (H, v), jnp.float32) * 0.3).astype(dtype)
  if layout == "vh":
    w = w.T
  tg = jax.random.randint(kt, (t,), 0, v)
  b = (jax.random.normal(kb, (v,), jnp.float32) * 0.5).astype(dtype)
  return h, w, tg, b


@functools.partial(jax.jit, static_argnames=("layout", "entropy", "with_bias"))
def _fwd(h, w, tg, b, *, layout="hv", entropy=True, with_bias=False):
  return linear_logp(h, w, tg, bias=b if with_bias else None, weight_layout=layout,
                     return_entropy=entropy, implementation="cpu")


@functools.partial(jax.jit, static_argnames=("layout", "with_bias"))
def _grads(h, w, tg, b, g_logp, g_ent, mask=None, *, layout="hv", with_bias=False):
  def loss(h, w, b):
    lp, ent = linear_logp(h, w, tg, bias=b if with_bias else None, weight_layout=layout,
                          return_entropy=True, mask=mask, implementation="cpu")
    return jnp.sum(lp * g_logp + ent * g_ent), (lp, ent)

  return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(h, w, b)


@pytest.mark.parametrize("dtype,layout,with_bias", [
    ("bfloat16", "hv", False), ("bfloat16", "vh", True), ("float32", "hv", True),
    ("float16", "vh", False)])
def test_forward_and_gradients_match_float64(dtype, layout, with_bias):
  t = 37
  h, w, tg, b = _inputs(t, dtype=dtype, layout=layout)
  kg = jax.random.split(jax.random.key(9))
  g_logp = jax.random.normal(kg[0], (t,), jnp.float32)
  g_ent = jax.random.normal(kg[1], (t,), jnp.float32)
  ref = linear_logp_reference(h, w, tg, bias=b if with_bias else None, weight_layout=layout,
                              g_logp=g_logp, g_ent=g_ent)
  lp, ent = _fwd(h, w, tg, b, layout=layout, with_bias=with_bias)
  fwd_tol, grad_tol = TOL[dtype]
  assert rel_err(lp, ref["logp"]) <= fwd_tol and rel_err(ent, ref["entropy"]) <= fwd_tol
  (dh, dw, db), (lp2, ent2) = _grads(h, w, tg, b, g_logp, g_ent, layout=layout,
                                     with_bias=with_bias)
  assert dh.dtype == h.dtype and dw.dtype == w.dtype
  assert rel_err(dh, ref["dh"]) <= grad_tol
  assert rel_err(dw, ref["dw"]) <= grad_tol
  if with_bias:
    assert rel_err(db, ref["db"]) <= grad_tol
  # Mode: the forward inside jax.grad gives the forward-only bits.
  assert_bitwise_equal(lp2, lp, "logp forward vs training")
  assert_bitwise_equal(ent2, ent, "entropy forward vs training")


def test_fp32_head_of_bf16_parameters():
  t = 20
  h, w, tg, _ = _inputs(t)
  out = jax.jit(lambda h, w: linear_logp(h, w, tg, fp32_head=True, implementation="cpu"))(h, w)
  ref = linear_logp_reference(h, w, tg)
  assert rel_err(out, ref["logp"]) <= TOL["float32"][0]


def test_rows_invariant_to_batch_position_padding_chunks_and_mode():
  t = 2 * CPU_ROW_BLOCK + 44
  h, w, tg, b = _inputs(t, seed=1)
  lp, ent = _fwd(h, w, tg, b, with_bias=True)
  for m in (1, CPU_ROW_BLOCK - 1, CPU_ROW_BLOCK + 1):
    lp_m, ent_m = _fwd(h[:m], w, tg[:m], b, with_bias=True)
    assert_bitwise_equal(lp_m, lp[:m], f"logp batch {m}")
    assert_bitwise_equal(ent_m, ent[:m], f"entropy batch {m}")
  for pos in (0, 137, 255):
    hp = h[:256].at[pos].set(h[5])
    tp = tg[:256].at[pos].set(tg[5])
    lp_p, ent_p = _fwd(hp, w, tp, b, with_bias=True)
    assert_bitwise_equal(lp_p[pos], lp[5], f"position {pos}")
    assert_bitwise_equal(ent_p[pos], ent[5], f"position {pos}")
  pad = jnp.ones((5, H), h.dtype) * 3
  lp_pad, _ = _fwd(jnp.concatenate([pad, h[:40], pad]), w,
                   jnp.concatenate([tg[:5], tg[:40], tg[:5]]), b, with_bias=True)
  assert_bitwise_equal(lp_pad[5:45], lp[:40], "padding")
  lp_a, _ = _fwd(h[:100], w, tg[:100], b, with_bias=True)
  lp_b, _ = _fwd(h[100:256], w, tg[100:256], b, with_bias=True)
  assert_bitwise_equal(jnp.concatenate([lp_a, lp_b]), lp[:256], "chunks 100/156")
  # Mode: logp alone (no entropy requested) gives the same bits.
  assert_bitwise_equal(_fwd(h[:9], w, tg[:9], b, entropy=False, with_bias=True), lp[:9],
                       "logp without entropy")
  # Run to run.
  for _ in range(20):
    assert_bitwise_equal(_fwd(h[:64], w, tg[:64], b, with_bias=True)[0], lp[:64], "repeat")


def test_control_materialized_xla_changes_bits_with_batch():
  t = 2 * CPU_ROW_BLOCK + 44
  h, w, tg, _ = _inputs(t, seed=1, dtype=jnp.float32)
  f = jax.jit(lambda h, w, tg: linear_logp(h, w, tg, implementation="xla"))
  full = np.asarray(f(h, w, tg))
  changed = [m for m in (1, 3, 7, 50, 129, 200)
             if not np.array_equal(bits(f(h[:m], w, tg[:m])), bits(full[:m]))]
  assert changed, "the materialized XLA path gave the same bits at every batch size here"


def test_dh_rows_batch_invariant_and_weight_grads_deterministic():
  t = CPU_ROW_BLOCK + 30
  h, w, tg, b = _inputs(t, seed=2)
  g_logp = jnp.linspace(-1.0, 1.0, t, dtype=jnp.float32)
  g_ent = jnp.linspace(0.5, -0.5, t, dtype=jnp.float32)
  (dh, dw, db), _ = _grads(h, w, tg, b, g_logp, g_ent, with_bias=True)
  for m in (1, CPU_ROW_BLOCK + 1):
    (dh_m, _, _), _ = _grads(h[:m], w, tg[:m], b, g_logp[:m], g_ent[:m], with_bias=True)
    assert_bitwise_equal(dh_m, dh[:m], f"dh batch {m}")
  for _ in range(5):
    (_, dw2, db2), _ = _grads(h, w, tg, b, g_logp, g_ent, with_bias=True)
    assert_bitwise_equal(dw2, dw, "dW run to run")
    assert_bitwise_equal(db2, db, "db run to run")


def test_masked_nan_rows_contribute_nothing():
  t = 30
  h, w, tg, b = _inputs(t, seed=3)
  mask = jnp.arange(t) % 3 != 0
  h_nan = jnp.where(mask[:, None], h, jnp.nan)
  tg_bad = jnp.where(mask, tg, -100)
  g = jnp.ones((t,), jnp.float32)
  (dh, dw, db), (lp, ent) = _grads(h_nan, w, tg_bad, b, g, g, mask, with_bias=True)
  for x in (dh, dw, db, lp, ent):
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
  assert not np.any(np.asarray(dh, np.float32)[~np.asarray(mask)])
  # The same gradients as with the masked rows dropped.
  keep = np.asarray(mask)
  (dh2, dw2, db2), _ = _grads(h[keep], w, tg[keep], b, g[keep], g[keep], with_bias=True)
  assert_bitwise_equal(dh[keep], dh2, "dh")
  assert rel_err(dw, dw2) <= 1e-6 and rel_err(db, db2) <= 1e-6


def test_empty_batch():
  _, w, _, _ = _inputs(1)
  lp, ent = linear_logp(jnp.zeros((0, H), jnp.bfloat16), w, jnp.zeros((0,), jnp.int32),
                        return_entropy=True, implementation="cpu")
  assert lp.shape == ent.shape == (0,)
  dh, dw, db = cpu.backward(jnp.zeros((0, H), jnp.bfloat16), w, None, jnp.zeros((0,), jnp.int32),
                            *(jnp.zeros((0,), jnp.float32),) * 4, layout="hv", temperature=1.0,
                            compute_dtype=jnp.bfloat16)
  assert dh.shape == (0, H) and dw.shape == w.shape and db is None


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_vocab_shards_on_the_tile_grid_give_the_unsharded_bits(layout):
  t = 21
  h, w, tg, b = _inputs(t, seed=5, layout=layout)
  kw = dict(layout=layout, temperature=1.0, compute_dtype=jnp.bfloat16)
  full = jax.jit(lambda: cpu.tile_partials(h, w, b, tg, **kw))()
  # Uneven shards whose boundaries fall on VOCAB_TILE (not on CPU_VOCAB_CHUNK).
  bounds = [0, 5 * VOCAB_TILE, 12 * VOCAB_TILE, 19 * VOCAB_TILE, V]
  parts = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    w_s = w[:, lo:hi] if layout == "hv" else w[lo:hi]
    parts.append(jax.jit(lambda w_s, b_s, lo=lo: cpu.tile_partials(h, w_s, b_s, tg,
                                                                   vocab_offset=lo, **kw))(
                                                                       w_s, b[lo:hi]))
  for i, name in enumerate("msu"):
    assert_bitwise_equal(jnp.concatenate([p[i] for p in parts]), full[i], name)
  assert_bitwise_equal(sum(p[3] for p in parts), full[3], "target logit")
  merged = jax.jit(cpu.merge_partials)(*full[:3])
  lse_ref = linear_logp_reference(h, w, tg, bias=b, weight_layout=layout)
  logp = full[3] - merged[0]
  assert rel_err(logp, lse_ref["logp"]) <= TOL["bfloat16"][0]


def test_logits_are_the_bits_the_partials_reduce():
  t = 19
  h, w, tg, b = _inputs(t, seed=6)
  kw = dict(layout="hv", temperature=1.3, compute_dtype=jnp.bfloat16)
  z, stats = jax.jit(lambda: cpu.logits(h, w, b, return_stats=True, **kw))()
  parts = jax.jit(lambda: cpu.tile_partials(h, w, b, tg, **kw))()
  for i in range(3):
    assert_bitwise_equal(stats[i], parts[i], "stats")
  assert_bitwise_equal(z[jnp.arange(t), tg], parts[3], "target logits")
  from_z = jax.jit(lambda z: cpu.partials_from_logits(z, tg))(z)
  for i in range(4):
    assert_bitwise_equal(from_z[i], parts[i], "partials from logits")
  z64 = (np.asarray(h, np.float64) @ np.asarray(w, np.float64) +
         np.asarray(b, np.float64)) / 1.3
  assert rel_err(z, z64) <= TOL["bfloat16"][0]


def test_small_vocabulary_below_one_chunk():
  t, v = 9, 3 * VOCAB_TILE - 5
  h, w, tg, b = _inputs(t, v=v, seed=7)
  g = jnp.ones((t,), jnp.float32)
  (dh, dw, db), (lp, _) = _grads(h, w, tg, b, g, g, with_bias=True)
  ref = linear_logp_reference(h, w, tg, bias=b, g_logp=g, g_ent=g)
  assert rel_err(lp, ref["logp"]) <= TOL["bfloat16"][0]
  assert rel_err(dw, ref["dw"]) <= TOL["bfloat16"][1]
  assert rel_err(db, ref["db"]) <= TOL["bfloat16"][1]


def test_training_step_temporaries_do_not_grow_like_the_logits():
  """memory_analysis of jit(grad(linear_logp)) at T = 2048, H = 512, bf16.

  What grows with V: the ``[V / VOCAB_TILE, T]`` partials and one buffer of the
  weight gradient's bits (XLA's CPU compiler copies the final bitcast to the
  16-bit output). Nothing of shape ``[T, V]``.
  """
  t, h = 2048, 512
  temps = {}
  for v in (32768, 131072):
    f = jax.jit(jax.grad(lambda h_, w_, t_: linear_logp(h_, w_, t_, implementation="cpu").mean(),
                         argnums=(0, 1)))
    sds = jax.ShapeDtypeStruct
    c = f.lower(sds((t, h), jnp.bfloat16), sds((h, v), jnp.bfloat16),
                sds((t,), jnp.int32)).compile()
    temps[v] = c.memory_analysis().temp_size_in_bytes
    logits_bytes = t * v * 4
    dw_bytes = h * v * 2
    assert temps[v] - dw_bytes < 0.1 * logits_bytes, (v, temps[v])
  dv = 131072 - 32768
  per_column = (temps[131072] - temps[32768]) / dv
  # 3 float32 partials per VOCAB_TILE columns and token, and dW's 2 bytes per weight entry.
  assert per_column < 1.1 * (3 * 4 * t / VOCAB_TILE + 2 * h), per_column


def test_inside_a_user_shard_map_with_check_vma():
  """Forward and gradient inside a user's shard_map(check_vma=True) over the tokens:
  logp and dH rows bitwise the unsharded call's; dW is the sum of the shards' terms."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 CPU devices (--xla_force_host_platform_device_count)")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  spec = jax.sharding.PartitionSpec("d")
  h, w, tg, b = _inputs(40, v=3 * VOCAB_TILE + 5, dtype=jnp.float32)
  fwd = lambda x, t: linear_logp(x, w, t, bias=b, implementation="cpu")  # noqa: E731
  f = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                            check_vma=True))
  assert_bitwise_equal(f(h, tg), fwd(h, tg), "logp in shard_map")

  def dh(x, t):
    return jax.grad(lambda x: jnp.sum(fwd(x, t)))(x)

  g = jax.jit(jax.shard_map(dh, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                            check_vma=True))
  assert_bitwise_equal(g(h, tg), dh(h, tg), "dH in shard_map")

  def dw(x, t):
    return jax.grad(lambda ww: jnp.sum(linear_logp(x, ww, t, implementation="cpu")))(w)

  gw = jax.jit(jax.shard_map(dw, mesh=mesh, in_specs=(spec, spec),
                            out_specs=jax.sharding.PartitionSpec(), check_vma=True))(h, tg)
  dw_j = jax.jit(dw)
  ref = dw_j(h[:20], tg[:20]) + dw_j(h[20:], tg[20:])
  assert rel_err(gw, np.asarray(ref, np.float64)) <= 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_rows_are_batch_invariant_at_any_temperature(temperature):
  """The sampler's logits (and their partials) of a row do not depend on how many row
  blocks the call has: a division by the temperature inside the loops broke this."""
  h, v = 64, 300
  w = (0.3 * jax.random.normal(jax.random.key(1), (h, v))).astype(jnp.bfloat16)
  x = wide_rows(jax.random.key(2), 450, h, jnp.bfloat16)
  kw = dict(layout="hv", temperature=temperature, compute_dtype=jnp.bfloat16)
  small, (m1, s1, u1) = cpu.logits(x[:3], w, None, return_stats=True, **kw)
  big, (m2, s2, u2) = cpu.logits(x, w, None, return_stats=True, **kw)
  assert_bitwise_equal(small, big[:3], f"logits at T={temperature}")
  for a, b, name in ((m1, m2, "m"), (s1, s2, "s"), (u1, u2, "u")):
    assert_bitwise_equal(a, b[:, :3], f"{name} at T={temperature}")
