"""Checkpoint round trips (safetensors, orbax), mismatch errors, orbax only where needed."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal

from jaxrl_kernels.nn import TinyCausalLM, TinyLMConfig, checkpoint


def _pair(**overrides):
  cfg = TinyLMConfig.preset("test", dtype="bfloat16", **overrides)
  return TinyCausalLM(cfg, rngs=nnx.Rngs(0)), TinyCausalLM(cfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("name", ["p.safetensors", "orbax_dir"])
def test_round_trip_gives_the_same_bits(tmp_path, name):
  src, dst = _pair()
  tok = jnp.arange(14).reshape(2, 7) % 64
  assert not np.array_equal(np.asarray(src(tok)), np.asarray(dst(tok)))  # different seeds
  checkpoint.save_params(src, tmp_path / name)
  assert checkpoint.load_params(dst, tmp_path / name) is dst
  assert_bitwise_equal(dst(tok), src(tok), "hidden states after loading")


def test_safetensors_file_layout(tmp_path):
  arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": np.asarray([1.5, -2.0], jnp.bfloat16)}
  checkpoint.save_safetensors(arrays, tmp_path / "x.safetensors")
  raw = (tmp_path / "x.safetensors").read_bytes()
  n = int.from_bytes(raw[:8], "little")
  assert (8 + n) % 8 == 0 and b'"BF16"' in raw[8:8 + n]
  back = checkpoint.load_safetensors(tmp_path / "x.safetensors")
  for k, v in arrays.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v)


def test_mismatches_are_listed_and_nothing_changes(tmp_path):
  src, _ = _pair()
  other = TinyCausalLM(TinyLMConfig.preset("test", dtype="bfloat16", mlp_dim=32),
                       rngs=nnx.Rngs(3))
  checkpoint.save_params(src, tmp_path / "p.safetensors")
  before = np.asarray(other.blocks[0].up.kernel[...])
  with pytest.raises(ValueError, match=r"up.kernel: checkpoint bfloat16\[32, 64\] vs model"):
    checkpoint.load_params(other, tmp_path / "p.safetensors")
  assert np.array_equal(np.asarray(other.blocks[0].up.kernel[...]), before)
  arrays = checkpoint.load_safetensors(tmp_path / "p.safetensors")
  arrays.pop("final_norm.weight")
  arrays["extra.w"] = np.zeros(2, np.float32)
  checkpoint.save_safetensors(arrays, tmp_path / "q.safetensors")
  with pytest.raises(ValueError, match=r"missing: \['final_norm.weight'\].*unexpected: "
                                       r"\['extra.w'\]"):
    checkpoint.load_params(src, tmp_path / "q.safetensors")
  with pytest.raises(FileNotFoundError):
    checkpoint.load_params(src, tmp_path / "nothing.safetensors")


def test_orbax_is_imported_only_for_orbax_folders(tmp_path, monkeypatch):
  src, dst = _pair()
  monkeypatch.setitem(sys.modules, "orbax", None)  # as if orbax-checkpoint were not installed
  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
  # *.safetensors needs no extra package.
  checkpoint.save_params(src, tmp_path / "p.safetensors")
  checkpoint.load_params(dst, tmp_path / "p.safetensors")
  with pytest.raises(ImportError, match=r"save_params: .*orbax-checkpoint package: pip install "
                                        r"'jaxrl_kernels\[orbax\]'"):
    checkpoint.save_params(src, tmp_path / "orbax_dir")
  with pytest.raises(ImportError, match=r"load_params: .*jaxrl_kernels\[orbax\]"):
    checkpoint.load_params(dst, tmp_path)  # an existing folder: read as orbax


def test_the_package_imports_without_orbax():
  code = ("import sys; sys.modules['orbax'] = None; import jaxrl_kernels, jaxrl_kernels.nn; "
          "import jaxrl_kernels.cli.parity, jaxrl_kernels.nn.checkpoint; print('ok')")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]
