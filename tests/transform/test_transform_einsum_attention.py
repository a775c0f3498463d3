"""batch_invariant on attention written by hand (einsum scores, ``jnp.repeat`` GQA, a
causal mask, ``jax.nn.softmax``, einsum PV): the subgraph becomes ``causal_attention``
with the bits of calling it directly and of the ``jax.nn.dot_product_attention`` form,
gradients included; forms it cannot prove to be causal attention keep the equation by
equation rewrite, unchanged (jaxrl_kernels/transform/einsum_attention.py)."""

import functools
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, attention_inputs, bits, rel_err
from jax._src import config
from test_transform_attention import calls_library_attention

from jaxrl_kernels import causal_attention
from jaxrl_kernels.transform import batch_invariant, einsum_attention


def hand_attention(q, k, v, *, mask="tril", scale="div", fill=-jnp.inf, axis=-1,
                   softmax=jax.nn.softmax):
  """The Llama/Qwen form: q ``[B, T, N, D]``, k and v ``[B, S, K, D]``."""
  t, s, d = q.shape[1], k.shape[1], q.shape[3]
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d) if scale == "div" else scores * (1 / math.sqrt(d))
  rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  if isinstance(mask, str):
    mask = {"tril": lambda: jnp.tril(jnp.ones((t, s), bool)),
            "iota": lambda: rows + (s - t) >= cols,  # queries are the last t keys
            "window": lambda: (rows >= cols) & (rows - 2 <= cols),
            "none": lambda: None}[mask]()
  if mask is not None:
    scores = jnp.where(mask, scores, fill)
  probs = softmax(scores, axis=axis).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _sdpa(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _positions(b, t, s):
  return jnp.broadcast_to(s - t + jnp.arange(t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("dtype,hkv,mask,scale", [
    ("float32", 2, "tril", "div"),
    ("float32", 4, "iota", "mul"),
    ("bfloat16", 2, "iota", "div"),
    ("bfloat16", 4, "tril", "mul"),
])
def test_hand_written_attention_is_causal_attention(dtype, hkv, mask, scale):
  q, k, v = attention_inputs(0, 3, 7, 4, hkv, 16, dtype)
  f = functools.partial(hand_attention, mask=mask, scale=scale)
  g = batch_invariant(f, implementation="cpu")
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v).jaxpr) == 1
  out = jax.jit(g)(q, k, v)
  sdpa = jax.jit(batch_invariant(_sdpa, implementation="cpu"))(q, k, v)
  direct = causal_attention(q, k, v, q_positions=_positions(3, 7, 7), scale=0.25,
                            implementation="cpu")
  assert_bitwise_equal(out, sdpa, "einsum form vs dot_product_attention form")
  assert_bitwise_equal(out, direct, "einsum form vs causal_attention")
  assert rel_err(out, f(q, k, v)) <= TOL[dtype][0]


def test_queries_at_the_end_an_additive_mask_and_softmax_as_custom_jvp():
  q, _, _ = attention_inputs(0, 3, 2, 4, 2, 16, "float32")
  _, k, v = attention_inputs(1, 3, 9, 4, 2, 16, "float32")

  def f(q, k, v):  # an additive finfo.min mask, and the scale written after it
    t, s = q.shape[1], k.shape[1]
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    bias = jnp.where(jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :], 0.0,
                     jnp.finfo(jnp.float32).min)
    scores = (jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias) * 0.3
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

  with config.softmax_custom_jvp(True):
    g = batch_invariant(f)
    assert "custom_jvp_call" in str(jax.make_jaxpr(f)(q, k, v))
    assert calls_library_attention(jax.make_jaxpr(g)(q, k, v).jaxpr) == 1
    out = jax.jit(g)(q, k, v)
  direct = causal_attention(q, k, v, q_positions=_positions(3, 2, 9), scale=0.3)
  assert_bitwise_equal(out, direct, "einsum form vs causal_attention")
  assert rel_err(out, f(q, k, v)) <= 1e-5


_TRIL = np.tril(np.ones((7, 7), bool))


