"""``_backend``: the FMA-contraction probe behind the interpreter's bitwise contract."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl_kernels import _backend

_PROBE = textwrap.dedent("""
    import warnings
    import jax.numpy as jnp
    from jaxrl_kernels import _backend
    from jaxrl_kernels.gemm import det_matmul
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      det_matmul(jnp.ones((2, 8)), jnp.ones((8, 8)))
    print(_backend.cpu_contracts_fma(),
          sum(issubclass(x.category, _backend.FMAContractionWarning) for x in w))
""")


def _run(xla_flags: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.split()


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
def test_fma_contraction_is_detected_and_warned():
  """With FMA allowed (AVX2 on an FMA CPU) the probe sees the contraction and resolving the
  interpreter warns once; with the flag it sees none and nothing warns."""
  assert _run("--xla_cpu_max_isa=AVX2") == ["True", "1"]
  assert _run(_backend.CPU_NO_FMA_FLAG) == ["False", "0"]


def test_probe_constants_separate_fused_from_rounded():
  """The probe's operands: the fused and the separately rounded results differ."""
  a = np.float32(1.0 + 2.0 ** -12)
  c = -np.float32(1.0 + 2.0 ** -11)
  rounded = np.float32(a * a) + c
  fused = np.float32(np.float64(a) * np.float64(a) + np.float64(c))
  assert rounded == 0.0 and fused == np.float32(2.0 ** -24)
