"""Choosing a kernel implementation for the device JAX runs on.

Every op takes ``implementation=`` with the same names:

* ``"mosaic"``: Pallas Mosaic GPU kernels (Hopper, sm_90: TMA + wgmma).
* ``"triton"``: Pallas kernels with the Triton lowering (any CUDA GPU).
* ``"interpret"``: the same Pallas kernels run by the Pallas interpreter (CPU);
  the CPU default, so that the CPU path is batch-invariant too.
* ``"cuda"``: the XLA FFI CUDA custom call (Hopper), where an op has one.
* ``"xla"``: plain XLA ops. A reference and benchmark baseline only: it is
  **not** batch-invariant and is never chosen automatically.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("mosaic", "triton", "interpret", "cuda", "xla")


@functools.cache
def platform() -> str:
  """The default backend's platform: ``"gpu"``, ``"cpu"`` or ``"tpu"``."""
  return jax.default_backend()


@functools.cache
def compute_capability() -> tuple[int, int] | None:
  """``(major, minor)`` of the first GPU, or None when JAX sees no CUDA GPU."""
  if platform() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


def is_hopper() -> bool:
  return compute_capability() == (9, 0)


def default_implementation(dtype, *, has_mosaic_dtype=("bfloat16", "float16")) -> str:
  """The implementation picked when the caller passes ``implementation=None``."""
  if platform() == "gpu":
    if is_hopper() and jnp.dtype(dtype).name in has_mosaic_dtype:
      return "mosaic"
    return "triton"
  return "interpret"


def resolve(op: str, implementation: str | None, dtype, *, supported=IMPLEMENTATIONS,
            mosaic_dtypes=("bfloat16", "float16")) -> str:
  """Validates ``implementation`` for ``op`` on this device; returns the one to run.

  Raises a ValueError for an unknown name and a RuntimeError naming what is
  missing when a known implementation cannot run here.
  """
  if implementation is None:
    implementation = default_implementation(dtype, has_mosaic_dtype=mosaic_dtypes)
    if implementation not in supported:
      implementation = "triton" if platform() == "gpu" else "interpret"
    return implementation
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  if implementation not in supported:
    raise ValueError(
        f"{op}: implementation {implementation!r} is not available for this op; "
        f"choose one of {supported}")
  if implementation in ("mosaic", "triton", "cuda") and platform() != "gpu":
    raise RuntimeError(
        f"{op}: implementation={implementation!r} needs a CUDA GPU, but JAX's default "
        f"backend is {platform()!r}; use implementation='interpret' on CPU")
  if implementation in ("mosaic", "cuda") and not is_hopper():
    raise RuntimeError(
        f"{op}: implementation={implementation!r} needs a Hopper GPU (sm_90), but this "
        f"GPU has compute capability {compute_capability()}; use implementation='triton'")
  if implementation == "mosaic" and jnp.dtype(dtype).name not in mosaic_dtypes:
    raise TypeError(
        f"{op}: implementation='mosaic' supports {mosaic_dtypes} inputs, got "
        f"{jnp.dtype(dtype).name}; use implementation='triton' (fp32 runs there as 3xTF32)")
  return implementation