@pytest.mark.parametrize("form", ["triu_bias", "lengths", "closed_over"])
def test_other_causal_masks(form):
  q, k, v = attention_inputs(0, 3, 7, 4, 2, 16, "float32")
  lengths = jnp.array([7, 3, 5], jnp.int32)

  def f(q, k, v, n):
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    if form == "triu_bias":
      s = s + jnp.triu(jnp.full((7, 7), -jnp.inf), 1)
    elif form == "lengths":  # causal and per-sequence lengths, computed in the program
      keys = jnp.arange(7)[None, None, :]
      m = (jnp.arange(7)[None, :, None] >= keys) & (keys < n[:, None, None])
      s = jnp.where(m[:, None], s, -1e9)
    else:  # a NumPy mask captured as a constant
      s = jnp.where(_TRIL, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

  g = batch_invariant(f)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v, lengths).jaxpr) == 1
  pos = _positions(3, 7, 7)
  if form == "lengths":
    pos = jnp.minimum(pos, lengths[:, None] - 1)
  direct = causal_attention(q, k, v, q_positions=pos, scale=0.25)
  assert_bitwise_equal(jax.jit(g)(q, k, v, lengths), direct, f"{form} vs causal_attention")


def test_a_decode_step_against_a_cache():
  # One query at position `step` (traced) against a 12-slot cache, as llama_jnp decodes.
  q, _, _ = attention_inputs(0, 3, 1, 4, 2, 16, "float32")
  _, k, v = attention_inputs(1, 3, 12, 4, 2, 16, "float32")

  def f(q, k, v, step):
    mask = jnp.broadcast_to(jnp.arange(k.shape[1]) <= step, (3, 1, k.shape[1]))
    return hand_attention(q, k, v, mask=mask[:, None])

  g = batch_invariant(f)
  step = jnp.int32(6)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v, step).jaxpr) == 1
  out = jax.jit(g)(q, k, v, step)
  sdpa = jax.jit(batch_invariant(lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=jnp.full((3,), n + 1))))(q, k, v, step)
  direct = causal_attention(q, k, v, q_positions=jnp.full((3, 1), 6, jnp.int32))
  assert_bitwise_equal(out, sdpa, "decode: einsum form vs dot_product_attention form")
  assert_bitwise_equal(out, direct, "decode: einsum form vs causal_attention")
  assert rel_err(out, f(q, k, v, step)) <= 1e-5


def test_interpret_kernels():
  q, k, v = attention_inputs(0, 2, 5, 4, 2, 16, "float32")
  g = batch_invariant(hand_attention, implementation="interpret")
  out = jax.jit(g)(q, k, v)
  direct = causal_attention(q, k, v, q_positions=_positions(2, 5, 5), scale=0.25,
                            implementation="interpret")
  assert_bitwise_equal(out, direct, "interpret: einsum form vs causal_attention")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_equal_the_dot_product_attention_form(dtype):
  q, k, v = attention_inputs(0, 3, 7, 4, 2, 16, dtype)
  ct = jax.random.normal(jax.random.key(9), q.shape).astype(dtype)

  def grads(f):
    loss = lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  mine = grads(batch_invariant(hand_attention, implementation="cpu"))
  ref = grads(batch_invariant(_sdpa, implementation="cpu"))
  stock = jax.grad(lambda q, k, v: jnp.sum((hand_attention(q, k, v) * ct).astype(jnp.float32)),
                   argnums=(0, 1, 2))(q, k, v)
  for name, a, b, s in zip("qkv", mine, ref, stock):
    assert_bitwise_equal(a, b, f"d{name}: einsum form vs dot_product_attention form")
    assert rel_err(a.astype(jnp.float32), s.astype(jnp.float32)) <= TOL[dtype][1]


def _softmax_without_max(x, axis):
  e = jnp.exp(x)
  return e / jnp.sum(e, axis=axis, keepdims=True)


