"""Hugging Face folders as files: ``save_pretrained`` touches only its own files and writes
all or nothing; ``from_pretrained`` refuses malformed files with a ValueError naming the file
and the key; dtype strings. A bounded fuzz part corrupts saved folders (truncations, mangled
safetensors headers, ``config.json`` / index variants) and round-trips random tiny models
bit for bit. The module prints its counts at teardown (``pytest -s``)."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import json
import math
import os
import shutil
import struct
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, fuzz
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_kernels import models
from jaxrl_kernels.models import hf
from jaxrl_kernels.models.config import parse_dtype
from jaxrl_kernels.nn import checkpoint

COUNTS: collections.Counter = collections.Counter()
TINY = dict(num_hidden_layers=1, vocab_size=160, hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PRESET = {"llama": "llama-3.2-1b", "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-8b"}
TOKENS = np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 9)).astype(np.int32)
SHARD_BYTES = 40_000  # a float32 tiny model in 3-5 shards


@pytest.fixture(scope="module", autouse=True)
def _counts():
  yield
  print(f"\nhf files fuzz: {COUNTS['cases']} cases tried, {COUNTS['named']} named errors, "
        f"{COUNTS['loaded']} corrupted-but-valid folders loaded, {COUNTS['agree']} bitwise "
        f"round trips")


def tiny(arch: str, dtype="float32", seed: int = 0) -> models.DecoderLM:
  """A one-layer model whose every parameter is random with a wide dynamic range (so a
  changed bit anywhere changes the log-probs)."""
  model = models.preset(PRESET[arch], seed, dtype, **TINY)
  rng = np.random.default_rng(seed)
  flat = []
  for p, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    v = leaf.get_value()
    x = rng.standard_normal(v.shape) * 2.0 ** rng.integers(-6, 3, v.shape) * 0.3
    flat.append((p, leaf.replace(jnp.asarray(x, v.dtype))))
  nnx.update(model, nnx.from_flat_state(flat))
  return model


@nnx.jit
def _logp(model, tokens):
  return model.logp(tokens, jnp.roll(tokens, -1, axis=1))


def params(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def folder_bytes(path) -> dict[str, bytes]:
  out = {}
  for name in sorted(os.listdir(path)):
    with open(os.path.join(path, name), "rb") as f:
      out[name] = f.read()
  return out


def named(fn, *names: str, exc=ValueError):
  """``fn()`` raises ``exc`` (exactly that class or a subclass) naming every one of
  ``names``."""
  with pytest.raises(exc) as e:
    fn()
  for name in names:
    assert name in str(e.value), f"message does not name {name!r}: {e.value}"
  COUNTS["named"] += 1
  return e.value


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A float32 qwen3 model saved as one file and as shards."""
  model = tiny("qwen3", seed=1)
  base = tmp_path_factory.mktemp("saved")
  models.save_pretrained(model, base / "one")
  models.save_pretrained(model, base / "sharded", max_shard_bytes=SHARD_BYTES)
  return model, base


def copy(src, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)


# ------------------------------------------------------------ save_pretrained: files it owns


OTHERS = {"adapter_model.safetensors": b"adapter", "value_head.safetensors": b"value head",
          "optimizer.safetensors": b"optimizer state",
          # Named like a shard, but no index of this folder ever listed it.
          "model-00007-of-00099.safetensors": b"not listed", "notes.json": b"{}"}


def test_other_files_survive_every_kind_of_save(tmp_path):
  model = tiny("llama")
  for name, data in OTHERS.items():
    (tmp_path / name).write_bytes(data)
  # single -> sharded (5) -> sharded (fewer) -> single: each save replaces only its own files.
  for shard_bytes in (2**30, 20_000, SHARD_BYTES, 2**30):
    models.save_pretrained(model, tmp_path, max_shard_bytes=shard_bytes)
    files = set(os.listdir(tmp_path))
    for name, data in OTHERS.items():
      assert (tmp_path / name).read_bytes() == data, name
    mine = files - set(OTHERS)
    if shard_bytes == 2**30:
      assert mine == {"config.json", "model.safetensors"}
    else:
      index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
      shards = set(index["weight_map"].values())
      assert len(shards) > 1 and mine == {"config.json", "model.safetensors.index.json",
                                          *shards}
    again = models.from_pretrained(tmp_path)
    for k, v in params(model).items():
      assert_bitwise_equal(params(again)[k], v, f"{k} after saving with {shard_bytes}")


