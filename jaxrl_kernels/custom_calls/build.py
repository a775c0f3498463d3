"""Builds the SM90 deterministic GEMM custom call (``libjaxrl_det_gemm_sm90.so``) with nvcc.

Command line::

  python -m jaxrl_kernels.custom_calls.build [--out DIR] [--verbose]

prints the path of the built library. Without ``--out`` the library goes to
the cache that the package itself uses on first call:
``$JAXRL_KERNELS_CACHE`` or ``~/.cache/jaxrl_kernels``, under
``<jax version>-sm90a-<hash>/``, where the hash covers the sources, the nvcc
command line, nvcc's version and the CUTLASS headers' version, so a changed
source or toolchain never loads a stale library.

Needs (no GPU is needed to build):

* ``nvcc`` (CUDA 12.3 or newer): ``$NVCC``, ``$CUDA_HOME/bin/nvcc``, ``nvcc``
  on ``PATH`` or ``/usr/local/cuda/bin/nvcc``.
* CUTLASS 3.x headers: ``$CUTLASS_INCLUDE_DIR`` (a folder holding
  ``cutlass/cutlass.h`` and ``cute/tensor.hpp``), else the installed
  ``nvidia-cutlass`` pip package (``pip install nvidia-cutlass==4.2.0.0``, whose
  headers live under ``cutlass_library/source/include``).
* XLA's FFI headers from ``jax.ffi.include_dir()``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import jax

LIB_NAME = "libjaxrl_det_gemm_sm90.so"
HANDLER_SYMBOLS = ("JaxrlDetGemmSm90",)
_SRC_DIR = pathlib.Path(__file__).resolve().parent
# The FFI handler and one translation unit per CUTLASS tile configuration,
# compiled in parallel (the tiles dominate the build time) and linked together.
SOURCES = ("det_gemm_sm90.cu", "det_gemm_sm90_tile_large.cu", "det_gemm_sm90_tile_medium.cu",
           "det_gemm_sm90_tile_small.cu")
# Shipped beside the sources; part of the cache key.
HEADERS = tuple(sorted(p.name for p in (*_SRC_DIR.glob("*.cuh"), *_SRC_DIR.glob("*.h"))))

# sm_90a (not sm_90): wgmma and setmaxnreg exist only on the arch-specific target.
_ARCH_FLAGS = ("-gencode", "arch=compute_90a,code=sm_90a")
COMPILE_FLAGS = (
    *_ARCH_FLAGS, "-std=c++17", "-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "-DNDEBUG", "-Xcompiler=-fPIC,-fvisibility=hidden",
    # jaxlib 0.11 headers leave a new struct member uninitialised; some host
    # toolchains turn that warning into an error.
    "-Xcompiler=-w,-Wno-error=missing-field-initializers,-Wno-missing-field-initializers",
)
LINK_FLAGS = (
    *_ARCH_FLAGS, "-shared",
    # cudart linked statically: the library needs no libcudart.so on the loader path.
    "-cudart=static",
)


_FALLBACK_NVCC = "/usr/local/cuda/bin/nvcc"


def find_nvcc() -> str:
  """The nvcc binary; a RuntimeError naming the places searched if there is none."""
  candidates = [os.environ.get("NVCC")]
  if os.environ.get("CUDA_HOME"):
    candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
  candidates += [shutil.which("nvcc"), _FALLBACK_NVCC]
  for c in candidates:
    if c and os.path.isfile(c) and os.access(c, os.X_OK):
      return c
  raise RuntimeError(
      "jaxrl_kernels cuda GEMM: nvcc (the CUDA compiler, 12.3 or newer) was not found; looked at "
      "$NVCC, $CUDA_HOME/bin/nvcc, PATH and /usr/local/cuda/bin/nvcc. Install the CUDA toolkit "
      "or set NVCC=/path/to/nvcc")


def cutlass_include_dir() -> pathlib.Path:
  """The folder holding ``cutlass/`` and ``cute/`` headers."""
  env = os.environ.get("CUTLASS_INCLUDE_DIR")
  candidates = [pathlib.Path(env)] if env else []
  spec = importlib.util.find_spec("cutlass_library")  # located, not imported
  if spec is not None and spec.submodule_search_locations:
    for loc in spec.submodule_search_locations:
      candidates.append(pathlib.Path(loc) / "source" / "include")
  for c in candidates:
    if (c / "cutlass" / "cutlass.h").is_file() and (c / "cute" / "tensor.hpp").is_file():
      return c
  raise RuntimeError(
      "jaxrl_kernels cuda GEMM: CUTLASS headers were not found (looked at "
      f"$CUTLASS_INCLUDE_DIR={env!r} and the nvidia-cutlass package: "
      f"{[str(c) for c in candidates]}). Run `pip install nvidia-cutlass==4.2.0.0` or set "
      "CUTLASS_INCLUDE_DIR to a folder holding cutlass/cutlass.h")


def _cutlass_util_dir(include: pathlib.Path) -> pathlib.Path | None:
  """``tools/util/include`` (cutlass/util/packed_stride.hpp) beside the include dir, if separate."""
  if (include / "cutlass" / "util" / "packed_stride.hpp").is_file():
    return None
  util = include.parent / "tools" / "util" / "include"
  if (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
    return util
  raise RuntimeError(
      f"jaxrl_kernels cuda GEMM: cutlass/util/packed_stride.hpp is neither under {include} nor "
      f"under {util}; point CUTLASS_INCLUDE_DIR at a full CUTLASS include tree")


def nvcc_commands(out_path: pathlib.Path, obj_dir: pathlib.Path
                  ) -> tuple[list[list[str]], list[str]]:
  """``(compile commands, one per source, link command)`` building ``out_path``."""
  nvcc = find_nvcc()
  include = cutlass_include_dir()
  includes = [f"-I{include}"]
  util = _cutlass_util_dir(include)
  if util is not None:
    includes.append(f"-I{util}")
  includes.append(f"-I{jax.ffi.include_dir()}")
  objs = [obj_dir / (pathlib.Path(src).stem + ".o") for src in SOURCES]
  compiles = [[nvcc, *COMPILE_FLAGS, *includes, "-c", str(_SRC_DIR / src), "-o", str(obj)]
              for src, obj in zip(SOURCES, objs)]
  link = [nvcc, *LINK_FLAGS, *map(str, objs), "-o", str(out_path)]
  return compiles, link


def _jobs() -> int:
  env = os.environ.get("JAXRL_KERNELS_BUILD_JOBS")
  if env:
    return max(1, int(env))
  return max(1, min(len(SOURCES), os.cpu_count() or 1))


def _run_nvcc(cmd: list[str]) -> None:
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"jaxrl_kernels cuda GEMM: nvcc failed (exit {proc.returncode}):\n"
                       f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-20000:]}")


def _nvcc_version(nvcc: str) -> str:
  try:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise RuntimeError(f"jaxrl_kernels cuda GEMM: `{nvcc} --version` failed: {e}") from e


def cache_key() -> str:
  """Hash of everything the library's bits depend on (sources, flags, toolchain, headers)."""
  h = hashlib.sha256()
  for name in (*SOURCES, *HEADERS):
    h.update(name.encode())
    h.update((_SRC_DIR / name).read_bytes())
  h.update(repr((COMPILE_FLAGS, LINK_FLAGS)).encode())
  h.update(_nvcc_version(find_nvcc()).encode())
  include = cutlass_include_dir()
  h.update((include / "cutlass" / "version.h").read_bytes())
  h.update(jax.ffi.include_dir().encode())
  return h.hexdigest()[:16]


