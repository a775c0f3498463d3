"""Saving and loading an nnx module's parameters: safetensors files and orbax folders.

Names are the module's state paths joined with dots, e.g. ``blocks.0.qkv.kernel``.
Loading checks names, shapes and dtypes and lists every mismatch in one error.

* ``*.safetensors``: the safetensors format (an 8-byte little-endian header
  size, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw
  little-endian bytes), read and written here with numpy, so no extra package
  is needed. bf16 is ``BF16``.
* any other path: an orbax checkpoint folder holding the same flat
  ``{name: array}`` dict. ``orbax-checkpoint`` is imported only then (``pip install
  'jaxrl_kernels[orbax]'``); without it such a path raises an ImportError saying so.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


ORBAX_HINT = ("pip install 'jaxrl_kernels[orbax]' (or use a *.safetensors path, which needs "
              "no extra package)")


def _orbax(op: str, path: str):
  """``orbax.checkpoint``, imported on first use: only orbax folders need it."""
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError(f"{op}: {path} is an orbax checkpoint folder (not *.safetensors), which "
                      f"needs the orbax-checkpoint package: {ORBAX_HINT}") from e
  return ocp


def _flat_params(model: nnx.Module) -> dict[str, jax.Array]:
  state = nnx.state(model, nnx.Param)
  flat = {}
  for path, leaf in nnx.to_flat_state(state):
    value = leaf.get_value() if hasattr(leaf, "get_value") else getattr(leaf, "value", leaf)
    flat[".".join(str(p) for p in path)] = value
  return flat


def save_safetensors(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> None:
  """Writes ``{name: array}`` as a safetensors file."""
  header, offset, blobs = {}, 0, []
  for name in sorted(arrays):
    a = np.ascontiguousarray(np.asarray(arrays[name]))
    if a.dtype not in _NAMES:
      raise TypeError(f"save_safetensors: {name} has unsupported dtype {a.dtype}")
    blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for blob in blobs:
      f.write(blob)


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads a safetensors file into ``{name: numpy array}``."""
  with open(path, "rb") as f:
    data = f.read()
  if len(data) < 8:
    raise ValueError(f"load_safetensors: {path} is too short to be a safetensors file")
  (n,) = struct.unpack("<Q", data[:8])
  if 8 + n > len(data):
    raise ValueError(f"load_safetensors: {path} declares a {n}-byte header but has "
                     f"{len(data) - 8} bytes after the size")
  header = json.loads(data[8:8 + n])
  header.pop("__metadata__", None)
  out = {}
  base = 8 + n
  for name, info in header.items():
    if info["dtype"] not in _DTYPES:
      raise TypeError(f"load_safetensors: {name} has unsupported dtype {info['dtype']}")
    dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
    lo, hi = info["data_offsets"]
    out[name] = np.frombuffer(data[base + lo:base + hi], dt).reshape(info["shape"])
  return out


def save_params(model: nnx.Module, path: str | os.PathLike) -> None:
  """Saves the module's ``nnx.Param`` leaves (safetensors for ``*.safetensors``,
  else an orbax folder)."""
  flat = {k: np.asarray(v) for k, v in _flat_params(model).items()}
  path = os.fspath(path)
  if path.endswith(".safetensors"):
    save_safetensors(flat, path)
    return
  _orbax("save_params", path).PyTreeCheckpointer().save(os.path.abspath(path), flat)


def load_params(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
  """Loads parameters saved by :func:`save_params` (or any checkpoint with the
  same names) into ``model`` in place, and returns it.

  Raises a ValueError listing missing, unexpected and mismatched (shape or
  dtype) names; nothing is changed then.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"load_params: no checkpoint at {path}")
  if path.endswith(".safetensors"):
    loaded = load_safetensors(path)
  else:
    loaded = _orbax("load_params", path).PyTreeCheckpointer().restore(os.path.abspath(path))
  want = _flat_params(model)
  problems = []
  missing = sorted(set(want) - set(loaded))
  extra = sorted(set(loaded) - set(want))
  if missing:
    problems.append(f"missing: {missing}")
  if extra:
    problems.append(f"unexpected: {extra}")
  for name in sorted(set(want) & set(loaded)):
    w, got = want[name], np.asarray(loaded[name])
    if tuple(got.shape) != tuple(w.shape) or got.dtype != w.dtype:
      problems.append(f"{name}: checkpoint {got.dtype}{list(got.shape)} vs model "
                      f"{w.dtype}{list(w.shape)}")
  if problems:
    raise ValueError(f"load_params: {path} does not match the model: " + "; ".join(problems))
  state = nnx.state(model, nnx.Param)
  new = nnx.from_flat_state([
      (p, leaf.replace(jnp.asarray(loaded[".".join(str(x) for x in p)])))
      for p, leaf in nnx.to_flat_state(state)])
  nnx.update(model, new)
  return model
