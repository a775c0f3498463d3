"""Checkpoint round trips (safetensors, orbax) and mismatch errors."""

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
  before = np.asarray(other.blocks[0].up.kernel.value)
  with pytest.raises(ValueError, match=r"up.kernel: checkpoint bfloat16\[32, 64\] vs model"):
    checkpoint.load_params(other, tmp_path / "p.safetensors")
  assert np.array_equal(np.asarray(other.blocks[0].up.kernel.value), before)
  arrays = checkpoint.load_safetensors(tmp_path / "p.safetensors")
  arrays.pop("final_norm.scale")
  arrays["extra.w"] = np.zeros(2, np.float32)
  checkpoint.save_safetensors(arrays, tmp_path / "q.safetensors")
  with pytest.raises(ValueError, match=r"missing: \['final_norm.scale'\].*unexpected: "
                                       r"\['extra.w'\]"):
    checkpoint.load_params(src, tmp_path / "q.safetensors")
  with pytest.raises(FileNotFoundError):
    checkpoint.load_params(src, tmp_path / "nothing.safetensors")
