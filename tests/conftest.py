"""Test configuration: the `gpu` marker skips with a reason where JAX sees no GPU."""

import gc
import os
import tempfile

import jax
import pytest

from jaxrl_kernels import _backend

# Tests are fast on CPU; make sure 8 host devices exist for mesh tests even if the
# caller forgot XLA_FLAGS (it must be set before jax initialises its backends).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# No FMA contraction in XLA's CPU code: the interpreted kernels' bits must not depend on
# how XLA fuses them (jaxrl_kernels/_backend.py explains; test_backend.py checks).
os.environ["XLA_FLAGS"] = _backend.no_fma_xla_flags()
# CI time on 2 cores is mostly XLA compiling interpreted kernels: programs that take over a
# second to compile are kept on disk for the session, so a later test (or a module after
# the caches below are cleared) with the same program loads it instead (same executable,
# same bits).
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxrl-kernels-xla-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops JAX's in-memory caches after each test module: the suite compiles thousands of
  programs, and with all of them kept later tests ran slower (tests/test_main.py: 137 s
  inside the suite, 59 s alone). With this and the disk cache, the suite on the 2-core CPU
  machine went from 18.8 to 14.4 min (the CUDA build test included)."""
  yield
  jax.clear_caches()
  gc.collect()


def _has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason=f"needs a CUDA GPU; JAX's default backend here is "
                                 f"{jax.default_backend()!r}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
