"""``implementation="cuda"`` of ``det_matmul``: the SM90 CUTLASS GEMM behind XLA's FFI.

The kernel (``det_gemm_sm90.cu``) computes, for bf16 or fp16 inputs,

  ``out[m, n] = sum_k op(lhs)[m, k] * op(rhs)[k, n]``

with float32 accumulation over a fixed 64-wide K tile walked in ascending
order (no split-K, no stream-K), so row ``m`` of ``out`` is bitwise
independent of M (CONTRACT.md §1). The CUTLASS tile configuration (``TILES``)
and the persistent scheduler's walk are free knobs (:class:`Config`,
passed to the kernel as FFI attributes; the tile picked per shape by
:func:`tile_for` unless the config names one): every configuration runs the
same wgmma chain per output element and gives the same bits (tested).
Transposed operands are read in place through the TMA descriptors.

The shared library is compiled with nvcc on first use (``build.py``) and
cached; the FFI target is registered with XLA once per process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import _backend
from jaxrl_kernels._backend import cdiv, num_sms, round_up
from jaxrl_kernels.contract import GEMM_TILE_K
from jaxrl_kernels.custom_calls import build

TARGET_NAME = "jaxrl_det_gemm_sm90"
INPUT_DTYPES = ("bfloat16", "float16")
# TMA: the contiguous dimension of every operand spans a multiple of 16 bytes.
_ALIGN_BYTES = 16
# The contract's K tile; det_gemm_sm90_kernels.cuh's kTileK must equal it
# (tests/test_contract.py reads the source).
TILE_K = GEMM_TILE_K
# The CUTLASS tile configurations (det_gemm_sm90.h: TileId; the index is the FFI
# attribute): name -> (CTA rows, CTA columns).
TILES = {"large": (128, 256), "medium": (128, 128), "small": (64, 128)}
# The scheduler's raster orders (det_gemm_sm90.h: RasterId; the index is the FFI
# attribute): CUTLASS's heuristic, along M, along N.
RASTERS = ("heuristic", "m", "n")
SWIZZLES = (0, 1, 2, 4, 8)
# Time of a medium (128x128) tile in units of half a large (128x256) tile: the
# smaller tile reads more operand bytes per flop. Fit on Hopper to the benchmark shapes:
# 1.12 makes the same choices on every one of them (benchmarks/results/gemm_h100.md).
MEDIUM_TILE_COST = 1.12


@dataclasses.dataclass(frozen=True)
class Config:
  """Free knobs of the CUDA GEMM (none touches a row's K order; all give the same bits).

  Attributes:
    tile: a key of ``TILES``, or None for :func:`tile_for`'s choice by shape.
    swizzle: tile rows (or columns) the persistent scheduler walks together,
      one of 1, 2, 4, 8; 0 for the default by M (det_gemm_sm90_kernels.cuh:
      SchedulerKnobs).
    raster: the walk's direction, one of ``RASTERS`` (``"heuristic"``: CUTLASS's).
  """

  tile: str | None = None
  swizzle: int = 0
  raster: str = "heuristic"

  def __post_init__(self):
    if self.tile is not None and self.tile not in TILES:
      raise ValueError(f"gemm_ffi.Config: tile must be one of {tuple(TILES)} or None, got "
                       f"{self.tile!r}")
    if self.swizzle not in SWIZZLES or isinstance(self.swizzle, bool):
      raise ValueError(f"gemm_ffi.Config: swizzle must be one of {SWIZZLES}, got "
                       f"{self.swizzle!r}")
    if self.raster not in RASTERS:
      raise ValueError(f"gemm_ffi.Config: raster must be one of {RASTERS}, got {self.raster!r}")


_LIBRARY: list[ctypes.CDLL] = []  # keeps the loaded library referenced


@functools.cache
def register() -> str:
  """Builds (or finds in the cache) the library and registers the FFI target; once per process."""
  lib = ctypes.CDLL(str(build.build()))
  _LIBRARY.append(lib)
  for sym in build.HANDLER_SYMBOLS:
    if not hasattr(lib, sym):
      raise RuntimeError(f"jaxrl_kernels cuda GEMM: {lib._name} does not export {sym}")
  jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(lib.JaxrlDetGemmSm90),
                              platform="CUDA")
  return TARGET_NAME


def _check(lhs, rhs, lhs_transposed: bool, rhs_transposed: bool, out_dtype) -> None:
  for name, flag in (("lhs_transposed", lhs_transposed), ("rhs_transposed", rhs_transposed)):
    if not isinstance(flag, bool):
      raise TypeError(f"matmul_cuda: {name} must be a bool, got {flag!r}")
  if lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"matmul_cuda: lhs and rhs must be 2-D, got shapes {lhs.shape} and "
                     f"{rhs.shape}")
  in_name = jnp.dtype(lhs.dtype).name
  if in_name not in INPUT_DTYPES:
    raise TypeError(f"matmul_cuda: inputs must be one of {INPUT_DTYPES}, got {in_name}; use "
                    f"implementation='triton' for float32")
  if rhs.dtype != lhs.dtype:
    raise TypeError(f"matmul_cuda: lhs and rhs must have the same dtype, got {lhs.dtype} and "
                    f"{rhs.dtype}")
  out_name = jnp.dtype(out_dtype).name
  allowed = (in_name, "float32") if not lhs_transposed else (in_name,)
  if out_name not in allowed:
    raise TypeError(f"matmul_cuda: out_dtype must be one of {allowed} for {in_name} inputs"
                    f"{' with lhs_transposed=True' if lhs_transposed else ''}, got {out_name}")
  if lhs_transposed and rhs_transposed:
    raise ValueError("matmul_cuda: lhs_transposed=True with rhs_transposed=True is not "
                     "compiled in (det_matmul never asks for it)")
  k_lhs = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  k_rhs = rhs.shape[1] if rhs_transposed else rhs.shape[0]
  if k_lhs != k_rhs:
    raise ValueError(f"matmul_cuda: lhs {'[K, M]' if lhs_transposed else '[M, K]'} has "
                     f"K={k_lhs} (shape {lhs.shape}) but rhs "
                     f"{'[N, K]' if rhs_transposed else '[K, N]'} has K={k_rhs} "
                     f"(shape {rhs.shape})")


def tile_for(m: int, n: int, sm_count: int) -> str:
  """The tile configuration for an ``M x N`` output on ``sm_count`` SMs (a free knob).

  * ``"small"`` (64x128, ping-pong) when the large tiles would occupy fewer
    than half of the SMs (small M: most SMs would idle; see
    benchmarks/results/gemm_h100.md);
  * else ``"medium"`` (128x128, ping-pong) when its waves of CTAs finish sooner than the
    large tile's: ``ceil(tiles_medium / SMs) * MEDIUM_TILE_COST <
    ceil(tiles_large / SMs) * 2`` (a poorly filled last wave of large tiles,
    e.g. M=1024, N=14336: 448 large tiles are 3.4 waves on 132 SMs);
  * else ``"large"`` (128x256).
  """
  large = cdiv(m, 128) * cdiv(n, 256)
  if 2 * large < sm_count:
    return "small"
  medium = cdiv(m, 128) * cdiv(n, 128)
  if cdiv(medium, sm_count) * MEDIUM_TILE_COST < cdiv(large, sm_count) * 2:
    return "medium"
  return "large"


def aligned_shape(m: int, n: int, k: int, *, lhs_transposed: bool, rhs_transposed: bool,
                  in_dtype, out_dtype) -> tuple[int, int, int]:
  """``(M', N', K')`` the kernel runs: each dimension that is contiguous in some
  operand (or in the output) rounded up to 16 bytes; the others unchanged.

  The rows of a forward call (M with ``lhs_transposed=False``) are never
  contiguous, so M' = M there: padding never depends on the batch.
  """
  align = _ALIGN_BYTES // jnp.dtype(in_dtype).itemsize
  out_align = _ALIGN_BYTES // jnp.dtype(out_dtype).itemsize
  # K is contiguous in [M, K] lhs and [N, K] rhs; M in [K, M] lhs; N in [K, N]
  # rhs and always in the [M, N] output.
  kp = round_up(k, align) if (not lhs_transposed or rhs_transposed) else k
  mp = round_up(m, align) if lhs_transposed else m
  np_ = round_up(n, out_align if rhs_transposed else max(align, out_align))
  return mp, np_, kp


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def matmul_cuda(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
                out_dtype, config: Config | None = None) -> jax.Array:
  """Deterministic ``op(lhs) @ op(rhs)`` on Hopper through the CUDA custom call.

  Args:
    lhs: ``[M, K]``, or ``[K, M]`` with ``lhs_transposed`` (read in place).
    rhs: ``[K, N]``, or ``[N, K]`` with ``rhs_transposed`` (read in place).
    lhs_transposed, rhs_transposed: the layouts above; ``(False, False)`` and
      ``(False, True)`` for forward and ``dA = dC B^T``, ``(True, False)`` for
      ``dB = A^T dC``.
    out_dtype: the input dtype or float32 (only the input dtype with
      ``lhs_transposed``).
    config: the free knobs (default ``Config()``: tile by shape,
      default walk); every config gives the same bits.

  Returns:
    ``[M, N]`` in ``out_dtype``: float32 accumulation over K tiles of
    ``TILE_K`` in ascending order, rounded once to ``out_dtype``.

  Shapes need not be tile multiples (TMA zero-fills and clips). TMA needs each
  operand's contiguous dimension to span a multiple of 16 bytes; where it does
  not (odd K or N, say), that dimension is zero-padded here, which does not
  change any bit: a zero-padded K tail lies inside the last K tile, which TMA
  zero-fills anyway. That choice depends on N and K (and, for ``dB``, on the
  weight's own M), never on the number of rows of a forward call.
  """
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  _check(lhs, rhs, lhs_transposed, rhs_transposed, out_dtype)
  out_dtype = jnp.dtype(out_dtype)
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  _backend.check_available("matmul_cuda", "cuda")
  cfg = config if config is not None else Config()
  if not isinstance(cfg, Config):
    raise TypeError(f"matmul_cuda: config must be a Config or None, got {config!r}")
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  target = register()

  mp, np_, kp = aligned_shape(m, n, k, lhs_transposed=lhs_transposed,
                              rhs_transposed=rhs_transposed, in_dtype=lhs.dtype,
                              out_dtype=out_dtype)
  lhs_p = _pad_axis(_pad_axis(lhs, 0 if lhs_transposed else 1, kp), 1 if lhs_transposed else 0, mp)
  rhs_p = _pad_axis(_pad_axis(rhs, 1 if rhs_transposed else 0, kp), 0 if rhs_transposed else 1,
                    np_)
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((mp, np_), out_dtype),
                          vmap_method="sequential")
  tile = list(TILES).index(cfg.tile or tile_for(mp, np_, num_sms()))
  out = call(lhs_p, rhs_p, lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed,
             tile=np.int32(tile), swizzle=np.int32(cfg.swizzle),
             raster=np.int32(RASTERS.index(cfg.raster)))
  if (mp, np_) != (m, n):
    out = out[:m, :n]
  return out
