"""batch_invariant on ``jax.nn.dot_product_attention``: the call becomes the library's
``causal_attention`` where its arguments fit (causal or full mask, sequence lengths, GQA,
scale) and the rewritten einsum + softmax form otherwise; jax's cuDNN form (a
``custom_vjp_call`` of the cuDNN custom call) is matched in the jaxpr the same way."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import llama_jnp as L
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, attention_inputs, rel_err

from jaxrl_kernels import causal_attention
from jaxrl_kernels.transform import batch_invariant

T = 12


def _name(eqn) -> str:
  """A call's name: its ``name`` parameter, or its function's (custom_vjp_call)."""
  call = eqn.params.get("call_jaxpr")
  info = getattr(getattr(call, "jaxpr", None), "debug_info", None)
  return str(eqn.params.get("name", getattr(info, "func_name", "")))


def _library_op(eqn) -> bool:
  """A custom_vjp function of the library's ops (det_matmul, det_sum, causal_attention)."""
  call = eqn.params.get("call_jaxpr")
  where = str(getattr(getattr(getattr(call, "jaxpr", None), "debug_info", None),
                      "func_src_info", ""))
  return (eqn.primitive.name == "custom_vjp_call" and "jaxrl_kernels" in where
          and "transform" not in where)


def _names(jaxpr, out=None):
  """Every (primitive, name) at every depth, the library ops' insides not entered."""
  out = [] if out is None else out
  for eqn in jaxpr.eqns:
    out.append((eqn.primitive.name, _name(eqn)))
    if _library_op(eqn):
      continue
    for v in eqn.params.values():
      for sub in v if isinstance(v, tuple) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _names(sub.jaxpr, out)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _names(sub, out)
  return out


def _top_names(jaxpr):
  return [(e.primitive.name, _name(e)) for e in jaxpr.eqns]


@functools.cache
def _library_attention_name() -> str:
  """The name of causal_attention's custom_vjp function, as a jaxpr shows it."""
  q = jnp.ones((1, 2, 2, 16))
  names = _top_names(jax.make_jaxpr(lambda q: causal_attention(q, q, q))(q).jaxpr)
  (name,) = {n for p, n in names if p == "custom_vjp_call"}
  return name


def calls_library_attention(jaxpr) -> int:
  return sum(1 for p, n in _names(jaxpr) if p == "custom_vjp_call"
             and n == _library_attention_name())


@functools.cache
def _setup(dtype: str):
  cfg = L.LlamaConfig(dtype=dtype, attention="sdpa", n_layers=1)
  params = L.init(jax.random.key(0), cfg)
  tokens = jax.random.randint(jax.random.key(1), (5, T), 0, cfg.vocab)
  fwd = jax.jit(batch_invariant(functools.partial(L.forward, cfg=cfg)))
  return cfg, params, tokens, fwd, fwd(params, tokens)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_sdpa_model_is_batch_invariant_and_decode_equals_prefill(dtype):
  cfg, params, tokens, fwd, full = _setup(dtype)
  jaxpr = jax.make_jaxpr(batch_invariant(functools.partial(L.forward, cfg=cfg)))(params, tokens)
  assert calls_library_attention(jaxpr.jaxpr) == cfg.n_layers
  for r in (0, 4):
    assert_bitwise_equal(fwd(params, tokens[r:r + 1])[0], full[r], f"row {r} at batch 1")
  other = tokens.at[:3].set(jax.random.randint(jax.random.key(2), (3, T), 0, cfg.vocab))
  assert_bitwise_equal(fwd(params, other)[3:], full[3:], "other rows changed")
  # decode: one query against the zero-padded 40-slot cache with key_value_seq_lengths
  dec = jax.jit(batch_invariant(functools.partial(L.decode_logits, cfg=cfg)))
  assert_bitwise_equal(dec(params, tokens), full, "decode vs prefill")
  stock = L.forward(params, tokens, cfg)
  tol = 1e-5 if dtype == "float32" else TOL["bfloat16"][0]
  assert rel_err(full, stock) <= tol
  # The stock model's control (decode != prefill) is on the GPU (test_transform_gpu.py):
  # with the suite's CPU flags XLA's sums over 12 and 40 keys happen to agree here.


@pytest.mark.slow
def test_sdpa_model_gradient_matches_and_is_deterministic():
  cfg, params, tokens, _, _ = _setup("float32")
  loss = functools.partial(L.loss, cfg=cfg)
  grad = jax.jit(jax.grad(batch_invariant(loss)))
  g1, g2 = grad(params, tokens), grad(params, tokens)
  ref = jax.grad(loss)(params, tokens)
  for a, b, r in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), jax.tree.leaves(ref)):
    assert_bitwise_equal(a, b, "run to run")
    assert rel_err(a, r) <= 1e-4


