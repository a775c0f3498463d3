"""The "cpu" causal_attention (jaxrl_kernels/attention/cpu.py): fixed-shape XLA CPU dots.

Accuracy of the forward and the gradients against the float64 reference; bitwise
decode = prefill (with and without kv_lengths), batch, position, padding and chunked
prefill at sequence lengths that straddle this implementation's own key tile and query
block (CPU_ATTENTION_KEY_TILE, CPU_ATTENTION_BLOCK_Q), which the contract suite's short
sequences (tests/test_contract.py, also mode and run to run) do not reach; NaN in masked
keys, values and padding queries inert. In-process tests run under the suite's XLA flags;
tests/test_cpu_fma.py repeats decode = prefill and batch invariance with FMA contraction on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err

from jaxrl_kernels import causal_attention
from jaxrl_kernels.attention import cpu
from jaxrl_kernels.attention.reference import attention_reference as reference
from jaxrl_kernels.contract import CPU_ATTENTION_BLOCK_Q, CPU_ATTENTION_KEY_TILE

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="implementation='cpu' needs JAX's CPU backend")

IMPL = "cpu"
KT = CPU_ATTENTION_KEY_TILE


def inputs(seed, b, t, s, hq, hkv, d, dtype, *, spread=10):
  """q, k, v revealing any reordering: v rows scaled by 2**e, e in [-spread, spread]."""
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(k1, (b, t, hq, d)) * 2.0 ** jax.random.uniform(k4, (b, t, hq, 1),
                                                                        minval=-1, maxval=1)
  k = jax.random.normal(k2, (b, s, hkv, d))
  v = jax.random.normal(k3, (b, s, hkv, d))
  v = v * 2.0 ** jax.random.randint(k5, (b, s, hkv, 1), -spread, spread + 1).astype(jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def attn(q, k, v, pos=None, kvl=None, **kw):
  return causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=IMPL, **kw)


def test_is_the_cpu_default():
  q, k, v = inputs(10, 1, 9, 9, 2, 1, 16, jnp.float32)
  assert_bitwise_equal(causal_attention(q, k, v), attn(q, k, v), "default")


@pytest.mark.parametrize("dtype,d,hq,hkv", [
    (jnp.float32, 16, 4, 2), (jnp.float32, 24, 2, 2), (jnp.bfloat16, 32, 4, 1),
    (jnp.float16, 48, 2, 1),
])
def test_forward_matches_float64_reference(dtype, d, hq, hkv):
  b, t = 3, KT + 20
  q, k, v = inputs(0, b, t, t, hq, hkv, d, dtype, spread=3)
  pos = np.stack([np.arange(t), np.arange(t), np.r_[-np.ones(10), np.arange(t - 10)]]).astype(
      np.int32)  # row 2: 10 padding queries, then a shifted sequence
  kvl = np.array([t, 41, t], np.int32)
  out = attn(q, k, v, pos, kvl)
  assert out.dtype == dtype and out.shape == q.shape
  ref = reference(q, k, v, pos, kvl, 1 / np.sqrt(d))
  assert rel_err(out, ref) <= TOL[jnp.dtype(dtype).name][0]
  assert not np.any(bits(out[2, :10]))  # queries that see no key give +0 exactly


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_equals_prefill_bitwise(dtype):
  """Prefill over T tokens; then each token alone against a longer cache with
  garbage (NaN included) past it, and without kv_lengths (the garbage is then
  only later than the query): the prefill's bits."""
  b, t, s, hq, hkv, d = 3, KT + 9, 2 * KT + 40, 4, 2, 16
  q, k, v = inputs(1, b, t, t, hq, hkv, d, dtype)
  prefill = jax.jit(attn)(q, k, v)
  decode = jax.jit(attn)
  garbage = jnp.full((b, s - t, hkv, d), jnp.nan, dtype)
  junk = jax.random.normal(jax.random.key(9), (b, s, hkv, d)).astype(dtype) * 1e3
  for ps in ([0, 5, CPU_ATTENTION_BLOCK_Q], [KT, KT - 1, t - 1], [t - 1, 1, 100]):
    p = np.array(ps, np.int32)
    keep = jnp.arange(s)[None, :, None, None] <= p[:, None, None, None]
    kc = jnp.where(keep, jnp.concatenate([k, garbage], 1), junk)
    vc = jnp.where(keep, jnp.concatenate([v, garbage], 1), jnp.nan)
    qd = q[np.arange(b), p][:, None]
    want = prefill[np.arange(b), p]
    assert_bitwise_equal(decode(qd, kc, vc, p[:, None], p + 1)[:, 0], want, f"decode at {ps}")
    assert_bitwise_equal(decode(qd, kc, vc, p[:, None], None)[:, 0], want,
                         f"decode at {ps} without kv_lengths")


