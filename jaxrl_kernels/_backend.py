"""Choosing a kernel implementation for the device JAX runs on.

Every op takes ``implementation=`` with the same names:

* ``"mosaic"``: Pallas Mosaic GPU kernels (Hopper, sm_90: TMA + wgmma).
* ``"triton"``: Pallas kernels with the Triton lowering (any CUDA GPU).
* ``"cuda"``: the XLA FFI CUDA custom call (Hopper), where an op has one.
* ``"cpu"``: XLA CPU code whose reduction order no fusion can change; the
  default when JAX's default backend is the CPU. Bitwise invariant with the
  user's default XLA flags.
* ``"interpret"``: the Pallas (Triton) kernels run by the Pallas interpreter on
  the CPU: the GPU kernels' semantics, for tests. Never chosen automatically.
* ``"xla"``: plain XLA ops. A reference and benchmark baseline only: it is
  **not** batch-invariant and is never chosen automatically.

An implementation that cannot run on this machine raises
:class:`ImplementationUnavailableError` (a ``RuntimeError``) naming what is missing.

Interpreted kernels and FMA contraction. The Pallas interpreter hands the
kernel body to XLA's CPU compiler, which fuses it with the code around it and
lets LLVM contract ``a * b + c`` into one fused multiply-add wherever the CPU
has FMA. Whether a given product is contracted then depends on the fusion, so
on an FMA machine one row's bits can change with the shape of the call (seen:
``lse`` of row 4 of the merge kernel differed between T = 13 and T = 96 rows,
AMD EPYC, AVX2 + FMA). With ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (no FMA
instructions: every operation rounds on its own) the interpreter's bits are a
function of the row alone again. :func:`cpu_contracts_fma` probes for the
contraction; resolving ``"interpret"`` warns once (:class:`FMAContractionWarning`,
pointing at the caller's line) when it is on. The ``"cpu"`` implementation does
not need the flag.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("mosaic", "triton", "interpret", "cuda", "cpu", "xla")
# SMs of an H100 SXM: the persistent grid size when the device does not report
# its core count (tracing on a CPU host).
DEFAULT_NUM_SMS = 132


class ImplementationUnavailableError(RuntimeError):
  """The requested implementation exists but cannot run on this machine."""


def num_sms() -> int:
  """Streaming multiprocessors of the default device: one persistent CTA each."""
  return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_SMS


def cdiv(a: int, b: int) -> int:
  """``ceil(a / b)`` of Python ints."""
  return -(-a // b)


def round_up(x: int, q: int) -> int:
  """The smallest multiple of ``q`` that is ``>= x`` (Python ints)."""
  return cdiv(x, q) * q


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


#: The name prefix of the library's jitted kernel calls (:func:`kernel_jit`).
KERNEL_PREFIX = "jaxrl_kernels__"


def kernel_jit(fn=None, **jit_kwargs):
  """``jax.jit`` of one kernel call of the library, as a decorator.

  A model calls the same kernel at the same shape in each of its layers; as one jitted
  function it is lowered (and compiled by XLA) once per shape instead of once per call
  (docs/models.md, "Compile time"). XLA inlines the call before it optimizes, so the bits
  are those of the inline call. The function is named ``KERNEL_PREFIX + name``:
  ``batch_invariant`` binds such calls as they are (they already hold the contract)
  instead of rewriting the XLA code around the kernels.
  """
  if fn is None:
    return functools.partial(kernel_jit, **jit_kwargs)
  fn.__name__ = fn.__qualname__ = KERNEL_PREFIX + fn.__name__.lstrip("_")
  return jax.jit(fn, **jit_kwargs)


#: Appended to ``XLA_FLAGS`` (before JAX starts its backends) by the test suite:
#: no FMA contraction in XLA's CPU code, see the module docstring.
CPU_NO_FMA_FLAG = "--xla_cpu_max_isa=AVX"


class FMAContractionWarning(RuntimeWarning):
  """Interpreted kernels run where XLA's CPU compiler contracts ``a * b + c``."""