def _sdpa_inputs(b=3, t=7, s=7, hq=4, hkv=2, d=16, dtype="float32"):
  q, _, _ = attention_inputs(0, b, t, hq, hkv, d, dtype)
  _, k, v = attention_inputs(1, b, s, hq, hkv, d, dtype)
  return q, k, v


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True, key_value_seq_lengths=np.array([7, 3, 1], np.int32)),
    dict(is_causal=False, scale=0.3, key_value_seq_lengths=np.array([2, 7, 5], np.int32),
         query_seq_lengths=np.array([7, 4, 1], np.int32)),
])
def test_fitting_calls_run_the_library_attention(kwargs):
  q, k, v = _sdpa_inputs()
  lens = {n: jnp.asarray(x) for n, x in kwargs.items() if n.endswith("lengths")}
  static = {n: x for n, x in kwargs.items() if not n.endswith("lengths")}

  def f(q, k, v, lens):
    return jax.nn.dot_product_attention(q, k, v, **static, **lens)

  g = batch_invariant(f)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v, lens).jaxpr) == 1
  out = jax.jit(g)(q, k, v, lens)
  assert rel_err(out, f(q, k, v, lens)) <= 1e-5
  # a row alone gives the same bits
  one = {n: x[1:2] for n, x in lens.items()}
  assert_bitwise_equal(jax.jit(g)(q[1:2], k[1:2], v[1:2], one)[0], out[1], "row alone")
  # the stock function is back once the trace is over
  assert "jaxrl_kernels" not in jax.nn.dot_product_attention.__code__.co_filename


@pytest.mark.parametrize("case", ["bias", "mask", "window", "residual"])
def test_calls_that_do_not_fit_take_the_rewritten_einsum_form(case):
  q, k, v = _sdpa_inputs(s=7)
  bias = jax.random.normal(jax.random.key(3), (1, 4, 7, 7))
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (1, 1, 7, 7)).at[..., 0].set(True)
  call = {
      "bias": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, is_causal=True),
      "mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask),
      "window": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, local_window_size=2),
      "residual": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, return_residual=True)[0],
  }[case]
  g = batch_invariant(call)
  names = _names(jax.make_jaxpr(g)(q, k, v).jaxpr)
  assert not any(n == _library_attention_name() for _, n in names)
  assert not any(p in ("dot_general", "reduce_sum") for p, _ in names), names
  out = jax.jit(g)(q, k, v)
  assert rel_err(out, call(q, k, v)) <= 1e-5
  assert_bitwise_equal(jax.jit(g)(q[2:], k[2:], v[2:])[0], out[2], "row alone (fallback)")


def test_a_call_inside_vmap_falls_back_to_the_rewritten_body_and_tnh_fits():
  q, k, v = _sdpa_inputs()
  sdpa = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  f = lambda q, k, v: jax.vmap(sdpa)(q, k, v)  # [T, N, H] rows under vmap: the fallback
  g = batch_invariant(f)
  assert calls_library_attention(jax.make_jaxpr(g)(q, k, v).jaxpr) == 0
  out = jax.jit(g)(q, k, v)
  assert rel_err(out, f(q, k, v)) <= 1e-5
  assert_bitwise_equal(jax.jit(g)(q[:1], k[:1], v[:1])[0], out[0], "row alone")
  one = batch_invariant(sdpa)  # one [T, N, H] call: a batch of one for causal_attention
  assert calls_library_attention(jax.make_jaxpr(one)(q[1], k[1], v[1]).jaxpr) == 1
  assert rel_err(jax.jit(one)(q[1], k[1], v[1]), sdpa(q[1], k[1], v[1])) <= 1e-5
  # A reference taken before the trace is the stock function: its XLA form, rewritten.
  bound = functools.partial(jax.nn.dot_product_attention, is_causal=True)
  assert calls_library_attention(jax.make_jaxpr(batch_invariant(bound))(q, k, v).jaxpr) == 0


def _cudnn(fn):
  """``fn`` traced as on a GPU with cuDNN 9.10: jax's cuDNN attention builds its
  jaxpr (a custom_vjp_call of the cuDNN custom call) without running anything."""
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  if not hasattr(fa, "check_cudnn_version"):
    pytest.skip("this jax has no cuDNN attention module to trace")

  @functools.wraps(fn)
  def traced(*args):
    with mock.patch.object(fa, "check_cudnn_version", lambda: 91000):
      return fn(*args)
  return traced


