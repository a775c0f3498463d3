"""The GPU kernels' programs are pinned on the CPU (tests/kernel_ir.py).

tests/golden_digests.json pins the bits of the Mosaic and Triton kernels' outputs, but only a
GPU can compute them (the interpreter runs the Triton kernels' Pallas code, not the program
Triton compiles). Their programs can be built anywhere: each case lowers one kernel entry
point for CUDA and its debug-information-free programs must hash to the recorded digest, so
an edit that changes what a GPU kernel executes fails here, in CI, not first on a GPU.
Moving code does not change a digest; changing an instruction does (a deliberate change:
rerun ``tests/kernel_ir.py`` and say why in the commit, then run the GPU golden digests).
"""

from __future__ import annotations

import json

import jax
import kernel_ir
import pytest

RECORDED = json.loads(kernel_ir.PATH.read_text())


def test_every_case_has_a_digest():
  assert set(RECORDED) == set(kernel_ir.names()), (
      "tests/kernel_ir_digests.json and the cases differ: rerun tests/kernel_ir.py")


@pytest.mark.skipif(jax.__version__ != kernel_ir.JAX_VERSION,
                    reason=f"the programs are pinned for jax {kernel_ir.JAX_VERSION} (CI's)")
@pytest.mark.parametrize("name", kernel_ir.names())
def test_gpu_kernel_programs_are_pinned(name):
  assert kernel_ir.digest(name) == RECORDED[name], (
      f"{name}: the GPU kernel's program changed. If deliberate: `PYTHONPATH=. "
      f"JAX_PLATFORMS=cpu python tests/kernel_ir.py`, say why in the commit, and regenerate "
      f"the GPU golden digests if its bits changed")
