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
way out. A mixture-of-experts layer's per-expert tensors (Qwen3-MoE
``mlp.experts.{e}.gate_proj/up_proj/down_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1/w3/w2``) are stacked into its ``[E, ...]`` parameters
on the way in and split on the way out (:func:`hf_names`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_kernels.models.config import (
  AUTO,
  DecoderConfig,
  config,
  from_hf_dict,
  parse_dtype,
)
from jaxrl_kernels.models.decoder import (
  DecoderLM,
  pack_gate_up,
  pack_qkv,
  unpack_gate_up,
  unpack_qkv,
)
from jaxrl_kernels.nn import checkpoint

__all__ = ["from_pretrained", "parse_dtype", "preset", "read_safetensors", "save_pretrained",
           "write_safetensors"]

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
#: Tensors some checkpoints carry that the forward recomputes (rotary tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: The shard names save_pretrained writes (transformers'); only files with these names that
#: a previous index listed, and ``model.safetensors``, are ever removed.
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# ------------------------------------------------------------------------------ safetensors


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """``{name: array}`` of a safetensors file, memory-mapped (read on first use).

  Raises:
    ValueError: naming the file and the key of a malformed file (see
      :func:`jaxrl_kernels.nn.checkpoint.read_safetensors_header`).
  """
  path = os.fspath(path)
  out = {}
  for e in checkpoint.read_safetensors_header(path, op="from_pretrained"):
    if e.nbytes == 0:
      out[e.name] = np.zeros(e.shape, e.dtype)
    else:
      out[e.name] = np.memmap(path, dtype=e.dtype, mode="r", offset=e.offset, shape=e.shape)
  return out


def write_safetensors(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> None:
  """Writes ``{name: array}`` as one safetensors file (``__metadata__ = {"format": "pt"}``,
  which ``transformers`` checks), atomically: a synced temporary file renamed into place."""
  checkpoint.atomic_write(path, checkpoint.safetensors_writer(arrays, op="save_pretrained"))


def _read_json(path: str):
  try:
    with open(path, "rb") as f:
      return json.loads(f.read().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"from_pretrained: {path} is not UTF-8 JSON ({e})") from None


def _read_folder_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """``({tensor name: array}, {tensor name: file it came from})``."""
  single = os.path.join(path, SINGLE)
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    doc = _read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
      raise ValueError(f"from_pretrained: {index} has no 'weight_map' object")
    for name, file in weight_map.items():
      if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"from_pretrained: {index} maps tensor {name!r} to {file!r}, "
                         f"expected a file name in {path}")
    tensors: dict[str, np.ndarray] = {}
    files: dict[str, str] = {}
    for file in sorted(set(weight_map.values())):
      shard = os.path.join(path, file)
      if not os.path.isfile(shard):
        raise ValueError(f"from_pretrained: {index} lists {file}, which is missing")
      part = read_safetensors(shard)
      for name in part:
        if name in tensors:  # which copy is the weight? (the index maps a name to one file)
          raise ValueError(f"from_pretrained: {path} holds tensor {name} twice (in "
                           f"{files[name]} and {shard})")
      tensors.update(part)
      files.update(dict.fromkeys(part, shard))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
      raise ValueError(f"from_pretrained: tensors listed in {index} are missing from their "
                       f"files: {missing[:5]}")
    return tensors, files
  if os.path.exists(single):
    tensors = read_safetensors(single)
    return tensors, dict.fromkeys(tensors, single)
  raise ValueError(f"from_pretrained: {path} has neither {SINGLE} nor {INDEX}")


# ---------------------------------------------------------------------------------- names


#: The model's packed projections and the transformers modules they hold, in order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: A MoE layer's transformers module and its experts' (gate, up, down) projections.
MOE_MODULES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
#: ``MoEMLP``'s parameters: ``router [H, E]``, ``gate_up [E, H, 2I]``, ``down [E, I, H]``.
_MOE_LEAVES = ("router", "gate_up", "down")


def _moe_leaf(path: tuple) -> str | None:
  """``"router"``, ``"gate_up"`` or ``"down"`` for a ``MoEMLP`` parameter path
  (``("layers", i, "mlp", leaf)``), else None."""
  leaf = str(path[-1])
  return leaf if len(path) == 4 and str(path[-2]) == "mlp" and leaf in _MOE_LEAVES else None


def hf_names(path: tuple, cfg: DecoderConfig | None = None) -> tuple[tuple[str, ...], bool]:
  """``(transformers tensor names, transposed)`` of a model state path, e.g.
  ``("layers", 0, "mlp", "down_proj", "kernel")`` ->
  ``(("model.layers.0.mlp.down_proj.weight",), True)``; a packed projection names its
  parts, ``("layers", 0, "self_attn", "qkv_proj", "bias")`` ->
  ``(("model.layers.0.self_attn.q_proj.bias", "...k_proj.bias", "...v_proj.bias"), False)``.

  A MoE layer's parameters (``cfg`` needed: the model type and the number of experts):
  ``router`` -> ``model.layers.{i}.mlp.gate.weight`` (Mixtral:
  ``block_sparse_moe.gate.weight``); ``gate_up`` -> every expert's gate, then every
  expert's up projection (``mlp.experts.{e}.gate_proj.weight``, ``...up_proj.weight``;
  Mixtral ``w1``, ``w3``); ``down`` -> ``mlp.experts.{e}.down_proj.weight`` (Mixtral
  ``w2``); all ``[out, in]``, transposed."""
  leaf = _moe_leaf(path)
  if leaf is not None:
    if cfg is None or cfg.model_type not in MOE_MODULES:
      raise ValueError(f"hf_names: the MoE parameter {'.'.join(map(str, path))} needs the "
                       f"config of a {tuple(MOE_MODULES)} model, got "
                       f"{None if cfg is None else cfg.model_type!r}")
    block, (gate, up, down) = MOE_MODULES[cfg.model_type]
    prefix = f"model.layers.{path[1]}.{block}"
    experts = range(cfg.num_experts)
    if leaf == "router":
      return (f"{prefix}.gate.weight",), True
    mods = (gate, up) if leaf == "gate_up" else (down,)
    return tuple(f"{prefix}.experts.{e}.{m}.weight" for m in mods for e in experts), True
  *mods, leaf = (str(p) for p in path)
  suffix = "weight" if leaf in ("kernel", "embedding") else leaf
  transposed = leaf == "kernel"
  if mods[:1] == ["head"]:
    return (f"lm_head.{suffix}",), transposed
  prefix = ".".join(["model", *mods[:-1]])
  return tuple(f"{prefix}.{m}.{suffix}" for m in PACKED.get(mods[-1], mods[-1:])), transposed


def _part_shapes(path: tuple, cfg: DecoderConfig, shape: tuple) -> tuple[tuple, ...]:
  """The shapes (in the model's ``[in, out]`` layout) of the transformers tensors behind a
  parameter of ``shape``, in :func:`hf_names`' order (one tensor unless the parameter is
  packed or stacks experts)."""
  leaf = _moe_leaf(path)
  if leaf == "gate_up":
    return (tuple(shape[1:-1]) + (shape[-1] // 2,),) * (2 * shape[0])
  if leaf == "down":
    return (tuple(shape[1:]),) * shape[0]
  module = str(path[-2])
  widths = (shape[-1],)
  if module == "qkv_proj":
    widths = cfg.q_dim, cfg.kv_dim, cfg.kv_dim
  elif module == "gate_up_proj":
    widths = cfg.intermediate_size, cfg.intermediate_size
  return tuple((*shape[:-1], w) for w in widths)


def _pack(path: tuple, parts: list[np.ndarray], cfg: DecoderConfig) -> np.ndarray:
  leaf = _moe_leaf(path)
  if leaf == "gate_up":  # [E] gates then [E] ups, each [H, I] -> [E, H, 2I]
    e = len(parts) // 2
    return pack_gate_up(np.stack(parts[:e]), np.stack(parts[e:]))
  if leaf == "down":
    return np.stack(parts)
  module = str(path[-2])
  if module == "qkv_proj":
    return pack_qkv(*parts, cfg.num_key_value_heads)
  if module == "gate_up_proj":
    return pack_gate_up(*parts)
  return parts[0]


def _unpack(path: tuple, x: np.ndarray, cfg: DecoderConfig) -> tuple[np.ndarray, ...]:
  leaf = _moe_leaf(path)
  if leaf == "gate_up":
    gate, up = unpack_gate_up(x)
    return (*gate, *up)
  if leaf == "down":
    return tuple(x)
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


def _checkpoint_dtype(raw: dict, cfg_path: str) -> np.dtype:
  """``dtype="auto"``: the checkpoint's ``torch_dtype`` (``dtype`` in transformers 5)."""
  key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"
  value = raw.get(key)
  if value is None:
    raise ValueError(f"from_pretrained: dtype 'auto' reads torch_dtype from {cfg_path}, which "
                     f"has neither 'torch_dtype' nor 'dtype'")
  if isinstance(value, str) and value.startswith("torch."):
    value = value[len("torch."):]
  return parse_dtype(f"from_pretrained: {key} in {cfg_path} (dtype 'auto')", value)


_FUSED = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(experts\.gate_up_proj|"
                    r"experts\.down_proj|gate\.weight)$")


def _split_fused_experts(tensors: dict, files: dict, cfg: DecoderConfig) -> tuple[dict, dict]:
  """``transformers`` 5's in-memory expert layout, if a folder holds it, as the per-expert
  checkpoint names: ``{block}.experts.gate_up_proj`` ``[E, 2I, H]`` (every expert's gate
  rows, then its up rows) and ``{block}.experts.down_proj`` ``[E, H, I]``, with the block
  ``mlp`` for Mixtral too (its checkpoints say ``block_sparse_moe``). A weight found both
  fused and under its own name is refused (no copy is silently chosen)."""
  block, (gate, up, down) = MOE_MODULES[cfg.model_type]
  out, where = dict(tensors), dict(files)
  for name, x in tensors.items():
    m = _FUSED.match(name)
    if m is None or (m.group(3) == "gate.weight" and m.group(2) == block):
      continue
    prefix = f"model.layers.{m.group(1)}.{block}"
    del out[name]
    parts = {}
    if m.group(3) == "gate.weight":
      parts[f"{prefix}.gate.weight"] = x
    elif m.group(3) == "experts.down_proj":
      parts.update((f"{prefix}.experts.{e}.{down}.weight", x[e]) for e in range(x.shape[0]))
    else:
      half = x.shape[1] // 2
      for e in range(x.shape[0]):
        parts[f"{prefix}.experts.{e}.{gate}.weight"] = x[e, :half]
        parts[f"{prefix}.experts.{e}.{up}.weight"] = x[e, half:]
    for key in parts:
      if key in out:  # the per-expert tensor (or another fused one) is there too
        raise ValueError(f"from_pretrained: tensor {key} is given twice: under its own name "
                         f"(in {where[key]}) and within {name} (in {files[name]})")
    out.update(parts)
    where.update(dict.fromkeys(parts, files[name]))
  return out, where


def from_pretrained(path: str | os.PathLike, *, dtype=None, param_dtype=None,
                    implementation: str | None = None, remat: bool = False,
                    row_chunks: int | None = None) -> DecoderLM:
  """Loads a local Hugging Face folder into a :class:`DecoderLM`.

  Args:
    path: a folder with ``config.json`` and ``model.safetensors`` (or sharded
      ``model-*.safetensors`` + ``model.safetensors.index.json``).
    dtype: activation / KV-cache dtype (default: ``param_dtype``). Any value
      :func:`~jaxrl_kernels.models.config.parse_dtype` accepts (``"bf16"``,
      ``"bfloat16"``, ``jnp.bfloat16``, ...), or ``"auto"``: the checkpoint's ``torch_dtype``
      from ``config.json``.
    param_dtype: parameter dtype (default: the checkpoint's embedding dtype; the same values
      as ``dtype``). Floating tensors are rounded to it; integer or bool tensors are refused.
    implementation: passed to every op (see :class:`DecoderLM`).
    remat: recompute layer activations in the backward pass.
    row_chunks: K chunks of the row-parallel layers' canonical order (see
      :class:`DecoderLM`; None: :func:`~jaxrl_kernels.models.canonical_row_chunks`; 1: plain
      ``det_matmul``, tensor parallelism refused).

  Raises:
    ValueError: naming the file and what is wrong: an unknown ``model_type`` or unsupported
      or mistyped config option (:func:`~jaxrl_kernels.models.config.from_hf_dict`), a
      missing, unexpected, mis-shaped or non-float tensor, a tensor given twice (in two
      shards, or fused and per expert), a missing, truncated or malformed
      file (not JSON, a header without ``data_offsets``, ...), an unknown dtype string.
  """
  path = os.fspath(path)
  dt_arg = None if dtype is None else parse_dtype("from_pretrained: dtype", dtype,
                                                   allow_auto=True)
  pdt_arg = None if param_dtype is None else parse_dtype("from_pretrained: param_dtype",
                                                         param_dtype, allow_auto=True)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"from_pretrained: {path} has no config.json")
  raw = _read_json(cfg_path)
  cfg = from_hf_dict(raw, source=f"from_pretrained: {cfg_path}")
  tensors, files = _read_folder_tensors(path)
  if cfg.num_experts:
    tensors, files = _split_fused_experts(tensors, files, cfg)
  for name, x in tensors.items():
    if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16 \
        and not name.endswith(_IGNORED_SUFFIXES):
      raise ValueError(f"from_pretrained: tensor {name} in {files[name]} has dtype "
                       f"{x.dtype.name}; weights must be floating point ({_FLOAT_DTYPES} or "
                       f"float64), integer and bool tensors are not cast")
  layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
  if cfg.num_hidden_layers > len(layers):  # checked before building that many layers
    raise ValueError(f"from_pretrained: {cfg_path} has num_hidden_layers="
                     f"{cfg.num_hidden_layers} but the tensors in {path} hold {len(layers)} "
                     f"layers")
  auto = _checkpoint_dtype(raw, cfg_path) if AUTO in (dt_arg, pdt_arg) else None
  if pdt_arg is None:
    embed = tensors.get("model.embed_tokens.weight")
    stored = embed.dtype.name if embed is not None else "float32"
    pdt = jnp.dtype(stored if stored in _FLOAT_DTYPES else "float32")
  else:
    pdt = jnp.dtype(auto if pdt_arg == AUTO else pdt_arg)
  dt = pdt if dt_arg is None else jnp.dtype(auto if dt_arg == AUTO else dt_arg)
  graphdef, abstract = nnx.split(_abstract(cfg, dt, pdt, implementation, remat, row_chunks))
  flat = []
  used = set()
  for p, leaf in nnx.to_flat_state(abstract):
    names, transposed = hf_names(p, cfg)
    shape = tuple(leaf.get_value().shape)
    parts = []
    for name, want in zip(names, _part_shapes(p, cfg, shape), strict=True):
      if name not in tensors:
        raise ValueError(f"from_pretrained: tensor {name} (shape "
                         f"{want[::-1] if transposed else want}) is missing from {path}")
      x = tensors[name]
      got = tuple(x.shape[::-1] if transposed else x.shape)
      if got != want:
        raise ValueError(f"from_pretrained: tensor {name} has shape {tuple(x.shape)}, "
                         f"expected {want[::-1] if transposed else want} (in {files[name]})")
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


def _own_shards(path: str) -> set[str]:
  """The shard files of the checkpoint already in ``path``: those its
  ``model.safetensors.index.json`` lists under transformers' shard names. An unreadable
  index names none (nothing unidentified is removed)."""
  try:
    with open(os.path.join(path, INDEX), "rb") as f:
      weight_map = json.loads(f.read().decode("utf-8")).get("weight_map")
    files = set(weight_map.values())
  except (OSError, ValueError, AttributeError, TypeError):
    return set()
  return {f for f in files if isinstance(f, str) and _SHARD_NAME.fullmatch(f)
          and os.path.isfile(os.path.join(path, f))}


def _same_bytes(path: str, data: bytes) -> bool:
  try:
    with open(path, "rb") as f:
      return f.read() == data
  except OSError:
    return False


def save_pretrained(model: DecoderLM, path: str | os.PathLike, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
  """Writes ``model`` as a Hugging Face folder that ``transformers`` and vLLM load.

  ``config.json`` (with ``torch_dtype``/``dtype`` set to the parameter dtype) and
  ``model.safetensors``, or, when the weights exceed ``max_shard_bytes``,
  ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``.
  A tied embedding is written once (as ``model.embed_tokens.weight``).

  Other files in ``path`` (adapters, value heads, optimizer states, any other
  ``*.safetensors``) are never touched. Of a checkpoint saved there before, only
  ``model.safetensors``, ``model.safetensors.index.json`` and the
  ``model-0000k-of-0000n.safetensors`` shards that index lists are replaced or removed.

  Every file is first written in full to a synced temporary name in ``path``; an
  exception (or interrupt) before the last byte is written removes the temporaries and
  leaves the folder as it was. The files then replace the old ones by renames, in an order
  where the folder holds the old checkpoint, the new one, or (between the renames, when
  the config changes or same-named shards are replaced) no loadable checkpoint — never a
  mix of old and new.
  """
  if not isinstance(model, DecoderLM):
    raise TypeError(f"save_pretrained: model must be a DecoderLM, got {type(model).__name__}")
  if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) \
      or max_shard_bytes < 1:
    raise ValueError(f"save_pretrained: max_shard_bytes must be an int >= 1, got "
                     f"{max_shard_bytes!r}")
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"save_pretrained: path {path} exists and is not a folder")
  arrays: dict[str, np.ndarray] = {}
  for p, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names, transposed = hf_names(p, model.config)
    parts = _unpack(p, np.asarray(jax.device_get(leaf.get_value())), model.config)
    for name, x in zip(names, parts, strict=True):
      arrays[name] = np.ascontiguousarray(x.T if transposed else x)
  cfg = model.config.to_hf_dict()
  pdt = arrays["model.embed_tokens.weight"].dtype.name
  cfg["torch_dtype"] = pdt
  cfg["dtype"] = pdt
  cfg_bytes = json.dumps(cfg, indent=2, sort_keys=True).encode()
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(arrays):
    nbytes = arrays[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arrays[name]
    size += nbytes
  # {final file name: write(f)}, in the order they are committed (the index after its shards).
  files: dict[str, object] = {}
  if len(shards) == 1:
    files[SINGLE] = checkpoint.safetensors_writer(shards[0], op="save_pretrained")
  else:
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
      file = f"model-{k:05d}-of-{n:05d}.safetensors"
      files[file] = checkpoint.safetensors_writer(shard, op="save_pretrained")
      weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in arrays.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    index_bytes = json.dumps(index, indent=2).encode()
    files[INDEX] = lambda f: f.write(index_bytes)
  os.makedirs(path, exist_ok=True)
  old_shards = _own_shards(path)
  cfg_file = os.path.join(path, "config.json")
  cfg_changes = not _same_bytes(cfg_file, cfg_bytes)
  # 1. Everything is written and synced under temporary names; the folder is unchanged.
  temps: dict[str, str] = {}
  try:
    for file, write in [*files.items(), ("config.json", lambda f: f.write(cfg_bytes))]:
      tmp = checkpoint.temp_path(os.path.join(path, file))
      temps[file] = tmp
      checkpoint.write_synced(tmp, write)
  except BaseException:
    for tmp in temps.values():
      with contextlib.suppress(OSError):
        os.remove(tmp)
    raise
  # 2. Renames. A changed config is removed first, so that no old config ever describes new
  # weights (or the reverse); an old index is removed before shards of the same names are
  # replaced, so that it never lists a mix of old and new shards.
  def drop(file):
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(path, file))

  try:
    if cfg_changes:
      drop("config.json")
    if len(shards) > 1 and any(os.path.exists(os.path.join(path, f)) for f in files
                               if f != INDEX):
      drop(INDEX)
    for file in files:
      os.replace(temps.pop(file), os.path.join(path, file))
    if len(shards) == 1:
      drop(INDEX)
    else:
      drop(SINGLE)
    for file in sorted(old_shards - set(files)):
      drop(file)
    os.replace(temps.pop("config.json"), cfg_file)
  finally:
    for tmp in temps.values():
      with contextlib.suppress(OSError):
        os.remove(tmp)
  checkpoint.fsync_dir(path)


def preset(name: str, key: jax.Array | int = 0, dtype="bfloat16", *,
           implementation: str | None = None, remat: bool = False,
           row_chunks: int | None = None, **overrides) -> DecoderLM:
  """A :class:`DecoderLM` with random weights (normal, std 0.02) at the true shape of
  ``name``: ``"qwen2.5-0.5b"``, ``"qwen2.5-1.5b"``, ``"llama-3.2-1b"``,
  ``"llama-3.1-8b"``, ``"qwen3-8b"``, ``"qwen3-30b-a3b"``, ``"mixtral-8x7b"``.
  ``overrides`` replace config fields (e.g.
  ``num_hidden_layers=2``); ``row_chunks`` as in :class:`DecoderLM`. ``dtype`` (activations
  and parameters) takes what :func:`~jaxrl_kernels.models.config.parse_dtype` accepts;
  ``"auto"`` is refused (a preset has no checkpoint ``torch_dtype`` to read)."""
  if isinstance(dtype, str) and dtype == AUTO:
    raise ValueError("preset: dtype 'auto' means a checkpoint's torch_dtype and a preset has "
                     "no checkpoint; pass 'bfloat16', 'float32' or 'float16'")
  dt = parse_dtype("preset: dtype", dtype)
  cfg = config(name, **overrides)
  rngs = nnx.Rngs(params=key) if not isinstance(key, int) else nnx.Rngs(key)
  return DecoderLM(cfg, dtype=dt, implementation=implementation, remat=remat,
                   row_chunks=row_chunks, rngs=rngs)
