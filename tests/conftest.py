"""Test configuration: an 8-device host mesh, the persistent compile cache, no hypothesis
example database, and the ``gpu`` / ``hopper`` markers, which skip with a reason where the
device is missing.

Safe under pytest-xdist (CI runs ``-n 2``): every worker process has its own compile cache
folder, and nothing here writes to a fixed path."""

import atexit
import gc
import os
import shutil
import tempfile

import hypothesis
import jax
import pytest

from jaxrl_kernels import _backend

# Tests are fast on CPU; make sure 8 host devices exist for mesh tests even if the
# caller forgot XLA_FLAGS (it must be set before jax initialises its backends).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# No FMA contraction in XLA's CPU code, for the tests of implementation="interpret": the
# interpreted Pallas kernels' bits must not depend on how XLA fuses them
# (jaxrl_kernels/_backend.py explains; test_backend.py checks). The "cpu" implementation
# needs no flag; its own test runs in a subprocess with the default flags.
os.environ["XLA_FLAGS"] = _backend.no_fma_xla_flags()
# On a CPU-only run (CI), LLVM's optimisation of XLA's CPU code is about a third of the
# suite's time, and the tests' arrays are small: compile at -O0. The floating-point
# semantics are those of every level (no fast-math, FMA contraction off by the flag above),
# and the tests that run under a user's flags (FMA on: helpers.run_without_fma; the
# examples; the CLI) start their own processes at the default level.
if (os.environ.get("JAX_PLATFORMS") == "cpu"
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# CI time on 2 cores is mostly XLA compiling interpreted kernels: programs that take over a
# second to compile are kept on disk for the session, so a later test (or a module after
# the caches below are cleared) with the same program loads it instead (same executable,
# same bits). One folder per process (each xdist worker has its own: JAX's cache takes no
# lock between processes), removed when the process exits.
_CACHE_DIR = tempfile.mkdtemp(prefix="jaxrl-kernels-xla-")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
# No example database: xdist workers would share its folder in the working directory, and a
# run's examples must not depend on the runs before it.
hypothesis.settings.register_profile("jaxrl_kernels", database=None)
hypothesis.settings.load_profile("jaxrl_kernels")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops JAX's in-memory caches after each test module (per xdist worker): the suite
  compiles thousands of programs, and with all of them kept every later compilation and
  dispatch slows down (tests/test_main.py ran twice as long late in a serial run as alone).
  The disk cache above keeps the expensive programs."""
  yield
  jax.clear_caches()
  gc.collect()


def _platform() -> str:
  try:
    return jax.default_backend()
  except RuntimeError:
    return "none"


def slow_in_ci() -> frozenset[str]:
  """The node ids of tests/slow_in_ci.txt (comments and blank lines left out)."""
  path = os.path.join(os.path.dirname(__file__), "slow_in_ci.txt")
  with open(path) as f:
    return frozenset(ln.strip() for ln in f if ln.strip() and not ln.startswith("#"))


_SLOW_IN_CI = slow_in_ci()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """``hopper`` implies ``gpu`` (so ``-m gpu`` selects it); each skips with a reason where
  its device is missing; the tests named in tests/slow_in_ci.txt are marked ``slow``. Runs
  before ``-m`` deselects."""
  on_gpu = _platform() == "gpu"
  on_hopper = on_gpu and _backend.is_hopper()
  no_gpu = pytest.mark.skip(reason=f"needs a CUDA GPU; JAX's default backend here is "
                                   f"{_platform()!r}")
  no_hopper = pytest.mark.skip(reason=f"needs a Hopper GPU (sm_90); this machine has "
                                      f"{_backend.compute_capability() or _platform()}")
  for item in items:
    if item.nodeid in _SLOW_IN_CI:
      item.add_marker(pytest.mark.slow)
    if "hopper" in item.keywords:
      item.add_marker(pytest.mark.gpu)
      if not on_hopper:
        item.add_marker(no_hopper)
    elif "gpu" in item.keywords and not on_gpu:
      item.add_marker(no_gpu)