def test_batch_position_chunking_and_run_to_run_bitwise():
  b, t, hq, hkv, d = 4, KT + 30, 4, 2, 32
  q, k, v = inputs(2, b, t, t, hq, hkv, d, jnp.bfloat16)
  f = jax.jit(attn)
  full = f(q, k, v)
  for i in range(b):  # each sequence alone
    assert_bitwise_equal(f(q[i:i + 1], k[i:i + 1], v[i:i + 1])[0], full[i], f"batch row {i}")
  perm = np.array([2, 0, 3, 1])  # the same sequences at other positions of the batch
  assert_bitwise_equal(f(q[perm], k[perm], v[perm]), full[perm], "positions")
  # chunked prefill: queries [0, 37), [37, 100), [100, t) against the cache so far
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  chunks = [f(q[:, a:z], k, v, pos[:, a:z], jnp.full((b,), z, jnp.int32))
            for a, z in ((0, 37), (37, 100), (100, t))]
  assert_bitwise_equal(jnp.concatenate(chunks, 1), full, "chunked prefill")
  for _ in range(3):
    assert_bitwise_equal(f(q, k, v), full, "run to run")


def test_padding_invariance_bitwise():
  """Extra keys past kv_lengths (inf, NaN) and extra queries (position -1, before
  and after) change nothing in the real rows."""
  b, t, hq, hkv, d = 2, 50, 2, 2, 16
  q, k, v = inputs(3, b, t, t, hq, hkv, d, jnp.bfloat16)
  base = attn(q, k, v)
  extra = KT + 10
  kp = jnp.concatenate([k, jnp.full((b, extra, hkv, d), jnp.inf, k.dtype)], 1)
  vp = jnp.concatenate([v, jnp.full((b, extra, hkv, d), jnp.nan, v.dtype)], 1)
  qp = jnp.concatenate([q[:, :7], q, q[:, :30]], 1)
  pos = np.concatenate([-np.ones((b, 7)), np.broadcast_to(np.arange(t), (b, t)),
                        -np.ones((b, 30))], 1).astype(np.int32)
  out = attn(qp, kp, vp, pos, np.full((b,), t, np.int32))
  assert_bitwise_equal(out[:, 7:7 + t], base, "padded")
  assert not np.any(bits(out[:, :7])) and not np.any(bits(out[:, 7 + t:]))  # +0 exactly


@pytest.mark.parametrize("dtype,hq,hkv,d", [(jnp.float32, 4, 2, 16), (jnp.bfloat16, 2, 1, 24)])
def test_gradients_match_float64_reference(dtype, hq, hkv, d):
  b, t = 2, KT + 10
  q, k, v = inputs(6, b, t, t, hq, hkv, d, dtype, spread=2)
  pos = np.stack([np.arange(t), np.r_[np.arange(t - 5), -np.ones(5)]]).astype(np.int32)
  kvl = np.array([t, 60], np.int32)
  d_out = jax.random.normal(jax.random.key(7), q.shape).astype(dtype)
  grads = jax.jit(lambda q, k, v, g: jax.vjp(
      lambda q, k, v: attn(q, k, v, pos, kvl, scale=0.3), q, k, v)[1](g))(q, k, v, d_out)
  _, ref = reference(q, k, v, pos, kvl, 0.3, d_out)
  tol = TOL[jnp.dtype(dtype).name][1]
  for name, g, r, x in zip("qkv", grads, ref, (q, k, v)):
    assert g.dtype == x.dtype and g.shape == x.shape
    assert rel_err(g, r) <= tol, name
  assert not np.any(np.asarray(grads[0][1, -5:], np.float32))  # padding queries: zero gradient
  assert not np.any(np.asarray(grads[1][1, 60:], np.float32))  # keys past kv_lengths
  assert not np.any(np.asarray(grads[2][1, 60:], np.float32))


