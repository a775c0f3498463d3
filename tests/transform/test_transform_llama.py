"""batch_invariant on a Llama-style model written in plain jnp (llama_jnp.py), which
was not written for the library: batch invariance, decode == prefill, closeness to
the untransformed model, and gradients (CONTRACT.md section 1, "decode vs prefill")."""

import functools

import jax
import jax.numpy as jnp
import llama_jnp as L
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err

from jaxrl_kernels.transform import batch_invariant

# Prefill T = 12 tokens against a 40-slot cache: the key sums and the PV product
# run over 12 keys in the full forward and over 40 (28 of them zero) in decode.
T = 12


@functools.cache
def _setup(dtype: str):
  cfg = L.LlamaConfig(dtype=dtype)
  params = L.init(jax.random.key(0), cfg)
  tokens = jax.random.randint(jax.random.key(1), (5, T), 0, cfg.vocab)
  fwd = jax.jit(batch_invariant(functools.partial(L.forward, cfg=cfg)))
  return cfg, params, tokens, fwd, fwd(params, tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_batch_invariant(dtype):
  cfg, params, tokens, fwd, full = _setup(dtype)
  for r in (0, 2, 4):
    assert_bitwise_equal(fwd(params, tokens[r:r + 1])[0], full[r], f"row {r} at batch 1")
  # whatever the other rows hold
  other = tokens.at[:3].set(jax.random.randint(jax.random.key(2), (3, T), 0, cfg.vocab))
  assert_bitwise_equal(fwd(params, other)[3:], full[3:], "other rows changed")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_full_forward(dtype):
  cfg, params, tokens, _, full = _setup(dtype)
  dec = jax.jit(batch_invariant(functools.partial(L.decode_logits, cfg=cfg)))
  assert_bitwise_equal(dec(params, tokens), full, "one token at a time vs full forward")


def test_greedy_generation_scores_match_the_forward():
  # The sampler/trainer check: logits that chose each generated token equal the
  # training forward's logits on the generated sequence.
  cfg, params, tokens, fwd, _ = _setup("float32")
  gen = jax.jit(batch_invariant(functools.partial(L.generate, steps=5, cfg=cfg)))
  toks, logits = gen(params, tokens[:, :4])
  assert_bitwise_equal(fwd(params, toks[:, :-1]), logits, "generation vs forward")
  np.testing.assert_array_equal(toks[:, 4:], jnp.argmax(logits[:, 3:], -1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_close_to_the_untransformed_model(dtype):
  cfg, params, tokens, _, full = _setup(dtype)
  stock = L.forward(params, tokens, cfg)
  tol = 1e-4 if dtype == "float32" else TOL["bfloat16"][0]
  assert rel_err(full, stock) <= tol


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_gradient_matches_and_is_deterministic(dtype):
  cfg, params, tokens, _, _ = _setup(dtype)
  loss = functools.partial(L.loss, cfg=cfg)
  grad = jax.jit(jax.grad(batch_invariant(loss)))
  g1, g2 = grad(params, tokens), grad(params, tokens)
  ref = jax.grad(loss)(params, tokens)
  tol = 1e-4 if dtype == "float32" else TOL["bfloat16"][1]
  for a, b, r in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), jax.tree.leaves(ref)):
    assert_bitwise_equal(a, b, "run to run")
    assert rel_err(a.astype(jnp.float32), r.astype(jnp.float32)) <= tol
  # the forward inside the training step is the rollout forward (mode invariance)
  logits_in_grad = jax.jit(lambda p, t: jax.vjp(batch_invariant(
      functools.partial(L.forward, cfg=cfg)), p, t)[0])(params, tokens)
  assert_bitwise_equal(logits_in_grad, _setup(dtype)[4], "forward under vjp")
