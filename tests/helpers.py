"""Shared test helpers: reordering-revealing inputs, raw-bit comparison, tolerances."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def bits(x) -> np.ndarray:
  """The raw bits of a float array, for bitwise comparisons (atol = rtol = 0)."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bitwise_equal(x, y, what: str = ""):
  bx, by = bits(x), bits(y)
  assert bx.shape == by.shape, f"{what}: shapes {bx.shape} vs {by.shape}"
  if not np.array_equal(bx, by):
    diff = int(np.sum(bx != by))
    raise AssertionError(f"{what}: {diff} of {bx.size} elements differ in their bits")


def wide_rows(key, m: int, k: int, dtype, *, spread: int = 10) -> jax.Array:
  """Normal rows scaled by 2**e, e in [-spread, spread]: reveals any change of
  the reduction order (a reordered sum of such terms rounds differently)."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k), jnp.float32)
  col_scale = 2.0 ** jax.random.randint(k2, (1, k), -spread, spread + 1).astype(jnp.float32)
  row_scale = 2.0 ** (jnp.arange(m, dtype=jnp.float32)[:, None] % (2 * spread + 1) - spread)
  return (x * col_scale * row_scale).astype(dtype)


def attention_inputs(seed, b, t, hq, hkv, d, dtype, *, spread=10):
  """q ``[b, t, hq, d]``, k and v ``[b, t, hkv, d]`` revealing reorderings: v rows
  scaled by 2**e, e in [-spread, spread]."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k1, (b, t, hq, d))
  k = jax.random.normal(k2, (b, t, hkv, d))
  v = jax.random.normal(k3, (b, t, hkv, d))
  v = v * 2.0 ** jax.random.randint(k4, (b, t, hkv, 1), -spread, spread + 1).astype(jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


# CONTRACT.md section 2: relative error bounds (forward, gradients) per input dtype.
TOL = {
    "float32": (1e-5, 1e-4),
    "bfloat16": (1e-2, 2e-2),
    "float16": (2e-3, 1e-2),
}


def run_without_fma(script: str) -> dict:
  """Runs ``script`` in a fresh process with XLA's default CPU flags (FMA contraction
  on and LLVM's default optimisation: the suite's ``--xla_cpu_max_isa`` and
  ``--xla_backend_optimization_level`` removed) and returns the dict it printed on a
  ``RESULT <json>`` line; skips when this machine's XLA does not contract (no FMA)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_cpu_max_isa", "--xla_backend_optimization_level"))]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=900, cwd=root)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  if not out["fma"]:
    pytest.skip("XLA's CPU compiler does not contract a*b+c on this machine (no FMA): "
                "nothing to prove here")
  return out


def fuzz(n: int):
  """Hypothesis settings of the bounded fuzz modules: ``n`` examples, derandomized, no example
  database, no shrinking (a compiled kernel per shrink step would blow the CI budget; a
  failing example is reported as drawn), no deadline."""
  from hypothesis import HealthCheck, Phase, settings  # noqa: PLC0415 - tests only

  return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=list(HealthCheck))


def assert_sharded_gradients_match(loss, model, sharded, tol: float):
  """``nnx.grad(loss)`` of a model sharded by ``models.shard`` against the unsharded
  ``model``: the same parameters, every gradient finite and within ``tol`` (relative) of the
  unsharded one, and bitwise the same on a second run. Returns the unsharded gradients
  (a flat ``{path: Variable}``)."""
  from flax import nnx  # noqa: PLC0415 - the model tests' dependency, not every test's

  grad = nnx.jit(nnx.grad(loss))
  ref = dict(nnx.to_flat_state(grad(model)))
  first = dict(nnx.to_flat_state(grad(sharded)))
  again = dict(nnx.to_flat_state(grad(sharded)))
  assert {p[1:] for p in first if p[0] == "decoder"} == set(ref)
  for path, g in ref.items():
    a = np.asarray(first[("decoder", *path)].get_value())
    assert np.all(np.isfinite(a)), path
    assert rel_err(a, g.get_value()) < tol, path
    assert_bitwise_equal(np.asarray(again[("decoder", *path)].get_value()), a, f"rerun {path}")
  return ref