def test_resave_with_fewer_shards_removes_only_its_stale_shards(tmp_path):
  model = tiny("qwen2")
  models.save_pretrained(model, tmp_path, max_shard_bytes=20_000)
  old = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())
            ["weight_map"].values())
  (tmp_path / "adapter_model.safetensors").write_bytes(b"adapter")
  models.save_pretrained(model, tmp_path, max_shard_bytes=SHARD_BYTES)
  new = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())
            ["weight_map"].values())
  assert len(new) < len(old) and not (old - new) & set(os.listdir(tmp_path))
  assert set(os.listdir(tmp_path)) == {"config.json", "model.safetensors.index.json",
                                       "adapter_model.safetensors", *new}


def test_save_refuses_a_path_that_is_a_file(tmp_path):
  (tmp_path / "f").write_bytes(b"x")
  named(lambda: models.save_pretrained(tiny("qwen3"), tmp_path / "f"), str(tmp_path / "f"))


class _Interrupted(Exception):
  pass


def _fail_writes_after(monkeypatch, budget: int):
  """Every file opened for writing from now on raises ``_Interrupted`` once ``budget``
  bytes in all have been written (the bytes before it reach the file)."""
  real_open = builtins.open
  state = {"left": budget}

  class Proxy:
    def __init__(self, f):
      self._f = f

    def write(self, data):
      data = memoryview(data).cast("B")
      n = min(len(data), state["left"])
      self._f.write(data[:n])
      state["left"] -= n
      if n < len(data):
        raise _Interrupted(f"interrupted after {budget} bytes")
      return n

    def __getattr__(self, name):
      return getattr(self._f, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self._f.__exit__(*exc)

  def fake_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    return Proxy(f) if any(c in mode for c in "wxa+") else f

  monkeypatch.setattr(builtins, "open", fake_open)


@fuzz(8)
@given(first_shards=st.sampled_from([2**30, SHARD_BYTES]),
       second_shards=st.sampled_from([2**30, SHARD_BYTES, 20_000]),
       fraction=st.floats(0.0, 0.999), same_config=st.booleans())
def test_interrupted_save_leaves_the_previous_checkpoint(first_shards, second_shards,
                                                         fraction, same_config):
  """An exception at any byte of a save leaves every file of the folder bitwise as it was
  (the previous checkpoint loads and gives the same log-probs) and no temporary file."""
  COUNTS["cases"] += 1
  first = tiny("qwen3", seed=2)
  second = tiny("qwen3", seed=3) if same_config else tiny("llama", seed=3)
  with tempfile.TemporaryDirectory() as d:
    models.save_pretrained(first, d, max_shard_bytes=first_shards)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
      f.write(b"adapter")
    before = folder_bytes(d)
    total = sum(a.nbytes for a in params(second).values())
    with pytest.MonkeyPatch.context() as mp:
      _fail_writes_after(mp, int(fraction * total))
      with pytest.raises(_Interrupted):
        models.save_pretrained(second, d, max_shard_bytes=second_shards)
    assert folder_bytes(d) == before
    again = models.from_pretrained(d)
    assert_bitwise_equal(_logp(again, TOKENS), _logp(first, TOKENS), "log-probs")
    COUNTS["agree"] += 1


def test_save_safetensors_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "p.safetensors"
  checkpoint.save_safetensors({"a": np.arange(64, dtype=np.float32)}, path)
  before = path.read_bytes()
  _fail_writes_after(monkeypatch, 100)
  with pytest.raises(_Interrupted):
    checkpoint.save_safetensors({"a": np.ones(64, np.float32)}, path)
  monkeypatch.undo()
  assert os.listdir(tmp_path) == ["p.safetensors"] and path.read_bytes() == before


# ------------------------------------------------------------ from_pretrained: named errors


def _header(path) -> tuple[dict, bytes]:
  raw = open(path, "rb").read()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(path, header_bytes: bytes, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def _a_tensor(header: dict) -> str:
  return sorted(k for k in header if k != "__metadata__")[0]


@pytest.mark.parametrize("what", ["truncated", "no_data_offsets", "list_header", "bad_json",
                                  "not_utf8", "bad_offsets_type", "int_tensor", "bool_tensor"])
def test_malformed_tensor_file_named(saved, tmp_path, what):
  _, base = saved
  path = copy(base / "one", tmp_path / "m")
  st_path = os.path.join(path, "model.safetensors")
  header, data = _header(st_path)
  name = _a_tensor(header)
  key = str(st_path)
  if what == "truncated":
    os.truncate(st_path, os.path.getsize(st_path) - 3)
    key = "truncated"
  else:
    if what == "no_data_offsets":
      del header[name]["data_offsets"]
      key = "'data_offsets'"
    elif what == "list_header":
      header = [header]
    elif what == "bad_offsets_type":
      header[name]["data_offsets"] = ["0", 4]
      key = "'data_offsets'"
    elif what in ("int_tensor", "bool_tensor"):
      # The same bytes read as integers (or one byte per element as bool): never cast.
      n = math.prod(header[name]["shape"])
      header[name]["dtype"] = "I32" if what == "int_tensor" else "BOOL"
      if what == "bool_tensor":
        lo = header[name]["data_offsets"][0]
        header[name]["data_offsets"] = [lo, lo + n]
      key = "int32" if what == "int_tensor" else "bool"
    text = json.dumps(header).encode()
    if what == "bad_json":
      text = text[:-1]
    elif what == "not_utf8":
      text = b"\xff" + text
    _with_header(st_path, text, data)
  err = named(lambda: models.from_pretrained(path), st_path, key)
  if what in ("no_data_offsets", "bad_offsets_type", "int_tensor", "bool_tensor"):
    assert name in str(err)


@pytest.mark.parametrize("what", ["bad_json", "list", "rope_theta_null", "rope_theta_zero",
                                  "rope_theta_negative", "rope_theta_inf", "rope_theta_huge",
                                  "vocab_string", "rope_parameters_theta_null"])
def test_malformed_config_named(saved, tmp_path, what):
  _, base = saved
  path = copy(base / "one", tmp_path / "m")
  cfg_path = os.path.join(path, "config.json")
  cfg = json.load(open(cfg_path))
  key = "rope_theta"
  if what == "bad_json":
    text, key = json.dumps(cfg)[:-1], "JSON"
  elif what == "list":
    text, key = json.dumps([cfg]), "list"
  else:
    value = {"rope_theta_null": None, "rope_theta_zero": 0.0, "rope_theta_negative": -1.0,
             "rope_theta_inf": float("inf"), "rope_theta_huge": 1e39,
             "vocab_string": "160", "rope_parameters_theta_null": None}[what]
    if what == "vocab_string":
      cfg["vocab_size"], key = value, "vocab_size"
    elif what == "rope_parameters_theta_null":
      cfg.pop("rope_theta")
      cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
    else:
      cfg["rope_theta"] = value
    text = json.dumps(cfg)
  open(cfg_path, "w").write(text)
  named(lambda: models.from_pretrained(path), cfg_path, key)


@pytest.mark.parametrize("what", ["bad_json", "list", "weight_map_list", "outside"])
def test_malformed_index_named(saved, tmp_path, what):
  _, base = saved
  path = copy(base / "sharded", tmp_path / "m")
  index = os.path.join(path, "model.safetensors.index.json")
  doc = json.load(open(index))
  text = {"bad_json": lambda: json.dumps(doc)[:-2], "list": lambda: json.dumps([doc]),
          "weight_map_list": lambda: json.dumps({"weight_map": list(doc["weight_map"])}),
          "outside": lambda: json.dumps({"weight_map": dict.fromkeys(
              doc["weight_map"], "../model.safetensors")})}[what]()
  open(index, "w").write(text)
  named(lambda: models.from_pretrained(path), index)


def test_rope_theta_refused_by_the_config():
  cfg = models.config("qwen3-8b", **TINY)
  for theta in (0.0, -1.0, float("nan"), float("inf"), 1e39, None, True):
    named(lambda t=theta: dataclasses.replace(cfg, rope_theta=t), "rope_theta")
  for eps in (-1e-6, float("nan")):
    named(lambda e=eps: dataclasses.replace(cfg, rms_norm_eps=e), "rms_norm_eps")
  named(lambda: dataclasses.replace(cfg, rope_scaling=("llama3", 8.0, 4.0, 1.0, 8192)),
        "rope_scaling")
  assert dataclasses.replace(cfg, rope_theta=1.0).rope_theta == 1.0


def test_defaults_of_absent_keys_are_transformers():
  """Qwen3Config: head_dim 128; Qwen2/Qwen3: num_key_value_heads 32 when absent, the head
  count when null; Llama: head_dim = hidden / heads, num_key_value_heads = heads."""
  d = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
           num_attention_heads=64)
  q3 = models.from_hf_dict({**d, "model_type": "qwen3"})
  assert (q3.head_dim, q3.num_key_value_heads) == (128, 32)
  q2 = models.from_hf_dict({**d, "model_type": "qwen2", "num_attention_heads": 16,
                            "num_key_value_heads": None})
  assert (q2.head_dim, q2.num_key_value_heads) == (4, 16)
  ll = models.from_hf_dict({**d, "model_type": "llama", "num_attention_heads": 4})
  assert (ll.head_dim, ll.num_key_value_heads, ll.max_position_embeddings) == (16, 4, 2048)
  named(lambda: models.from_hf_dict([d]), "config.json", "list")
  named(lambda: models.from_hf_dict({**d, "model_type": "qwen2", "num_attention_heads": 16}),
        "num_key_value_heads=32")


# --------------------------------------------------------------------------- dtype strings


def test_parse_dtype_aliases_and_errors():
  bf16, f16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
  for value, want in (("bf16", bf16), ("bfloat16", bf16), (jnp.bfloat16, bf16),
                      ("fp16", f16), ("float16", f16), (np.float16, f16),
                      ("fp32", f32), ("float32", f32), (np.dtype("float32"), f32),
                      (jnp.float32, f32)):
    assert parse_dtype("x", value) == want, value
  assert parse_dtype("x", "auto", allow_auto=True) == "auto"
  for bad in ("auto", "float64", "int8", "BF16", "", np.int32, None, 3):
    err = named(lambda b=bad: parse_dtype("--model-dtype", b), "--model-dtype", "'bf16'")
    assert bad == "auto" or "'auto'" not in str(err)
  named(lambda: parse_dtype("--model-dtype", "half", allow_auto=True), "'auto'")


def test_from_pretrained_and_preset_take_the_aliases(saved, tmp_path):
  model, base = saved
  ref = params(models.from_pretrained(base / "one", dtype="bfloat16", param_dtype="bfloat16"))
  for dt in ("bf16", jnp.bfloat16):
    got = params(models.from_pretrained(base / "one", dtype=dt, param_dtype=dt))
    for k in ref:
      assert_bitwise_equal(got[k], ref[k], k)
  # 'auto' reads torch_dtype from config.json (here float32; the tensors' bytes are float32).
  path = copy(base / "one", tmp_path / "m")
  auto = models.from_pretrained(path, dtype="auto", param_dtype="auto")
  assert auto.dtype == jnp.float32
  cfg = json.load(open(os.path.join(path, "config.json")))
  cfg.update(torch_dtype="bfloat16", dtype="bfloat16")
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  auto = models.from_pretrained(path, dtype="auto", param_dtype="auto")
  assert auto.dtype == jnp.bfloat16
  assert auto.embed_tokens.embedding.get_value().dtype == jnp.bfloat16
  cfg.update(torch_dtype="int8", dtype=None)
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  named(lambda: models.from_pretrained(path, dtype="auto"), "torch_dtype", "'int8'")
  named(lambda: models.from_pretrained(base / "one", dtype="half"), "from_pretrained: dtype")
  named(lambda: models.from_pretrained(base / "one", param_dtype="f64"),
        "from_pretrained: param_dtype")
  assert models.preset("qwen3-8b", 0, "fp32", **TINY).dtype == jnp.float32
  named(lambda: models.preset("qwen3-8b", 0, "auto", **TINY), "preset: dtype", "auto")
  named(lambda: models.preset("qwen3-8b", 0, "float64", **TINY), "preset: dtype")


# ---------------------------------------------------------------------------------- fuzz


_BAD_VALUES = (None, -1, 0, 1.5, 1e39, float("inf"), float("nan"), "7", [1], {"a": 1}, True)
_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "tie_word_embeddings", "max_position_embeddings",
                "rope_scaling", "attention_bias", "bos_token_id", "hidden_act", "model_type")