@pytest.mark.parametrize("case", ["data_mask", "query_axis_softmax", "no_max", "window"])
def test_forms_that_are_not_provably_causal_attention_are_left_alone(case):
  q, k, v = attention_inputs(0, 3, 7, 4, 2, 16, "float32")
  data_mask = jax.random.bernoulli(jax.random.key(5), 0.7, (7, 7)).at[:, 0].set(True)
  f = {
      "data_mask": lambda q, k, v, m: hand_attention(q, k, v, mask=m),
      "query_axis_softmax": lambda q, k, v, m: hand_attention(q, k, v, mask="none", axis=-2),
      "no_max": lambda q, k, v, m: hand_attention(q, k, v, softmax=_softmax_without_max),
      "window": lambda q, k, v, m: hand_attention(q, k, v, mask="window"),
  }[case]
  g = batch_invariant(f)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v, data_mask).jaxpr) == 0
  out = jax.jit(g)(q, k, v, data_mask)
  with mock.patch.object(einsum_attention, "find", return_value={}):  # the rewrite without it
    old = jax.jit(batch_invariant(f))(q, k, v, data_mask)
  assert_bitwise_equal(out, old, "the equation by equation rewrite")
  assert rel_err(out, f(q, k, v, data_mask)) <= 1e-5


def _keys_repeated(q, k, v, m):
  """``[BH, T, D]`` attention whose K and V are repeated along the keys, not the heads."""
  del m
  k, v = jnp.repeat(k[:, :4, 0], 2, axis=1), jnp.repeat(v[:, :4, 0], 2, axis=1)  # 8 keys
  q = q[:, :, 0]
  scores = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
  scores = jnp.where(jnp.tril(jnp.ones((7, 8), bool)), scores, -jnp.inf)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)


def _scaled_fill(q, k, v, m):  # the fill -1e9 scaled to -1 after the mask: not a mask
  del m
  k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  scores = jnp.where(jnp.tril(jnp.ones((7, 7), bool)), scores, -1e9) * 1e-9
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("f", [_keys_repeated, _scaled_fill], ids=["keys_repeated",
                                                                    "scaled_fill"])
def test_more_forms_that_are_left_alone(f):
  """A repeat along the keys (not the heads) and a finite fill scaled above -1e9 after the
  mask: recognising either would give other values than the stock form."""
  q, k, v = attention_inputs(0, 3, 7, 4, 2, 16, "float32")
  g = batch_invariant(f)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v, None).jaxpr) == 0
  out = jax.jit(g)(q, k, v, None)
  with mock.patch.object(einsum_attention, "find", return_value={}):
    old = jax.jit(batch_invariant(f))(q, k, v, None)
  assert_bitwise_equal(out, old, "the equation by equation rewrite")
  assert rel_err(out, f(q, k, v, None)) <= 1e-5


def test_a_repeated_kv_read_elsewhere_stays_computed():
  """The repeated K is also an output: the attention is replaced, the repeat is kept."""
  q, k, v = attention_inputs(0, 3, 7, 4, 2, 16, "float32")

  def f(q, k, v):
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / 4.0
    scores = jnp.where(jnp.tril(jnp.ones((7, 7), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), vr), kr

  g = batch_invariant(f, implementation="cpu")
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v).jaxpr) == 1
  out, kr = jax.jit(g)(q, k, v)
  assert_bitwise_equal(kr, jnp.repeat(k, 2, axis=2), "the repeated K")
  assert rel_err(out, f(q, k, v)[0]) <= 1e-5
  sdpa = jax.jit(batch_invariant(_sdpa, implementation="cpu"))(q, k, v)
  assert_bitwise_equal(out, sdpa, "einsum form vs dot_product_attention form")


def test_rows_are_batch_invariant_and_the_stock_form_is_not():
  # At [8, 33, 4 heads over 2, 32] the stock einsum form's row 0 alone differs from row 0
  # of the batch on the CPU (XLA's products and sums follow the batch shape).
  q, k, v = attention_inputs(0, 8, 33, 4, 2, 32, "float32")
  q = q * 2.0 ** (jnp.arange(33) % 10 - 5.0)[None, :, None, None]
  g = jax.jit(batch_invariant(hand_attention))
  full = g(q, k, v)
  for r in (0, 3, 7):
    assert_bitwise_equal(g(q[r:r + 1], k[r:r + 1], v[r:r + 1])[0], full[r], f"row {r}")
  stock = jax.jit(hand_attention)
  ref = stock(q, k, v)
  assert any(not np.array_equal(bits(stock(q[r:r + 1], k[r:r + 1], v[r:r + 1])[0]),
                                bits(ref[r])) for r in range(8)), "control: stock is invariant"
