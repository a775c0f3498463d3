"""Small pieces shared by the Pallas kernels: arithmetic, dot precision,
compiler parameters and the Hopper facts the Mosaic kernels size themselves by.

Nothing here fixes a reduction order (those constants live in
``jaxrl_kernels/contract.py``).
"""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

# exp(x) == exp2(x * LOG2E): kernels fold LOG2E into the softmax scale.
LOG2E = math.log2(math.e)

# Shared memory per CTA on Hopper (227 KiB); mosaic_loop.SMEM_BUDGET keeps a
# margin for barriers below it.
HOPPER_SMEM_BYTES = 232448


def cdiv(a, b):
  """``ceil(a / b)``: a Python int for Python ints, else ``pl.cdiv`` (traced values)."""
  if isinstance(a, int) and isinstance(b, int):
    return -(-a // b)
  return pl.cdiv(a, b)


def round_up(x: int, q: int) -> int:
  """The smallest multiple of ``q`` that is ``>= x``."""
  return cdiv(x, q) * q


def dot_precision(dtype, interpret: bool):
  """Precision of a Pallas dot with ``dtype`` inputs.

  float32 inputs get float32 accuracy: IEEE on the CPU interpreter, 3xTF32
  (three error-compensated tensor-core passes) under Triton; never plain TF32.
  16-bit inputs use the default (exact products, float32 accumulation).
  """
  if jnp.dtype(dtype) != jnp.float32:
    return None
  if interpret:
    return lax.Precision.HIGHEST
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def triton_compiler_params(num_warps: int, num_stages: int, interpret: bool) -> dict:
  """``pallas_call`` keyword arguments for Triton; none in interpret mode."""
  if interpret:
    return {}
  return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def mosaic_warpgroup_params() -> plgpu.CompilerParams:
  """Mosaic GPU parameters of the kernels written with warpgroup semantics."""
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


# jax 0.11 loads a whole ref with ``plgpu.load(ref)`` (an index argument is deprecated:
# index the ref with ``.at``); jax 0.10 requires the index argument.
_LOAD_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_NEEDS_INDEX = _LOAD_INDEX is not None and _LOAD_INDEX.default is inspect.Parameter.empty


def smem_load(ref, *, layout):
  """``plgpu.load`` of the whole ``ref`` (index it with ``.at`` first) in ``layout``, on
  every supported jax."""
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def group_swizzle(pid, n_rows: int, n_cols: int, group_rows: int):
  """Maps a 1-D program id to (row block, column tile), ``group_rows`` row
  blocks at a time, so concurrently running programs share column tiles in L2.

  Only the launch order changes; every program computes the same tile either way.
  """
  per_group = group_rows * n_cols
  first = (pid // per_group) * group_rows
  size = jnp.minimum(n_rows - first, group_rows)
  local = pid % per_group
  return first + local % size, local // size


def smem_transforms(minor_elems: int, itemsize: int) -> tuple:
  """Tiling and the widest swizzle for a shared-memory tile whose minor
  (contiguous) dimension holds ``minor_elems`` elements of ``itemsize`` bytes."""
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def check_num_ctas(where: str, num_ctas) -> None:
  """Refuses a persistent grid size that is not None or a positive int, by name."""
  if num_ctas is not None and (not isinstance(num_ctas, (int, np.integer))
                               or isinstance(num_ctas, (bool, np.bool_)) or num_ctas < 1):
    raise ValueError(f"{where}: num_ctas must be None or a positive int, got {num_ctas!r}")