@pytest.mark.parametrize("layout", ["BTNH", pytest.param("BNTH", marks=pytest.mark.slow)])
def test_cudnn_form_is_matched_in_the_jaxpr(layout):
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  q, k, v = _sdpa_inputs(d=64, dtype="bfloat16")
  lens = jnp.array([7, 3, 5], jnp.int32)
  swap = (lambda x: jnp.swapaxes(x, 1, 2)) if layout == "BNTH" else (lambda x: x)

  def f(q, k, v, lens):  # jax.nn's cuDNN path, called below the public function
    out = fa.dot_product_attention(
        swap(q), swap(k), swap(v), q_seqlen=jnp.full((3,), 7, jnp.int32), kv_seqlen=lens,
        scale=0.25, mask_type=fa.MaskType.PADDING_CAUSAL, qkv_layout=layout)
    return swap(out)

  g = _cudnn(batch_invariant(f))
  jaxpr = jax.make_jaxpr(g)(q, k, v, lens).jaxpr
  assert any(n == _library_attention_name() for _, n in _names(jaxpr))
  assert not any(p == "dot_product_attention_fwd_wrapper" for p, _ in _names(jaxpr))
  out = jax.jit(g)(q, k, v, lens)
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                     key_value_seq_lengths=lens, implementation="xla")
  assert rel_err(out, ref) <= TOL["bfloat16"][0]
  # and the public function with implementation="cudnn" (intercepted before the cuDNN call)
  h = _cudnn(batch_invariant(lambda q, k, v, lens: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, scale=0.25, key_value_seq_lengths=lens, implementation="cudnn")))
  assert_bitwise_equal(jax.jit(h)(q, k, v, lens), out, "jax.nn cudnn call vs its cuDNN form")


@pytest.mark.slow
def test_cudnn_form_gradient_runs_the_library_attention_backward():
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  q, k, v = _sdpa_inputs(d=64, dtype="bfloat16")
  lens = jnp.array([7, 3, 5], jnp.int32)

  def f(q, k, v):
    return fa.dot_product_attention(
        q, k, v, q_seqlen=jnp.full((3,), 7, jnp.int32), kv_seqlen=lens, scale=0.25,
        mask_type=fa.MaskType.PADDING_CAUSAL)

  def ref(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                        key_value_seq_lengths=lens)

  loss = lambda g: lambda q, k, v: jnp.sum(g(q, k, v).astype(jnp.float32) ** 2)
  grads = jax.jit(jax.grad(loss(_cudnn(batch_invariant(f))), argnums=(0, 1, 2)))
  first = grads(q, k, v)
  expected = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for a, b, r in zip(first, grads(q, k, v), expected):
    assert_bitwise_equal(a, b, "run to run")
    assert rel_err(a.astype(jnp.float32), r.astype(jnp.float32)) <= TOL["bfloat16"][1]


@pytest.mark.slow
def test_cudnn_form_with_a_bias_takes_the_rewritten_xla_form():
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  q, k, v = _sdpa_inputs(t=8, s=8, d=64, dtype="bfloat16")
  bias = jax.random.normal(jax.random.key(5), (3, 4, 8, 8)).astype("bfloat16")

  def f(q, k, v, bias):
    return fa.dot_product_attention(q, k, v, bias, scale=0.25, mask_type=fa.MaskType.CAUSAL)

  g = _cudnn(batch_invariant(f))
  names = _names(jax.make_jaxpr(g)(q, k, v, bias).jaxpr)
  assert not any(p in ("dot_product_attention_fwd_wrapper", "dot_general", "reduce_sum")
                 for p, _ in names), names
  out = jax.jit(g)(q, k, v, bias)
  ref = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True, scale=0.25)
  assert rel_err(out, ref) <= TOL["bfloat16"][0]
  assert_bitwise_equal(jax.jit(g)(q[1:2], k[1:2], v[1:2], bias[1:2])[0], out[1], "row alone")


def test_cudnn_form_with_dropout_is_refused_loudly():
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  q, k, v = _sdpa_inputs(t=8, s=8, d=64, dtype="bfloat16")

  def f(q, k, v):
    return fa.dot_product_attention(q, k, v, scale=0.25, mask_type=fa.MaskType.CAUSAL,
                                    dropout_rate=0.1)

  with pytest.raises(NotImplementedError, match=r"custom_vjp_call \(cuDNN attention with "
                                                r"dropout.*test_transform_attention.py:\d+"):
    jax.make_jaxpr(_cudnn(batch_invariant(f)))(q, k, v)
