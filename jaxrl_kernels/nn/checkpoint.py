"""Saving and loading an nnx module's parameters: safetensors files and orbax folders.

Names are the module's state paths joined with dots, e.g. ``blocks.0.qkv.kernel``.
Loading checks names, shapes and dtypes and lists every mismatch in one error.

* ``*.safetensors``: the safetensors format (an 8-byte little-endian header
  size, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw
  little-endian bytes), read and written here with numpy, so no extra package
  is needed. bf16 is ``BF16``. Files are written to a synced temporary name in the
  same folder and renamed into place (:func:`atomic_write`): an interrupted save
  leaves the previous file as it was. A malformed file raises a ValueError naming
  the file and the key (:func:`read_safetensors_header`).
* any other path: an orbax checkpoint folder holding the same flat
  ``{name: array}`` dict. ``orbax-checkpoint`` is imported only then (``pip install
  'jaxrl_kernels[orbax]'``); without it such a path raises an ImportError saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import struct
from collections.abc import Callable
from typing import Any

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


def temp_path(path: str | os.PathLike) -> str:
  """A fresh hidden name next to ``path`` (same folder, so ``os.replace`` is atomic) that no
  ``*.safetensors`` / ``*.json`` glob matches."""
  folder, base = os.path.split(os.fspath(path))
  return os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def fsync_dir(folder: str | os.PathLike) -> None:
  """Makes renames inside ``folder`` durable (a no-op where folders cannot be opened)."""
  try:
    fd = os.open(os.fspath(folder) or ".", os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_synced(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
  """Creates ``path`` (which must not exist), calls ``write(f)`` on it, and syncs it to
  disk; on any exception the partial file is removed."""
  path = os.fspath(path)
  try:
    with open(path, "xb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(path)
    raise


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
  """Writes ``path`` all or nothing: ``write(f)`` fills a synced temporary file in the same
  folder, which then replaces ``path`` in one rename. On any exception ``path`` keeps its
  previous content and no temporary file is left."""
  path = os.fspath(path)
  tmp = temp_path(path)
  write_synced(tmp, write)
  try:
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  fsync_dir(os.path.dirname(path))


def safetensors_writer(arrays: dict[str, np.ndarray], *, op: str) -> Callable[[Any], None]:
  """``write(f)`` that writes ``{name: array}`` in the safetensors format (tensors sorted by
  name, ``__metadata__ = {"format": "pt"}``, which ``transformers`` checks, the data 8-byte
  aligned). Unsupported dtypes raise a TypeError naming the tensor, before anything is
  written."""
  header: dict = {"__metadata__": {"format": "pt"}}
  offset, blobs = 0, []
  for name in sorted(arrays):
    a = np.ascontiguousarray(np.asarray(arrays[name]))
    if a.dtype not in _NAMES:
      raise TypeError(f"{op}: tensor {name} has unsupported dtype {a.dtype} (supported: "
                      f"{sorted(str(np.dtype(d)) for d in _DTYPES.values())})")
    st = _NAMES[a.dtype]
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    header[name] = {"dtype": st, "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    blobs.append(a)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned

  def write(f) -> None:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for a in blobs:
      f.write(a.reshape(-1).view(np.uint8))

  return write


def save_safetensors(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> None:
  """Writes ``{name: array}`` as a safetensors file, atomically (:func:`atomic_write`)."""
  atomic_write(path, safetensors_writer(arrays, op="save_safetensors"))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """One tensor of a safetensors header: its dtype, shape and absolute byte offset."""

  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int
  nbytes: int


def read_safetensors_header(path: str | os.PathLike, *, op: str) -> list[TensorEntry]:
  """The checked header of a safetensors file.

  Raises:
    ValueError: naming the file (and the tensor and key where there is one): a file shorter
      than its header or than a tensor's ``data_offsets``, a header that is not UTF-8 JSON
      or not an object, a tensor entry without ``dtype``/``shape``/``data_offsets`` or with
      values of the wrong type, an unsupported dtype, offsets that do not hold the shape.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{op}: {path} is too short to be a safetensors file ({len(head)} "
                       f"bytes)")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
      raise ValueError(f"{op}: {path} declares a {n}-byte header but has {size - 8} bytes "
                       f"after the size (truncated?)")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{op}: {path} has a header that is not UTF-8 JSON ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{op}: {path} has a header that is a JSON {type(header).__name__}, "
                     f"expected an object {{name: {{dtype, shape, data_offsets}}}}")
  base = 8 + n
  out = []
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"{op}: tensor {name!r} in {path}"
    if not isinstance(info, dict):
      raise ValueError(f"{where} has a header entry that is a JSON {type(info).__name__}, "
                       f"expected an object")
    for key in ("dtype", "shape", "data_offsets"):
      if key not in info:
        raise ValueError(f"{where} has no {key!r} in its header entry")
    st, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(st, str) or st not in _DTYPES:
      raise ValueError(f"{where} has unsupported dtype {st!r} (supported: {sorted(_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
      raise ValueError(f"{where} has 'shape' {shape!r}, expected a list of ints >= 0")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(o) for o in offs)
        or offs[0] > offs[1]):
      raise ValueError(f"{where} has 'data_offsets' {offs!r}, expected [begin, end] with "
                       f"0 <= begin <= end")
    dt = np.dtype(_DTYPES[st]).newbyteorder("<")
    lo, hi = offs
    count = math.prod(shape)
    if hi - lo != count * dt.itemsize:
      raise ValueError(f"{where} has {hi - lo} bytes in 'data_offsets' for shape "
                       f"{tuple(shape)} of {st}")
    if base + hi > size:
      raise ValueError(f"{where} ends at byte {base + hi} ('data_offsets' {offs}) but the "
                       f"file has {size} bytes (truncated?)")
    out.append(TensorEntry(name, dt, tuple(shape), base + lo, hi - lo))
  return out


def _is_count(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads a safetensors file into ``{name: numpy array}`` (errors as
  :func:`read_safetensors_header`)."""
  entries = read_safetensors_header(path, op="load_safetensors")
  with open(path, "rb") as f:
    data = f.read()
  return {e.name: np.frombuffer(data[e.offset:e.offset + e.nbytes], e.dtype).reshape(e.shape)
          for e in entries}


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
