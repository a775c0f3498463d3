"""``python -m jaxrl_kernels`` (or ``jaxrl-kernels``): batch invariance, checked on this device.

Computes the same rows at batch sizes 1 ... 1024 with ``det_matmul`` and with
``jnp.dot``, and the same tokens' log-probs at several batch sizes with
``linear_logp`` and the materialised XLA path, and reports whether each row's
bits ever change. Exit status 0 when jaxrl_kernels is bitwise batch-invariant
here, 1 otherwise (usable as a CI check).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _wide_rows(key, m, k, dtype):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k), jnp.float32)
  scale = 2.0 ** jax.random.randint(k2, (m, 1), -10, 11).astype(jnp.float32)
  return (x * scale).astype(dtype)


def _sweep(fn, x, sizes):
  """Max |delta| and bitwise flag of ``fn(x[:m])`` rows against ``fn(x)`` rows."""
  full = np.asarray(fn(x), np.float32)
  worst, same = 0.0, True
  for m in sizes:
    part = np.asarray(fn(x[:m]), np.float32)
    same &= bool(np.array_equal(part.view(np.uint32), full[:m].view(np.uint32)))
    worst = max(worst, float(np.max(np.abs(part - full[:m]))))
  return same, worst


def gemm_check(impl: str | None, k: int, n: int, m_max: int, dtype) -> list[tuple]:
  from jaxrl_kernels import det_matmul
  from jaxrl_kernels.gemm.api import resolve_implementation
  x = _wide_rows(jax.random.key(0), m_max, k, dtype)
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
  sizes = [1 << i for i in range(m_max.bit_length()) if (1 << i) < m_max] + [m_max // 3 or 1]
  chosen = resolve_implementation(impl, jnp.dtype(dtype), n, k)
  rows = []
  for name, fn in ((f"det_matmul ({chosen})",
                    jax.jit(lambda a: det_matmul(a, w, implementation=chosen))),
                   ("jnp.dot (XLA)", jax.jit(lambda a: jnp.dot(a, w)))):
    t0 = time.perf_counter()
    same, worst = _sweep(fn, x, sizes)
    rows.append((name, same, worst, time.perf_counter() - t0))
  return rows


def logp_check(impl: str | None, h: int, v: int, t_max: int, dtype):
  from jaxrl_kernels import linear_logp, logprob_drift
  x = _wide_rows(jax.random.key(2), t_max, h, dtype)
  x = (x.astype(jnp.float32) * 2.0**-6).astype(dtype)
  w = (jax.random.normal(jax.random.key(3), (h, v), jnp.float32) * 0.1).astype(dtype)
  tg = jax.random.randint(jax.random.key(4), (t_max,), 0, v)
  sizes = (1, 7, t_max // 2)
  out = {}
  for name, impl_name in (("linear_logp", impl), ("XLA log_softmax", "xla")):
    fn = jax.jit(lambda a, t, impl_name=impl_name: linear_logp(a, w, t,
                                                               implementation=impl_name))
    full = np.asarray(fn(x, tg))
    alone = np.concatenate([np.asarray(fn(x[s:s + m], tg[s:s + m]))
                            for s, m in zip((0, 1, 8), sizes)])
    idx = np.concatenate([np.arange(s, s + m) for s, m in zip((0, 1, 8), sizes)])
    out[name] = logprob_drift(alone, full[idx], np.asarray(tg)[idx])
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="jaxrl-kernels", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--implementation", default=None,
                 help="force an implementation (default: chosen by device)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  args = p.parse_args(argv)
  from jaxrl_kernels import _backend
  dev = jax.devices()[0]
  dtype = jnp.dtype(args.dtype)
  on_gpu = _backend.platform() == "gpu"
  k, n, m_max = (4096, 4096, 1024) if on_gpu else (256, 256, 1024)
  h, v, t_max = (1024, 32000, 256) if on_gpu else (64, 1000, 64)
  print("jaxrl_kernels batch-invariance report")
  print(f"  device       {dev.platform}: {getattr(dev, 'device_kind', dev)}")
  print(f"  jax          {jax.__version__}")
  print(f"  dtype        {dtype.name}")
  print(f"\nGEMM rows at batch sizes 1 ... {m_max} (K={k}, N={n}) vs the same rows at M={m_max}:")
  print(f"  {'op':<26} {'bitwise':<8} {'max |delta|':<12} time")
  ok = True
  for i, (name, same, worst, secs) in enumerate(gemm_check(args.implementation, k, n, m_max,
                                                           dtype)):
    print(f"  {name:<26} {'yes' if same else 'NO':<8} {worst:<12.3g} {secs:.1f}s")
    if i == 0:
      ok &= same
  print(f"\nlog-probs of tokens computed in batches of 1, 7, {t_max // 2} vs in one batch "
        f"of {t_max} (H={h}, V={v}):")
  for name, report in logp_check(args.implementation, h, v, t_max, dtype).items():
    print(f"-- {name}")
    print(report.table())
    if name == "linear_logp":
      ok &= report.bitwise_equal
  print("\nresult: jaxrl_kernels is " + ("bitwise batch-invariant on this device"
                                           if ok else "NOT bitwise batch-invariant here"))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