def default_cache_dir() -> pathlib.Path:
  root = pathlib.Path(os.environ.get("JAXRL_KERNELS_CACHE",
                                     pathlib.Path.home() / ".cache" / "jaxrl_kernels"))
  return root / f"{jax.__version__}-sm90a-{cache_key()}"


def build(out_dir: str | os.PathLike | None = None, *, verbose: bool = False) -> pathlib.Path:
  """Compiles the library into ``out_dir`` (default: the cache) unless it is already there.

  Returns the library's path. Raises RuntimeError with nvcc's output if the
  compilation fails, or naming what is missing (nvcc, CUTLASS headers).
  """
  out = pathlib.Path(out_dir) if out_dir is not None else default_cache_dir()
  lib = out / LIB_NAME
  if out_dir is None and lib.is_file():
    return lib
  out.mkdir(parents=True, exist_ok=True)
  # Build under a temporary name and rename: concurrent builders never load a
  # half-written library.
  fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out)
  os.close(fd)
  start = time.monotonic()
  try:
    with tempfile.TemporaryDirectory(prefix=".objs-", dir=out) as obj_dir:
      compiles, link = nvcc_commands(pathlib.Path(tmp), pathlib.Path(obj_dir))
      if verbose:
        print("\n".join(" ".join(c) for c in (*compiles, link)), file=sys.stderr)
      # One nvcc per translation unit, in parallel; the first failure is raised.
      with concurrent.futures.ThreadPoolExecutor(_jobs()) as pool:
        for f in [pool.submit(_run_nvcc, c) for c in compiles]:
          f.result()
      _run_nvcc(link)
    os.replace(tmp, lib)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  if verbose:
    print(f"built {lib} in {time.monotonic() - start:.1f} s", file=sys.stderr)
  return lib


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None,
                      help="output folder (default: the package's cache folder)")
  parser.add_argument("--verbose", action="store_true", help="print the nvcc command and time")
  args = parser.parse_args(argv)
  print(build(args.out, verbose=args.verbose))


if __name__ == "__main__":
  main()
