"""Hugging Face folders: :func:`from_pretrained` / :func:`save_pretrained`, and :func:`preset`.

A folder holds ``config.json`` and the weights as ``model.safetensors``, or
sharded as ``model-0000k-of-0000n.safetensors`` listed in
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). The
safetensors format is an 8-byte little-endian header size, a JSON header
``{name: {dtype, shape, data_offsets}}`` (plus ``__metadata__``), then the raw
little-endian tensor bytes; it is read here with ``numpy.memmap`` (no copy of
the file in memory) and written with numpy. No ``transformers`` dependency.

Tensor names are ``transformers``' (``model.layers.3.self_attn.q_proj.weight``
``[out, in]``); the model holds ``DetLinear`` kernels ``[in, out]``, so linear
weights are transposed on the way in and out, and its packed projections
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``; see :mod:`~jaxrl_kernels.models.decoder`)
are packed from ``q/k/v_proj`` and ``gate/up_proj`` on the way in and split on the
way out.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_kernels.models.config import DecoderConfig, config, from_hf_dict
from jaxrl_kernels.models.decoder import (
  DecoderLM,
  pack_gate_up,
  pack_qkv,
  unpack_gate_up,
  unpack_qkv,
)

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": jnp.bfloat16, "I64": np.int64, "I32": np.int32, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
#: Tensors some checkpoints carry that the forward recomputes (rotary tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size


# ------------------------------------------------------------------------------ safetensors


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """``{name: array}`` of a safetensors file, memory-mapped (read on first use)."""
  path = os.fspath(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"from_pretrained: {path} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head)
    size = os.path.getsize(path)
    if 8 + n > size:
      raise ValueError(f"from_pretrained: {path} declares a {n}-byte header but has "
                       f"{size - 8} bytes after it")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  base = 8 + n
  out = {}
  for name, info in header.items():
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"from_pretrained: tensor {name} in {path} has unsupported dtype "
                       f"{info['dtype']}")
    dt = np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")
    lo, hi = info["data_offsets"]
    shape = tuple(info["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if hi - lo != count * dt.itemsize:
      raise ValueError(f"from_pretrained: tensor {name} in {path} has {hi - lo} bytes for "
                       f"shape {shape} of {info['dtype']}")
    if count == 0:
      out[name] = np.zeros(shape, dt)
    else:
      out[name] = np.memmap(path, dtype=dt, mode="r", offset=base + lo, shape=shape)
  return out


def write_safetensors(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> None:
  """Writes ``{name: array}`` as one safetensors file (``__metadata__ = {"format": "pt"}``,
  which ``transformers`` checks)."""
  header: dict = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name in sorted(arrays):
    a = arrays[name]
    if a.dtype not in _ST_NAMES:
      raise TypeError(f"save_pretrained: {name} has unsupported dtype {a.dtype}")
    nbytes = a.size * a.dtype.itemsize
    header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name in sorted(arrays):
      a = np.ascontiguousarray(arrays[name])
      f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def _read_folder_tensors(path: str) -> dict[str, np.ndarray]:
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"from_pretrained: {index} has no 'weight_map' object")
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(set(weight_map.values())):
      shard = os.path.join(path, file)
      if not os.path.exists(shard):
        raise ValueError(f"from_pretrained: {index} lists {file}, which is missing")
      tensors.update(read_safetensors(shard))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
      raise ValueError(f"from_pretrained: tensors listed in {index} are missing from their "
                       f"files: {missing[:5]}")
    return tensors
  if os.path.exists(single):
    return read_safetensors(single)
  raise ValueError(f"from_pretrained: {path} has neither model.safetensors nor "
                   f"model.safetensors.index.json")


# ---------------------------------------------------------------------------------- names


#: The model's packed projections and the transformers modules they hold, in order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_names(path: tuple) -> tuple[tuple[str, ...], bool]:
  """``(transformers tensor names, transposed)`` of a model state path, e.g.
  ``("layers", 0, "mlp", "down_proj", "kernel")`` ->
  ``(("model.layers.0.mlp.down_proj.weight",), True)``; a packed projection names its
  parts, ``("layers", 0, "self_attn", "qkv_proj", "bias")`` ->
  ``(("model.layers.0.self_attn.q_proj.bias", "...k_proj.bias", "...v_proj.bias"), False)``."""
  *mods, leaf = (str(p) for p in path)
  suffix = "weight" if leaf in ("kernel", "embedding") else leaf
  transposed = leaf == "kernel"
  if mods[:1] == ["head"]:
    return (f"lm_head.{suffix}",), transposed
  prefix = ".".join(["model", *mods[:-1]])
  return tuple(f"{prefix}.{m}.{suffix}" for m in PACKED.get(mods[-1], mods[-1:])), transposed


def _part_widths(path: tuple, cfg: DecoderConfig, width: int) -> tuple[int, ...]:
  """The last-axis sizes of the transformers tensors behind a parameter of last axis
  ``width`` (one tensor unless the parameter is packed)."""
  module = str(path[-2])
  if module == "qkv_proj":
    return cfg.q_dim, cfg.kv_dim, cfg.kv_dim
  if module == "gate_up_proj":
    return cfg.intermediate_size, cfg.intermediate_size
  return (width,)


def _pack(path: tuple, parts: list[np.ndarray], cfg: DecoderConfig) -> np.ndarray:
  module = str(path[-2])
  if module == "qkv_proj":
    return pack_qkv(*parts, cfg.num_key_value_heads)
  if module == "gate_up_proj":
    return pack_gate_up(*parts)
  return parts[0]


def _unpack(path: tuple, x: np.ndarray, cfg: DecoderConfig) -> tuple[np.ndarray, ...]:
  module = str(path[-2])
  if module == "qkv_proj":
    return unpack_qkv(x, cfg.num_key_value_heads, cfg.head_dim)
  if module == "gate_up_proj":
    return unpack_gate_up(x)
  return (x,)


def _abstract(cfg: DecoderConfig, dtype, param_dtype, implementation, remat, row_chunks):
  return nnx.eval_shape(lambda: DecoderLM(cfg, dtype=dtype, param_dtype=param_dtype,
                                          implementation=implementation, remat=remat,
                                          row_chunks=row_chunks, rngs=nnx.Rngs(0)))


def _float_dtype(name: str, value) -> jnp.dtype:
  try:
    dt = jnp.dtype(value)
  except TypeError:
    raise ValueError(f"from_pretrained: {name} must be one of {_FLOAT_DTYPES}, got "
                     f"{value!r}") from None
  if dt.name not in _FLOAT_DTYPES:
    raise ValueError(f"from_pretrained: {name} must be one of {_FLOAT_DTYPES}, got {dt.name!r}")
  return dt


def from_pretrained(path: str | os.PathLike, *, dtype=None, param_dtype=None,
                    implementation: str | None = None, remat: bool = False,
                    row_chunks: int | None = None) -> DecoderLM:
  """Loads a local Hugging Face folder into a :class:`DecoderLM`.

  Args:
    path: a folder with ``config.json`` and ``model.safetensors`` (or sharded
      ``model-*.safetensors`` + ``model.safetensors.index.json``).
    dtype: activation / KV-cache dtype (default: ``param_dtype``).
    param_dtype: parameter dtype (default: the checkpoint's embedding dtype).
    implementation: passed to every op (see :class:`DecoderLM`).
    remat: recompute layer activations in the backward pass.
    row_chunks: K chunks of the row-parallel layers' canonical order (see
      :class:`DecoderLM`; None: :func:`~jaxrl_kernels.models.canonical_row_chunks`; 1: plain
      ``det_matmul``, tensor parallelism refused).

  Raises:
    ValueError: naming what is wrong: an unknown ``model_type`` or unsupported
      config option (:func:`~jaxrl_kernels.models.config.from_hf_dict`), a missing,
      unexpected or mis-shaped tensor, a missing file.
  """
  path = os.fspath(path)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise ValueError(f"from_pretrained: {path} has no config.json")
  with open(cfg_path) as f:
    cfg = from_hf_dict(json.load(f))
  tensors = _read_folder_tensors(path)
  embed = tensors.get("model.embed_tokens.weight")
  if param_dtype is None:
    stored = embed.dtype.name if embed is not None else "float32"
    param_dtype = stored if stored in _FLOAT_DTYPES else "float32"
  pdt = _float_dtype("param_dtype", param_dtype)
  dt = pdt if dtype is None else _float_dtype("dtype", dtype)
  graphdef, abstract = nnx.split(_abstract(cfg, dt, pdt, implementation, remat, row_chunks))
  flat = []
  used = set()
  for p, leaf in nnx.to_flat_state(abstract):
    names, transposed = hf_names(p)
    shape = tuple(leaf.get_value().shape)
    parts = []
    for name, width in zip(names, _part_widths(p, cfg, shape[-1]), strict=True):
      want = (*shape[:-1], width)
      if name not in tensors:
        raise ValueError(f"from_pretrained: tensor {name} (shape "
                         f"{want[::-1] if transposed else want}) is missing from {path}")
      x = tensors[name]
      got = tuple(x.shape[::-1] if transposed else x.shape)
      if got != want:
        raise ValueError(f"from_pretrained: tensor {name} has shape {tuple(x.shape)}, "
                         f"expected {want[::-1] if transposed else want}")
      used.add(name)
      x = np.asarray(x)
      parts.append(x.T if transposed else x)
    value = _pack(p, parts, cfg)
    flat.append((p, leaf.replace(jnp.asarray(value, leaf.get_value().dtype))))
  unexpected = sorted(n for n in set(tensors) - used
                      if not n.endswith(_IGNORED_SUFFIXES)
                      and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
  if unexpected:
    raise ValueError(f"from_pretrained: {path} holds tensors this {cfg.model_type!r} model has "
                     f"no place for: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(model: DecoderLM, path: str | os.PathLike, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
  """Writes ``model`` as a Hugging Face folder that ``transformers`` and vLLM load.

  ``config.json`` (with ``torch_dtype``/``dtype`` set to the parameter dtype) and
  ``model.safetensors``, or, when the weights exceed ``max_shard_bytes``,
  ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``.
  A tied embedding is written once (as ``model.embed_tokens.weight``).
  """
  if not isinstance(model, DecoderLM):
    raise TypeError(f"save_pretrained: model must be a DecoderLM, got {type(model).__name__}")
  if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise ValueError(f"save_pretrained: max_shard_bytes must be an int >= 1, got "
                     f"{max_shard_bytes!r}")
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  arrays: dict[str, np.ndarray] = {}
  for p, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names, transposed = hf_names(p)
    parts = _unpack(p, np.asarray(jax.device_get(leaf.get_value())), model.config)
    for name, x in zip(names, parts, strict=True):
      arrays[name] = np.ascontiguousarray(x.T if transposed else x)
  cfg = model.config.to_hf_dict()
  pdt = arrays["model.embed_tokens.weight"].dtype.name
  cfg["torch_dtype"] = pdt
  cfg["dtype"] = pdt
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2, sort_keys=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(arrays):
    nbytes = arrays[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arrays[name]
    size += nbytes
  for stale in os.listdir(path):  # a previous save's shards would confuse a loader
    if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
      os.remove(os.path.join(path, stale))
  if len(shards) == 1:
    write_safetensors(shards[0], os.path.join(path, "model.safetensors"))
    return
  n = len(shards)
  weight_map = {}
  for k, shard in enumerate(shards, start=1):
    file = f"model-{k:05d}-of-{n:05d}.safetensors"
    write_safetensors(shard, os.path.join(path, file))
    weight_map.update({name: file for name in shard})
  index = {"metadata": {"total_size": int(sum(a.nbytes for a in arrays.values()))},
           "weight_map": dict(sorted(weight_map.items()))}
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f, indent=2)


def preset(name: str, key: jax.Array | int = 0, dtype="bfloat16", *,
           implementation: str | None = None, remat: bool = False,
           row_chunks: int | None = None, **overrides) -> DecoderLM:
  """A :class:`DecoderLM` with random weights (normal, std 0.02) at the true shape of
  ``name``: ``"qwen2.5-0.5b"``, ``"qwen2.5-1.5b"``, ``"llama-3.2-1b"``,
  ``"llama-3.1-8b"``, ``"qwen3-8b"``. ``overrides`` replace config fields (e.g.
  ``num_hidden_layers=2``); ``row_chunks`` as in :class:`DecoderLM`."""
  cfg = config(name, **overrides)
  rngs = nnx.Rngs(params=key) if not isinstance(key, int) else nnx.Rngs(key)
  return DecoderLM(cfg, dtype=dtype, implementation=implementation, remat=remat,
                   row_chunks=row_chunks, rngs=rngs)
