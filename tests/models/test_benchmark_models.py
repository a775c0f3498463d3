"""The benchmarks' model plumbing: the stock twin of a model is the same model on another
implementation (same parameters, same row chunks), so a results table measures what its
command line says."""

import importlib.util
import os

import jax
import numpy as np
from flax import nnx
from helpers import assert_bitwise_equal

from jaxrl_kernels import models

_ROLLOUT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "rollout.py")


def _rollout_module():
  spec = importlib.util.spec_from_file_location("rollout_benchmark", _ROLLOUT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_with_implementation_keeps_row_chunks_and_parameters():
  rollout = _rollout_module()
  for chunks in (1, 2, None):
    model = models.preset("qwen2.5-0.5b", jax.random.key(0), "float32", row_chunks=chunks,
                          num_hidden_layers=1, vocab_size=256, hidden_size=64,
                          intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    twin = rollout.with_implementation(model, "cpu")
    # None: the canonical chunks, whole 64-column tiles (q_dim 4 x 64 and 256 in 4 chunks).
    expect = (chunks, chunks) if chunks else (4, 4)
    assert twin.row_chunks == chunks and twin.row_parallel_chunks == expect
    assert twin.layers[0].self_attn.o_proj.chunks == expect[0]
    assert twin.layers[0].mlp.down_proj.chunks == expect[1]
    assert {layer.self_attn.implementation for layer in twin.layers} == {"cpu"}
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                              nnx.to_flat_state(nnx.state(twin, nnx.Param)), strict=True):
      assert_bitwise_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), f"{p}")