def no_fma_xla_flags(flags: str | None = None) -> str:
  """``XLA_FLAGS`` with :data:`CPU_NO_FMA_FLAG` added unless a ``--xla_cpu_max_isa``
  is already there (then the caller's choice stands)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  if "--xla_cpu_max_isa" in flags:
    return flags
  return f"{flags} {CPU_NO_FMA_FLAG}".strip()


def _probe_fma() -> bool:
  a = np.float32(1.0 + 2.0 ** -12)
  c = -np.float32(1.0 + 2.0 ** -11)  # a*a = 1 + 2^-11 + 2^-24: the 2^-24 rounds away
  cpu = jax.devices("cpu")[0]
  x = jax.device_put(np.full((64,), a, np.float32), cpu)
  y = jax.device_put(np.full((64,), c, np.float32), cpu)
  out = np.asarray(jax.jit(lambda p, q: p * p + q).lower(x, y).compile()(x, y))
  return bool(np.any(out != 0.0))


@functools.cache
def cpu_contracts_fma() -> bool | None:
  """Whether XLA's CPU compiler contracts ``a * b + c`` into a fused multiply-add here.

  Compiles ``a * b + c`` on float32 operands chosen so that the fused and the
  separately rounded results differ, and compares. The probe runs on a thread
  of its own, where no trace of the caller's is active (JAX's trace state is
  per thread), so calling this inside ``jit`` or ``shard_map`` never puts the
  probe into the caller's trace. None (cached too) when the probe could not run.
  """
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    try:
      return pool.submit(_probe_fma).result()
    except Exception:  # noqa: BLE001 - an unknown answer must not break the op
      return None


_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parent)


def user_stacklevel() -> int:
  """The ``stacklevel`` for :func:`warnings.warn` called from inside this package
  that points at the first frame outside it (the user's line)."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  return level


_warned: list[bool] = []


def warn_if_fma_contraction() -> None:
  """Warns once per process that interpreted kernels may contract to FMA here."""
  if _warned or not cpu_contracts_fma():
    return
  _warned.append(True)
  warnings.warn(
      "jaxrl_kernels: XLA's CPU compiler contracts a*b+c into fused multiply-adds on this "
      "machine, depending on how it fuses the interpreted kernels with the code around "
      "them, so implementation='interpret' results are not guaranteed bitwise invariant "
      f"to batch size or chunking. Set XLA_FLAGS='{CPU_NO_FMA_FLAG}' (with your other "
      "flags) before JAX starts, or use implementation='cpu'.", FMAContractionWarning,
      stacklevel=user_stacklevel())


def default_implementation(dtype, *, has_mosaic_dtype=("bfloat16", "float16")) -> str:
  """The implementation picked when the caller passes ``implementation=None``."""
  if platform() == "gpu":
    if is_hopper() and jnp.dtype(dtype).name in has_mosaic_dtype:
      return "mosaic"
    return "triton"
  return "cpu"


def check_available(op: str, implementation: str, dtype=None, *, supported=IMPLEMENTATIONS,
                    mosaic_dtypes=("bfloat16", "float16")) -> None:
  """Raises :class:`ImplementationUnavailableError` when ``implementation`` cannot
  run on this machine (``TypeError`` for a Mosaic call with a dtype it lacks).
  ``supported`` (the op's implementations) picks the one the message suggests."""
  if implementation in ("mosaic", "triton", "cuda") and platform() != "gpu":
    on_cpu = "cpu" if "cpu" in supported else "interpret"
    raise ImplementationUnavailableError(
        f"{op}: implementation={implementation!r} needs a CUDA GPU, but JAX's default "
        f"backend is {platform()!r}; use implementation={on_cpu!r} on CPU")
  if implementation in ("mosaic", "cuda") and not is_hopper():
    raise ImplementationUnavailableError(
        f"{op}: implementation={implementation!r} needs a Hopper GPU (sm_90), but this "
        f"GPU has compute capability {compute_capability()}; use implementation='triton'")
  if implementation == "cpu" and platform() != "cpu":
    raise ImplementationUnavailableError(
        f"{op}: implementation='cpu' runs where JAX's default backend is the CPU, but it "
        f"is {platform()!r}")
  if (implementation == "mosaic" and dtype is not None
      and jnp.dtype(dtype).name not in mosaic_dtypes):
    raise TypeError(
        f"{op}: implementation='mosaic' supports {mosaic_dtypes} inputs, got "
        f"{jnp.dtype(dtype).name}; use implementation='triton' (fp32 runs there as 3xTF32)")


def resolve(op: str, implementation: str | None, dtype, *, supported=IMPLEMENTATIONS,
            mosaic_dtypes=("bfloat16", "float16")) -> str:
  """Validates ``implementation`` for ``op`` on this device; returns the one to run.

  ``None`` picks :func:`default_implementation` (or, where ``op`` lacks it, the
  Triton kernels: compiled on a GPU, interpreted on the CPU). Raises a
  ValueError for an unknown name or one ``op`` does not have, and
  :class:`ImplementationUnavailableError` when a known one cannot run here.
  """
  if implementation is None:
    implementation = default_implementation(dtype, has_mosaic_dtype=mosaic_dtypes)
    if implementation not in supported:
      implementation = "triton" if platform() == "gpu" else "interpret"
  else:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS} or None, got "
                       f"{implementation!r}")
    if implementation not in supported:
      raise ValueError(f"{op}: implementation {implementation!r} is not available for this "
                       f"op; choose one of {supported}")
    check_available(op, implementation, dtype, supported=supported, mosaic_dtypes=mosaic_dtypes)
  if implementation == "interpret":
    warn_if_fma_contraction()
  return implementation


@dataclasses.dataclass(frozen=True)
class RowOpBackend:
  """One implementation of an op with a single Pallas row kernel for every GPU name (the
  fixed-order reductions, RMSNorm): the record its ``BACKENDS`` table maps a name to.

  Attributes:
    name: the implementation that runs (``"mosaic"`` and ``"cuda"`` run ``"triton"``).
    kernel: the Pallas row kernel runs (else the op's fixed-order XLA form, ``"cpu"``).
    interpret: the kernel runs on the Pallas CPU interpreter.
    stock: XLA's own reduction order, the baseline (not batch-invariant).
  """

  name: str
  kernel: bool = False
  interpret: bool = False
  stock: bool = False


def row_op_backends() -> dict[str, RowOpBackend]:
  """The dispatch table of a :class:`RowOpBackend` op: implementation name -> record."""
  triton = RowOpBackend("triton", kernel=True)
  return {"mosaic": triton, "cuda": triton, "triton": triton,
          "interpret": RowOpBackend("interpret", kernel=True, interpret=True),
          "cpu": RowOpBackend("cpu"), "xla": RowOpBackend("xla", stock=True)}
