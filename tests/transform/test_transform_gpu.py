"""batch_invariant on the GPU: the plain-jnp Llama model's rows, decode == prefill and
gradients, and the control: the untransformed model breaks batch or decode invariance."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import llama_jnp as L
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err
from test_transform_attention import calls_library_attention

from jaxrl_kernels.transform import batch_invariant

# Shapes large enough that XLA's GPU GEMM and reduction choices change with the
# batch (M = 1 vs 5 * 48 rows) and the key count (48 vs 160).
CFG = {"vocab": 1000, "dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "ffn": 512,
       "max_len": 160}
T = 48


def _setup(dtype, attention="einsum"):
  cfg = L.LlamaConfig(dtype=dtype, attention=attention, **CFG)
  params = L.init(jax.random.key(0), cfg)
  tokens = jax.random.randint(jax.random.key(1), (5, T), 0, cfg.vocab)
  return cfg, params, tokens


def _invariances(forward, decode, params, tokens):
  full = np.asarray(forward(params, tokens))
  rows_ok = all(np.array_equal(bits(forward(params, tokens[r:r + 1])[0]), bits(full[r]))
                for r in (0, 2, 4))
  decode_ok = np.array_equal(bits(decode(params, tokens)), bits(full))
  return full, rows_ok, decode_ok


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformed_llama_is_invariant_on_gpu(dtype):
  cfg, params, tokens = _setup(dtype)
  fwd = jax.jit(batch_invariant(functools.partial(L.forward, cfg=cfg)))
  dec = jax.jit(batch_invariant(functools.partial(L.decode_logits, cfg=cfg)))
  full, rows_ok, decode_ok = _invariances(fwd, dec, params, tokens)
  assert rows_ok, "a row changed with the batch"
  assert decode_ok, "decode differs from the full forward"
  other = tokens.at[:2].set(0)
  assert_bitwise_equal(fwd(params, other)[2:], full[2:], "other rows changed")
  stock = L.forward(params, tokens, cfg)
  # fp32: the stock GPU path may run TF32 products; the transformed one runs 3xTF32
  tol = 1e-3 if dtype == "float32" else TOL["bfloat16"][0]
  assert rel_err(full, stock) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["einsum", "sdpa"])
def test_untransformed_llama_fails_on_gpu_control(attention):
  cfg, params, tokens = _setup("bfloat16", attention)
  fwd = jax.jit(functools.partial(L.forward, cfg=cfg))
  dec = jax.jit(functools.partial(L.decode_logits, cfg=cfg))
  _, rows_ok, decode_ok = _invariances(fwd, dec, params, tokens)
  assert not (rows_ok and decode_ok), "the stock model was invariant: the control shows nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformed_llama_gradient_on_gpu(dtype):
  cfg, params, tokens = _setup(dtype)
  loss = functools.partial(L.loss, cfg=cfg)
  grad = jax.jit(jax.grad(batch_invariant(loss)))
  first = grad(params, tokens)
  ref = jax.grad(loss)(params, tokens)
  tol = 1e-2 if dtype == "float32" else TOL["bfloat16"][1]
  for _ in range(5):
    for a, b in zip(jax.tree.leaves(grad(params, tokens)), jax.tree.leaves(first)):
      assert_bitwise_equal(a, b, "run to run")
  for a, r in zip(jax.tree.leaves(first), jax.tree.leaves(ref)):
    assert rel_err(a.astype(jnp.float32), r.astype(jnp.float32)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "cudnn"])
def test_transformed_sdpa_llama_runs_the_library_attention_on_gpu(attention):
  # jax.nn.dot_product_attention (XLA or cuDNN form) becomes causal_attention: rows
  # batch-invariant, decode (key_value_seq_lengths against the cache) == prefill.
  cfg, params, tokens = _setup("bfloat16", attention)
  fwd = jax.jit(batch_invariant(functools.partial(L.forward, cfg=cfg)))
  dec = jax.jit(batch_invariant(functools.partial(L.decode_logits, cfg=cfg)))
  text = jax.make_jaxpr(fwd)(params, tokens)
  assert calls_library_attention(text.jaxpr) == cfg.n_layers
  assert "dot_product_attention_fwd_wrapper" not in str(text)
  full, rows_ok, decode_ok = _invariances(fwd, dec, params, tokens)
  assert rows_ok, "a row changed with the batch"
  assert decode_ok, "decode differs from the full forward"
  stock = L.forward(params, tokens, dataclasses.replace(cfg, attention="sdpa"))
  assert rel_err(full, stock) <= TOL["bfloat16"][0]
  grad = jax.jit(jax.grad(batch_invariant(functools.partial(L.loss, cfg=cfg))))
  first = grad(params, tokens)
  for a, b in zip(jax.tree.leaves(grad(params, tokens)), jax.tree.leaves(first)):
    assert_bitwise_equal(a, b, "run to run")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["llama_jnp:build", "llama_jnp:build_sdpa"])
def test_model_fn_parity_report_is_bitwise_on_gpu(spec, capsys):
  from jaxrl_kernels.cli import model_fn

  assert model_fn.parity_report(spec, batch=4, prompt_len=8, new_tokens=8), (
      capsys.readouterr().out)
