"""Golden digests: the bits of every op x implementation on fixed inputs are pinned.

The invariance tests prove that a row's bits do not depend on the batch; these prove that
they do not change at all, unless on purpose: a changed contract constant (a K tile, the CPU
row block, the reduce lanes) keeps every invariance but gives other bits, so a sampler and a
trainer of two versions of the library would disagree. A deliberate change regenerates the
file (``python tests/golden_update.py``) and says why in its commit.

CPU implementations are checked on the CPU, GPU implementations on a GPU: a GPU case whose
digest is missing fails there (it is never skipped), so the file must hold them.
"""

from __future__ import annotations

import json
import pathlib

import golden_cases
import jax
import pytest

DIGESTS = json.loads((pathlib.Path(__file__).parent / "golden_digests.json").read_text())
_ON_GPU = jax.default_backend() == "gpu"


def _check(op: str, impl: str, dtype: str) -> None:
  name = golden_cases.key_name(op, impl, dtype)
  assert name in DIGESTS, (f"{name}: no golden digest recorded; run `python "
                           f"tests/golden_update.py` on a machine that runs {impl!r}")
  got = golden_cases.compute(op, impl, dtype)
  changed = {k: (DIGESTS[name].get(k), v) for k, v in got.items() if DIGESTS[name].get(k) != v}
  assert not changed and set(got) == set(DIGESTS[name]), (
      f"{name}: bits changed in {sorted(changed)} ({changed}): if deliberate, regenerate with "
      f"`python tests/golden_update.py` and say why in the commit")


@pytest.mark.skipif(_ON_GPU, reason="the CPU digests are the CPU backend's bits")
@pytest.mark.parametrize("op,impl,dtype", golden_cases.keys(golden_cases.CPU_IMPLEMENTATIONS))
def test_cpu_bits_are_the_golden_ones(op, impl, dtype):
  _check(op, impl, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("op,impl,dtype", golden_cases.keys(golden_cases.GPU_IMPLEMENTATIONS))
def test_gpu_bits_are_the_golden_ones(op, impl, dtype):
  if impl == "mosaic":
    from jaxrl_kernels import _backend  # noqa: PLC0415
    assert _backend.is_hopper(), "the Mosaic digests are Hopper's (sm_90)"
  _check(op, impl, dtype)


def test_every_case_has_a_digest():
  """The file covers every case (a case added without its digests fails here, on the CPU
  too, instead of only on the machine that would run it)."""
  expected = {golden_cases.key_name(*k) for k in golden_cases.keys(
      golden_cases.CPU_IMPLEMENTATIONS + golden_cases.GPU_IMPLEMENTATIONS)}
  assert sorted(expected - set(DIGESTS)) == []