def test_dq_rows_batch_invariant_and_dkv_deterministic():
  b, t, hq, hkv, d = 3, 70, 4, 2, 16
  q, k, v = inputs(13, b, t, t, hq, hkv, d, jnp.float32)
  d_out = jax.random.normal(jax.random.key(14), q.shape)
  grad = jax.jit(lambda q, k, v, g: jax.vjp(attn, q, k, v)[1](g))
  dq, dk, dv = grad(q, k, v, d_out)
  for i in range(b):
    one = grad(q[i:i + 1], k[i:i + 1], v[i:i + 1], d_out[i:i + 1])
    assert_bitwise_equal(one[0][0], dq[i], f"dq of sequence {i} alone")
  again = grad(q, k, v, d_out)
  for name, x, y in zip("qkv", (dq, dk, dv), again):
    assert_bitwise_equal(x, y, f"d{name} run to run")


def test_empty_and_any_head_dim():
  q, k, v = inputs(9, 1, 3, 5, 2, 2, 5, jnp.float32)  # D = 5: no multiple-of-16 limit here
  ref = reference(q, k, v, np.broadcast_to(np.arange(2, 5), (1, 3)), np.array([5]),
                  1 / np.sqrt(5))
  assert rel_err(attn(q, k, v), ref) <= 1e-5
  assert attn(q[:, :0], k, v).shape == (1, 0, 2, 5)
  assert not np.any(np.asarray(attn(q, k[:, :0], v[:, :0])))
  assert cpu.supported(5, jnp.float32) is None
  assert "dtype" in cpu.supported(16, jnp.int32)


def test_inside_a_user_shard_map_with_check_vma():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 CPU devices (--xla_force_host_platform_device_count)")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  spec = jax.sharding.PartitionSpec("d")
  q, k, v = inputs(15, 2, 20, 20, 2, 1, 16, jnp.float32)
  f = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                            check_vma=True))
  assert_bitwise_equal(f(q, k, v), jax.jit(attn)(q, k, v), "attention in shard_map")
  loss = lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)  # noqa: E731
  g = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                            in_specs=(spec, spec, spec), out_specs=(spec, spec, spec),
                            check_vma=True))
  for name, a, c in zip("qkv", g(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)):
    assert_bitwise_equal(a, c, f"d{name} in shard_map")


@pytest.mark.parametrize("scale,err", [
    (True, TypeError), (0.0, ValueError), (-1.0, ValueError), (np.array([1.0, 2.0]), TypeError),
    (float("nan"), ValueError), ("0.25", TypeError),
])
def test_bad_scale_is_named(scale, err):
  q = jnp.ones((1, 3, 2, 16))
  with pytest.raises(err, match="scale"):
    attn(q, q, q, scale=scale)


def test_traced_scale_is_rejected_by_name():
  q = jnp.ones((1, 3, 2, 16))
  with pytest.raises(TypeError, match="scale must be a concrete number"):
    jax.jit(lambda s: attn(q, q, q, scale=s))(0.5)


def test_jit_vmap_compose():
  q, k, v = inputs(8, 2, 20, 20, 2, 1, 16, jnp.float32)
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  batched = jax.jit(jax.vmap(attn))(qs, ks, vs)
  for i in range(2):
    assert_bitwise_equal(batched[i], jax.jit(attn)(qs[i], ks[i], vs[i]), f"vmap {i}")
  loss = lambda q, k, v: jnp.sum(jax.vmap(attn)(q, k, v) ** 2)  # noqa: E731
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)
  g0 = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
  for a, c in zip(g, g0):
    assert_bitwise_equal(a[0], c, "vmap grad")
