"""The "cpu" implementation is bitwise invariant with XLA's default CPU flags.

The suite runs with ``--xla_cpu_max_isa=AVX`` (tests/conftest.py), which turns
off FMA contraction. Here a subprocess starts JAX without that flag, so XLA's
CPU compiler contracts ``a * b + c`` into fused multiply-adds wherever it
fuses them, and checks batch, position, padding, chunk and mode invariance of
``det_matmul`` and ``linear_logp`` (logp, entropy, dH) with
``implementation="cpu"``, plus the control: the plain XLA path changes bits
with the batch there.
"""

from __future__ import annotations

import textwrap

from helpers import run_without_fma

_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl_kernels import _backend, det_matmul, linear_logp

    out = {"fma": bool(_backend.cpu_contracts_fma())}

    def same(a, b):
      a, b = np.asarray(a), np.asarray(b)
      a, b = a.reshape(-1), b.reshape(-1)
      return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))

    def wide(key, m, k, dtype):
      x = jax.random.normal(key, (m, k), jnp.float32)
      scale = 2.0 ** (jnp.arange(m, dtype=jnp.float32)[:, None] % 9 - 4)
      return (x * scale).astype(dtype)

    T, K, N, V = 200, 96, 160, 1500
    x = wide(jax.random.key(0), T, K, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
    mm = jax.jit(lambda a: det_matmul(a, w, implementation="cpu"))
    full = mm(x)
    checks = {}
    checks["gemm batch"] = all(same(mm(x[:m]), full[:m]) for m in (1, 7, 129))
    checks["gemm position"] = same(mm(x[:160].at[137].set(x[3]))[137], full[3])
    checks["gemm padding"] = same(mm(jnp.concatenate([x[50:60], x[:40]]))[10:], full[:40])
    checks["gemm chunks"] = same(jnp.concatenate([mm(x[:100]), mm(x[100:])]), full)
    da = jax.jit(jax.grad(lambda a: jnp.sum(det_matmul(a, w, implementation="cpu")
                                            .astype(jnp.float32) ** 2)))
    train_fwd = jax.jit(lambda a: jax.vjp(
        lambda a: det_matmul(a, w, implementation="cpu"), a)[0])
    checks["gemm mode"] = same(train_fwd(x[:9]), full[:9])
    checks["gemm dA batch"] = same(da(x[:5]), da(x)[:5])

    h = wide(jax.random.key(2), T, 64, jnp.bfloat16)
    wv = (jax.random.normal(jax.random.key(3), (64, V), jnp.float32) * 0.3).astype(jnp.bfloat16)
    tg = jax.random.randint(jax.random.key(4), (T,), 0, V)
    fwd = jax.jit(lambda h, t: linear_logp(h, wv, t, return_entropy=True,
                                           implementation="cpu"))
    lp_only = jax.jit(lambda h, t: linear_logp(h, wv, t, implementation="cpu"))

    def loss(h, t):
      lp, ent = linear_logp(h, wv, t, return_entropy=True, implementation="cpu")
      return jnp.sum(lp) + 0.5 * jnp.sum(ent), (lp, ent)
    grad = jax.jit(jax.grad(loss, has_aux=True))
    lp, ent = fwd(h, tg)
    dh, (lp_g, ent_g) = grad(h, tg)
    checks["logp batch"] = all(same(fwd(h[:m], tg[:m])[0], lp[:m]) for m in (1, 7, 129))
    checks["entropy batch"] = all(same(fwd(h[:m], tg[:m])[1], ent[:m]) for m in (1, 7, 129))
    checks["logp position"] = same(
        fwd(h[:160].at[137].set(h[3]), tg[:160].at[137].set(tg[3]))[0][137], lp[3])
    checks["logp padding"] = same(
        fwd(jnp.concatenate([h[50:60], h[:40]]), jnp.concatenate([tg[50:60], tg[:40]]))[0][10:],
        lp[:40])
    checks["logp chunks"] = same(jnp.concatenate([fwd(h[:100], tg[:100])[0],
                                                  fwd(h[100:], tg[100:])[0]]), lp)
    checks["logp mode (no entropy)"] = same(lp_only(h[:9], tg[:9]), lp[:9])
    checks["logp mode (training)"] = same(lp_g, lp) and same(ent_g, ent)
    checks["dh batch"] = all(same(grad(h[:m], tg[:m])[0], dh[:m]) for m in (1, 7, 129))
    checks["dh chunks"] = same(jnp.concatenate([grad(h[:100], tg[:100])[0],
                                                grad(h[100:], tg[100:])[0]]), dh)
    out["checks"] = checks

    # Controls: the plain XLA paths change bits with the batch here.
    xf = wide(jax.random.key(5), T, 256, jnp.float32)
    wf = jax.random.normal(jax.random.key(6), (256, 384), jnp.float32)
    dot = jax.jit(lambda a: jnp.dot(a, wf))
    dfull = dot(xf)
    tf = jax.random.randint(jax.random.key(7), (T,), 0, 384)
    xla = jax.jit(lambda h, t: linear_logp(h, wf, t, implementation="xla"))
    xfull = xla(xf, tf)
    out["control"] = {
        "jnp.dot": any(not same(dot(xf[:m]), dfull[:m]) for m in (1, 3, 7, 50, 129)),
        "linear_logp xla": any(not same(xla(xf[:m], tf[:m]), xfull[:m])
                               for m in (1, 3, 7, 50, 129)),
    }
    print("RESULT " + json.dumps(out))
""")


_ATTENTION_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl_kernels import _backend, causal_attention
    from jaxrl_kernels.contract import CPU_ATTENTION_KEY_TILE as KT

    out = {"fma": bool(_backend.cpu_contracts_fma())}

    def same(a, b):
      a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
      return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))

    b, t, s, hq, hkv, d = 3, KT + 20, 2 * KT + 8, 4, 2, 32
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k1, (b, t, hq, d), jnp.float32)
    k = jax.random.normal(k2, (b, t, hkv, d), jnp.float32)
    v = jax.random.normal(k3, (b, t, hkv, d), jnp.float32)
    v = v * 2.0 ** jax.random.randint(k4, (b, t, hkv, 1), -10, 11).astype(jnp.float32)

    def run(impl, fill):
      f = jax.jit(lambda q, k, v, pos, kvl: causal_attention(
          q, k, v, q_positions=pos, kv_lengths=kvl, implementation=impl))
      full = jax.jit(lambda q, k, v: causal_attention(q, k, v, implementation=impl))(q, k, v)
      kc = jnp.concatenate([k, jnp.full((b, s - t, hkv, d), fill)], 1)
      vc = jnp.concatenate([v, jnp.full((b, s - t, hkv, d), fill)], 1)
      dec = []
      for ps in ([0, 37, KT], [t - 1, KT - 1, 5]):
        p = np.array(ps, np.int32)
        got = f(q[np.arange(b), p][:, None], kc, vc, p[:, None], p + 1)[:, 0]
        dec.append(same(got, full[np.arange(b), p]))
      one = jax.jit(lambda q, k, v: causal_attention(q, k, v, implementation=impl))
      batch = all(same(one(q[i:i + 1], k[i:i + 1], v[i:i + 1])[0], full[i]) for i in range(b))
      return all(dec), batch

    dec, batch = run("cpu", jnp.nan)
    grad = jax.jit(lambda q, k, v: jax.grad(lambda q: jnp.sum(
        causal_attention(q, k, v, implementation="cpu") ** 2))(q))
    dq = grad(q, k, v)
    out["checks"] = {
        "attention decode = prefill": dec,
        "attention batch": batch,
        "attention dq batch": all(same(grad(q[i:i + 1], k[i:i + 1], v[i:i + 1])[0], dq[i])
                                  for i in range(b)),
    }
    xla_dec, _ = run("xla", 0.0)  # finite cache padding: a difference is a reordering
    out["control"] = {"attention xla decode = prefill": xla_dec}
    print("RESULT " + json.dumps(out))
""")


def test_cpu_implementation_is_invariant_with_fma_contraction_on():
  out = run_without_fma(_SCRIPT)
  failed = [name for name, ok in out["checks"].items() if not ok]
  assert not failed, f"bits changed with FMA contraction on: {failed}"
  assert out["control"]["jnp.dot"], "control: jnp.dot kept its bits at every batch size"
  assert out["control"]["linear_logp xla"], "control: the materialized path kept its bits"


def test_cpu_attention_is_invariant_with_fma_contraction_on():
  """causal_attention "cpu": decode = prefill (NaN past the cache's end), batch
  invariance of the output and of dq, with FMA contraction on; control: the
  materialised "xla" attention changes a decoded token's bits there."""
  out = run_without_fma(_ATTENTION_SCRIPT)
  failed = [name for name, ok in out["checks"].items() if not ok]
  assert not failed, f"bits changed with FMA contraction on: {failed}"
  assert not out["control"]["attention xla decode = prefill"], (
      "control: the materialised attention kept its bits between decode and prefill")
