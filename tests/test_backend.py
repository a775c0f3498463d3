"""``_backend``: implementation names, the error for one that cannot run here, and the
FMA-contraction probe behind the interpreter's bitwise contract (never inside a trace)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels import _backend


def _run(script: str, xla_flags: str) -> list[str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.split()


# det_matmul with the default ("cpu") and with "interpret", in a fresh process: the FMA
# warning comes only for "interpret", once, and names the caller's line ("<string>" is
# the file of `python -c`).
_WARN_PROBE = """
    import warnings
    import jax.numpy as jnp
    from jaxrl_kernels import _backend
    from jaxrl_kernels.gemm import det_matmul
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      det_matmul(jnp.ones((2, 8)), jnp.ones((8, 8)))
      det_matmul(jnp.ones((2, 8)), jnp.ones((8, 8)), implementation="interpret")
      det_matmul(jnp.ones((3, 8)), jnp.ones((8, 8)), implementation="interpret")
    fma = [x for x in w if issubclass(x.category, _backend.FMAContractionWarning)]
    print(_backend.cpu_contracts_fma(), len(fma), fma[0].filename if fma else "-")
"""


def test_the_suite_runs_without_fma_contraction():
  """conftest.py added the flag: the interpreter's arithmetic rounds every operation."""
  assert _backend.CPU_NO_FMA_FLAG in os.environ["XLA_FLAGS"]
  assert _backend.cpu_contracts_fma() is False


def test_no_fma_flags_keep_a_users_choice():
  assert _backend.no_fma_xla_flags("") == _backend.CPU_NO_FMA_FLAG
  assert _backend.no_fma_xla_flags("--a=1") == f"--a=1 {_backend.CPU_NO_FMA_FLAG}"
  assert _backend.no_fma_xla_flags("--xla_cpu_max_isa=SSE4_2") == "--xla_cpu_max_isa=SSE4_2"


def _cpu_has_fma() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return " fma " in f.read()
  except OSError:
    return False


@pytest.mark.skipif(not _cpu_has_fma(), reason="the CPU has no FMA instructions to contract to")
def test_fma_contraction_is_detected_and_warned_at_the_callers_line():
  """With FMA allowed (AVX2 on an FMA CPU) the probe sees the contraction and resolving
  the interpreter warns once, at the user's line; the default "cpu" implementation
  never warns; with the flag the probe sees nothing and nothing warns."""
  assert _run(_WARN_PROBE, "--xla_cpu_max_isa=AVX2") == ["True", "1", "<string>"]
  assert _run(_WARN_PROBE, _backend.CPU_NO_FMA_FLAG) == ["False", "0", "-"]


def test_probe_constants_separate_fused_from_rounded():
  """The probe's operands: the fused and the separately rounded results differ."""
  a = np.float32(1.0 + 2.0 ** -12)
  c = -np.float32(1.0 + 2.0 ** -11)
  rounded = np.float32(a * a) + c
  fused = np.float32(np.float64(a) * np.float64(a) + np.float64(c))
  assert rounded == 0.0 and fused == np.float32(2.0 ** -24)


# The first call of the process happens inside a trace: eager shard_map (vocab_parallel_logp
# on a mesh), a user's own shard_map around det_matmul, and jit. The probe must not run
# inside any of them (no device_put within shard_map), and later calls work too.
_TRACE_PROBE = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxrl_kernels as jk
    from jaxrl_kernels._compat import shard_map
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    h = jnp.ones((4, 16)); w = jnp.ones((16, 256)) * 0.01; t = jnp.arange(4)
    for impl in ("interpret", None):
      a = jk.vocab_parallel_logp(h, w, t, mesh=mesh, weight_spec=P(None, "tp"),
                                 implementation=impl)
      f = shard_map(lambda x: jk.det_matmul(x, w, implementation=impl), mesh=mesh,
                    in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
      b = f(h)
      c = jax.jit(lambda x: jk.det_matmul(x, w, implementation=impl))(h)
      print(bool(jnp.all(jnp.isfinite(a))), b.shape == (4, 256), c.shape == (4, 256))
"""


def test_no_probe_inside_a_trace_in_a_fresh_process():
  """With the user's default XLA flags (FMA contraction on where the CPU has it)."""
  out = _run(_TRACE_PROBE, "--xla_force_host_platform_device_count=2")
  assert out == ["True"] * 6


def test_probe_inside_jit_and_shard_map_returns_without_tracing():
  """Called while tracing, the probe runs on its own thread and answers a bool."""
  _backend.cpu_contracts_fma.cache_clear()
  seen = []

  @jax.jit
  def f(x):
    seen.append(_backend.cpu_contracts_fma())
    return x + 1

  f(jnp.ones(3))
  assert seen == [False]


def test_unknown_and_unavailable_implementations():
  with pytest.raises(ValueError, match=r"implementation must be one of .*got 'cublas'"):
    _backend.resolve("op", "cublas", jnp.float32)
  with pytest.raises(ValueError, match="not available for this op"):
    _backend.resolve("op", "cuda", jnp.float32, supported=("triton", "interpret"))
  if _backend.platform() == "cpu":
    with pytest.raises(_backend.ImplementationUnavailableError,
                       match=r"needs a CUDA GPU.*implementation='interpret' on CPU"):
      _backend.resolve("op", "triton", jnp.float32, supported=("triton", "interpret"))
    assert issubclass(_backend.ImplementationUnavailableError, RuntimeError)
    # The CPU default, and the interpreter where an op has no "cpu" implementation.
    assert _backend.resolve("op", None, jnp.bfloat16) == "cpu"
    assert _backend.resolve("op", None, jnp.bfloat16, supported=("interpret", "xla")) == (
        "interpret")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_guard_is_the_identity_with_the_identity_derivative(dtype):
  """_cpu.guard returns x's float32 bits and differentiates as the identity (forward and
  reverse mode); the bitcasts alone would carry no tangent (control)."""
  from jaxrl_kernels._cpu import guard, opaque_zero

  x = jax.random.normal(jax.random.key(0), (5, 7)).astype(dtype)
  c = jax.random.normal(jax.random.key(1), (5, 7))
  y = jax.jit(lambda x: guard(x, opaque_zero(x)))(x)
  assert np.array_equal(np.asarray(y).view(np.uint32),
                        np.asarray(x.astype(jnp.float32)).view(np.uint32))
  g = jax.grad(lambda x: jnp.sum(guard(x, opaque_zero(x)) * c))(x)
  assert g.dtype == x.dtype
  assert np.array_equal(np.asarray(g, np.float32), np.asarray(c.astype(dtype), np.float32))
  _, t = jax.jvp(lambda x: guard(x, opaque_zero(x)), (x,), (jnp.ones_like(x),))
  assert np.array_equal(np.asarray(t), np.ones((5, 7), np.float32))

  def bare(x):  # the guard's body without its derivative rule
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) ^ opaque_zero(x)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)

  assert not np.any(np.asarray(jax.grad(lambda x: jnp.sum(bare(x) * c))(x), np.float32))