_ENTRY_EDITS = ("drop_dtype", "drop_shape", "drop_data_offsets", "dtype", "shape",
                "data_offsets", "entry_list", "shift")


def _corrupt_tensor_file(st_path, data, kind, rng):
  raw = open(st_path, "rb").read()
  if kind == "truncate":
    os.truncate(st_path, int(rng.integers(0, len(raw))))
    return
  if kind == "header_size":
    _with_header(st_path, b"", b"")  # rewrite with a size field larger than the file
    with open(st_path, "wb") as f:
      f.write(struct.pack("<Q", len(raw) + int(rng.integers(0, 2**40))) + raw[8:])
    return
  header, body = _header(st_path)
  name = sorted(k for k in header if k != "__metadata__")[int(rng.integers(0, len(header) - 1))]
  entry = header[name]
  if kind == "drop_dtype":
    del entry["dtype"]
  elif kind == "drop_shape":
    del entry["shape"]
  elif kind == "drop_data_offsets":
    del entry["data_offsets"]
  elif kind == "dtype":
    entry["dtype"] = data.draw(st.sampled_from(["I64", "I32", "U8", "BOOL", "F16", "F64",
                                                "Q4", 3, None, ["F32"]]))
  elif kind == "shape":
    entry["shape"] = data.draw(st.sampled_from([[-1], [1.5], "3", None, [True], [10**12],
                                                entry["shape"][::-1] + [1]]))
  elif kind == "data_offsets":
    lo, hi = entry["data_offsets"]
    entry["data_offsets"] = data.draw(st.sampled_from(
        [[hi, lo], [lo], [lo, hi, hi], [-8, hi - 8], [lo, hi + 10**9], [str(lo), hi],
         None, [lo + 0.5, hi]]))
  elif kind == "entry_list":
    header[name] = list(entry.values())
  elif kind == "shift":  # offsets moved past the end of the data
    n = entry["data_offsets"][1] - entry["data_offsets"][0]
    entry["data_offsets"] = [len(body) - n // 2, len(body) - n // 2 + n]
  _with_header(st_path, json.dumps(header).encode(), body)


def _corrupt_config(cfg_path, data):
  cfg = json.load(open(cfg_path))
  how = data.draw(st.sampled_from(["value", "drop", "text"]))
  if how == "text":
    text = data.draw(st.sampled_from(["", "[]", "null", "3", '"config"', json.dumps(cfg)[:-1],
                                      json.dumps([cfg]), "\ufeff" + json.dumps(cfg)]))
    open(cfg_path, "w").write(text)
    return
  key = data.draw(st.sampled_from(_CONFIG_KEYS))
  if how == "drop":
    cfg.pop(key, None)
  else:
    cfg[key] = data.draw(st.sampled_from(_BAD_VALUES))
  with open(cfg_path, "w") as f:
    f.write(json.dumps(cfg, allow_nan=True))


@fuzz(30)
@given(data=st.data(), sharded=st.booleans(),
       target=st.sampled_from(["tensors", "tensors", "config", "index"]),
       kind=st.sampled_from(["truncate", "truncate", "header_size", *_ENTRY_EDITS]))
def test_fuzz_corrupted_folders_raise_named_errors(saved, data, sharded, target, kind):
  """Any corruption of a saved folder either loads (a config change that is still a valid
  model of the same shapes) or raises a ValueError naming the corrupted file (a shape
  mismatch after a config change names the folder); never another exception."""
  COUNTS["cases"] += 1
  model, base = saved
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  with tempfile.TemporaryDirectory() as d:
    path = copy(base / ("sharded" if sharded else "one"), os.path.join(d, "m"))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if target == "index" and sharded:
      victim = os.path.join(path, "model.safetensors.index.json")
      doc = json.load(open(victim))
      wm = doc["weight_map"]
      name = sorted(wm)[int(rng.integers(0, len(wm)))]
      edit = data.draw(st.sampled_from(["value", "drop_map", "missing_file", "text"]))
      if edit == "value":
        wm[name] = data.draw(st.sampled_from([None, 3, "", "..", "/etc/passwd", "a/b", []]))
      elif edit == "drop_map":
        doc.pop("weight_map")
      elif edit == "missing_file":
        wm[name] = "model-00009-of-00009.safetensors"
      text = (data.draw(st.sampled_from(["[]", "{", "null", "\x00"])) if edit == "text"
              else json.dumps(doc))
      open(victim, "w").write(text)
    elif target == "config":
      victim = os.path.join(path, "config.json")
      _corrupt_config(victim, data)
    else:
      victim = os.path.join(path, files[int(rng.integers(0, len(files)))])
      _corrupt_tensor_file(victim, data, kind, rng)
    try:
      loaded = models.from_pretrained(path)
    except ValueError as e:
      where = victim if target != "config" else path
      assert where in str(e), f"{target}/{kind}: message does not name {where}: {e}"
      COUNTS["named"] += 1
      return
    # Only a config edit that keeps every shape may load; the weights are then intact.
    assert target == "config", f"{target}/{kind} loaded"
    for k, v in params(model).items():
      assert_bitwise_equal(params(loaded)[k], v, k)
    COUNTS["loaded"] += 1


@fuzz(4)
@given(arch=st.sampled_from(["llama", "qwen2", "qwen3"]),
       dtype=st.sampled_from(["float32", "bfloat16"]),
       shard_bytes=st.sampled_from([2**30, SHARD_BYTES]), seed=st.integers(0, 2**16))
def test_fuzz_round_trip_same_log_prob_bits(arch, dtype, shard_bytes, seed):
  """save -> load gives the same parameters and log-probs, bit for bit."""
  COUNTS["cases"] += 1
  model = tiny(arch, dtype, seed)
  with tempfile.TemporaryDirectory() as d:
    models.save_pretrained(model, d, max_shard_bytes=shard_bytes)
    again = models.from_pretrained(d)
    assert again.config == model.config and again.dtype == model.dtype
    a, b = params(model), params(again)
    for k in a:
      assert_bitwise_equal(b[k], a[k], k)
    lp = _logp(model, TOKENS)
    assert np.all(np.isfinite(np.asarray(lp)))
    assert_bitwise_equal(_logp(again, TOKENS), lp, f"{arch} {dtype} log-probs")
    COUNTS["agree"] += 1


def test_read_safetensors_unchanged_on_good_files(saved):
  model, base = saved
  arrays = hf.read_safetensors(base / "one" / "model.safetensors")
  assert arrays["model.embed_tokens.weight"].dtype == np.float32
  assert_bitwise_equal(np.asarray(arrays["model.embed_tokens.weight"]),
                       params(model)[("embed_tokens", "embedding")], "embedding")
  assert jax.tree.leaves(arrays)
