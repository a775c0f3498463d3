"""batch_invariant on a model built from a third-party package (flax.nnx layers, with
nnx's own attention and KV cache): rows batch-invariant, decode == full forward."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_bitwise_equal, rel_err

from jaxrl_kernels.transform import batch_invariant

nnx = pytest.importorskip("flax.nnx", reason="flax.nnx is not installed")

V, D, HEADS, T, MAX_LEN = 50, 32, 4, 10, 24


class TinyNNXLM(nnx.Module):
  def __init__(self, rngs, *, decode: bool):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=decode,
                                       rngs=rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, mask=None):
    x = self.embed(tokens)
    x = x + self.attn(self.norm(x), mask=mask)
    x = x + jax.nn.gelu(self.mlp(x))
    return self.head(x)


def _models():
  full = TinyNNXLM(nnx.Rngs(0), decode=False)
  dec = TinyNNXLM(nnx.Rngs(0), decode=True)
  return full, dec


def _forward(model):
  graphdef, state = nnx.split(model)

  def fwd(state, tokens):
    return nnx.merge(graphdef, state)(tokens, mask=nnx.make_causal_mask(tokens))

  return fwd, state


def test_nnx_model_rows_are_batch_invariant_and_close():
  full, _ = _models()
  fwd, state = _forward(full)
  tokens = jax.random.randint(jax.random.key(1), (4, T), 0, V)
  f = jax.jit(batch_invariant(fwd))
  out = f(state, tokens)
  assert rel_err(out, fwd(state, tokens)) <= 1e-4
  for r in (0, 3):
    assert_bitwise_equal(f(state, tokens[r:r + 1])[0], out[r], f"row {r} alone")


def test_nnx_decode_equals_full_forward():
  full, dec = _models()
  fwd, state = _forward(full)
  tokens = jax.random.randint(jax.random.key(2), (3, T), 0, V)
  expected = jax.jit(batch_invariant(fwd))(state, tokens)
  dec.attn.init_cache((3, MAX_LEN, D))
  graphdef, dstate = nnx.split(dec)

  def step(dstate, token):
    model = nnx.merge(graphdef, dstate)
    logits = model(token[:, None])[:, 0]
    return nnx.state(model), logits

  step = jax.jit(batch_invariant(step))
  outs = []
  for t in range(T):
    dstate, logits = step(dstate, tokens[:, t])
    outs.append(logits)
  assert_bitwise_equal(jnp.stack(outs, 1), expected, "nnx decode vs full forward")
