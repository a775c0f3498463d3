"""batch_invariant: each rewrite against the stock op, the invariances it buys, recursion
into inner jaxprs, composition with jit/grad/vmap/remat, and loud failure."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, rel_err, wide_rows
from jax import lax

import jaxrl_kernels.transform as tr
from jaxrl_kernels import det_matmul
from jaxrl_kernels.transform import batch_invariant

# custom_vjp functions of det_matmul and det_sum: their insides are the fixed-order kernels.
LIBRARY_OPS = ("_det_matmul2d", "_reduce2d")


def _close(out, expected, tol=1e-5):
  assert rel_err(out, np.asarray(expected, np.float64)) <= tol


@pytest.mark.parametrize("spec,shapes", [
    ("mk,kn->mn", [(5, 40), (40, 7)]),
    ("nk,mk->mn", [(7, 40), (5, 40)]),          # weight first: the operand with fewer free dims
    ("bmk,bnk->bmn", [(3, 5, 40), (3, 7, 40)]),  # attention scores
    ("bhts,bshd->bthd", [(2, 3, 4, 9), (2, 9, 3, 8)]),  # attention PV
    ("kbm,nk->bmn", [(40, 2, 3), (7, 40)]),      # contraction in front
    ("abk,kc->abc", [(2, 3, 33), (33, 4)]),
])
def test_dot_general_forms_match_stock(spec, shapes):
  keys = jax.random.split(jax.random.key(0), len(shapes))
  ops = [jax.random.normal(k, s) for k, s in zip(keys, shapes)]
  f = lambda *o: jnp.einsum(spec, *o, precision="highest")
  _close(jax.jit(batch_invariant(f))(*ops), f(*ops))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dot_general_low_precision_and_preferred_type(dtype):
  a = jax.random.normal(jax.random.key(1), (6, 70)).astype(dtype)
  b = jax.random.normal(jax.random.key(2), (70, 5)).astype(dtype)
  f = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
  out = batch_invariant(f)(a, b)
  assert out.dtype == jnp.float32
  _close(out, np.float64(a) @ np.float64(b), 1e-6)
  out16 = batch_invariant(lambda a, b: a @ b)(a, b)
  assert out16.dtype == jnp.dtype(dtype)


def test_integer_dot_is_left_alone():
  a = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
  f = batch_invariant(lambda a: a @ a.T)
  assert f(a).dtype == jnp.int32
  np.testing.assert_array_equal(f(a), a @ a.T)
  jaxpr = jax.make_jaxpr(f)(a)
  assert "dot_general" in str(jaxpr) and "pallas_call" not in str(jaxpr)


def test_batched_product_rows_and_key_padding_are_bitwise():
  # Attention scores and PV: a query row alone, and keys zero-padded past T.
  q = wide_rows(jax.random.key(3), 2 * 13, 16, "float32").reshape(2, 13, 16)
  k = jax.random.normal(jax.random.key(4), (2, 13, 16))
  qk = jax.jit(batch_invariant(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k)))
  full = qk(q, k)
  kpad = jnp.pad(k, ((0, 0), (0, 27), (0, 0)))
  assert_bitwise_equal(qk(q[:, 6:7], kpad)[:, 0, :13], full[:, 6], "decode row vs prefill")
  p = jax.nn.softmax(full, -1)
  pv = jax.jit(batch_invariant(lambda p, v: jnp.einsum("bqk,bkd->bqd", p, v)))
  out = pv(p, k)
  ppad = jnp.pad(p[:, 6:7], ((0, 0), (0, 0), (0, 27)))
  assert_bitwise_equal(pv(ppad, kpad)[:, 0], out[:, 6], "PV with zero-padded keys")


_W = jax.random.normal(jax.random.key(7), (2, 32, 32))


def _single_head(x, wq, wk):
  return (x @ wq) @ jnp.swapaxes(x @ wk, -1, -2)


@pytest.mark.parametrize("fn", [
    pytest.param(lambda q, k: q @ jnp.swapaxes(k, -1, -2), id="inputs"),
    pytest.param(lambda q, k: _single_head(q + k, _W[0], _W[1]), id="computed"),
])
def test_activation_products_take_one_path_when_matmul_squeezes_the_batch(fn):
  # jnp.matmul drops batch dims that are 1 on both sides: at batch 1 `q @ k.T` has no
  # batch dim left and looks like `x @ W`; it must take the batched products' path there.
  q = wide_rows(jax.random.key(5), 8 * 16, 32, "float32").reshape(8, 16, 32)
  k = wide_rows(jax.random.key(6), 8 * 16, 32, "float32").reshape(8, 16, 32)
  f = jax.jit(batch_invariant(fn))
  full = f(q, k)
  for b in (1, 3):
    assert_bitwise_equal(f(q[:b], k[:b])[0], full[0], f"row 0 at batch {b}")


@pytest.mark.parametrize("impl,dtype", [("interpret", "float32"), ("interpret", "bfloat16"),
                                        ("cpu", "float32"), ("cpu", "bfloat16")])
def test_det_matmul_zero_padding_in_k_keeps_bits(impl, dtype):
  # The decode == prefill claim rests on this: K zero-padded to a longer length
  # (a multiple of the K tile, and beyond) gives the same bits.
  a = wide_rows(jax.random.key(5), 9, 45, dtype)
  b = jax.random.normal(jax.random.key(6), (45, 24)).astype(dtype)
  base = det_matmul(a, b, out_dtype=jnp.float32, implementation=impl)
  for extra in (19, 83):  # to 64 (one tile) and past it
    ap = jnp.pad(a, ((0, 0), (0, extra)))
    bp = jnp.pad(b, ((0, extra), (0, 0)))
    try:
      out = det_matmul(ap, bp, out_dtype=jnp.float32, implementation=impl)
    except ValueError as e:  # an implementation that does not exist here
      pytest.skip(str(e))
    if impl == "cpu" and not np.array_equal(np.asarray(out), np.asarray(base)):
      pytest.xfail("the 'cpu' GEMM's blocking follows K: batch_invariant runs products "
                   "whose K varies (batched products) on det_sum instead")
    assert_bitwise_equal(out, base, f"K padded by {extra}")


def test_reductions_are_rewritten_and_invariant():
  x = wide_rows(jax.random.key(7), 6, 300, "float32")

  def f(x):
    return (jnp.mean(x, -1), jax.nn.logsumexp(x / 1e3, -1), jax.nn.log_softmax(x / 1e3)[:, 3],
            jnp.cumsum(x, -1)[:, -1], jnp.argmax(x, -1), jnp.prod(1 + x[:, :5] * 1e-4, -1))

  g = jax.jit(batch_invariant(f))
  outs = g(x)
  for o, e in zip(outs, f(np.float64(x))):
    if o.dtype == jnp.int32:
      np.testing.assert_array_equal(o, e)
    else:
      _close(o, e, 1e-5)
  alone = g(x[4:5])
  padded = g(jnp.pad(x, ((0, 0), (0, 200)))[:, :300])
  for o, a, p in zip(outs, alone, padded):
    assert_bitwise_equal(a[0], o[4], "row alone")
    assert_bitwise_equal(p, o, "sliced from a padded array")
  text = str(jax.make_jaxpr(batch_invariant(f))(x))
  assert "reduce_sum" not in text.replace("reduce_sum_p", "") or "pallas" in text


def test_library_kernel_calls_keep_their_bits():
  """The library's own ops inside a transformed function (det_matmul, causal_attention
  forward and backward, det_sum) are bound as they are: the transformed function and its
  gradient give the untransformed bits (before, the attention backward's row sums were
  rewritten as batched products: other bits, and on a GPU 32768 one-element GEMMs)."""
  from jaxrl_kernels import causal_attention, det_sum

  ks = jax.random.split(jax.random.key(30), 4)
  q = jax.random.normal(ks[0], (2, 24, 4, 32))
  k = jax.random.normal(ks[1], (2, 24, 2, 32))
  v = jax.random.normal(ks[2], (2, 24, 2, 32))
  w = jax.random.normal(ks[3], (128, 40)) * 0.1

  def f(q, k, v, w):
    o = causal_attention(q, k, v)
    return det_sum(det_matmul(o.reshape(48, 128), w), axis=-1)

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))

  (val, grads), (val_t, grads_t) = loss(f)(q, k, v, w), loss(batch_invariant(f))(q, k, v, w)
  assert_bitwise_equal(val_t, val, "value")
  for name, g, gt in zip("qkvw", grads, grads_t):
    assert_bitwise_equal(gt, g, f"d{name}")
  text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(batch_invariant(f)(*a))))(q, k, v, w))
  assert "jaxrl_kernels__matmul2d" in text and "jaxrl_kernels__backward" in text


def test_argmax_first_index_on_ties():
  x = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
  out = batch_invariant(lambda x: (jnp.argmax(x, -1), jnp.argmin(-x, -1)))(x)
  np.testing.assert_array_equal(out[0], [1, 0])
  np.testing.assert_array_equal(out[1], [1, 0])


def test_inner_jaxprs_are_rewritten():
  w = jax.random.normal(jax.random.key(8), (16, 16)) / 4

  @jax.custom_jvp
  def cj(x):
    return jnp.sum(x, -1)

  cj.defjvp(lambda p, t: (cj(p[0]), jnp.sum(t[0], -1)))

  @jax.custom_vjp
  def cv(x):
    return x @ w

  cv.defvjp(lambda x: (x @ w, None), lambda _, g: (g @ w.T,))

  def f(x, n):  # n: a traced trip count (a while loop, forward only)
    x = jax.jit(lambda y: y @ w)(x)
    x = lax.scan(lambda c, r: (c + jnp.sum(r), r @ w), 0.0, x)[1]
    x = lax.cond(jnp.sum(x) > 0, lambda y: y @ w, lambda y: y @ w.T, x)
    x = lax.fori_loop(0, 2, lambda i, y: y @ w, x)
    x = lax.fori_loop(0, n, lambda i, y: y @ w, x)
    x = jax.checkpoint(lambda y: jnp.tanh(y @ w))(x)
    return cj(cv(x))

  x = jax.random.normal(jax.random.key(9), (5, 16))
  g = batch_invariant(f)
  _close(jax.jit(g)(x, 2), f(x, 2), 1e-5)
  assert_bitwise_equal(jax.jit(g)(x[2:3], 2)[0], jax.jit(g)(x, 2)[2], "row alone")

  def collect(jaxpr, out):  # every primitive name at every depth, kernels excluded
    for eqn in jaxpr.eqns:
      out.add(eqn.primitive.name)
      call = eqn.params.get("call_jaxpr")
      if call is not None and call.jaxpr.debug_info.func_name in LIBRARY_OPS:
        continue  # the library's own fixed-order ops
      for v in eqn.params.values():
        for sub in v if isinstance(v, tuple) else (v,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            collect(sub.jaxpr, out)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            collect(sub, out)
    return out

  names = collect(jax.make_jaxpr(g)(x, 2).jaxpr, set())
  assert {"while", "cond", "scan", "custom_jvp_call", "custom_vjp_call"} <= names
  assert not names & {"dot_general", "reduce_sum"}, names
  f2 = lambda x: f(x, 1)
  _close(jax.grad(lambda x: jnp.sum(batch_invariant(f2)(x)))(x),
         jax.grad(lambda x: jnp.sum(f2(x)))(x), 1e-4)


def test_composes_with_jit_grad_vmap_remat_and_decorators():
  w = jax.random.normal(jax.random.key(10), (8, 3))
  x = jax.random.normal(jax.random.key(11), (4, 6, 8))

  @batch_invariant
  def f(x, w, *, scale=2.0):
    return {"y": jax.nn.softmax(x @ w * scale, -1)}

  @batch_invariant(strict=True)
  def h(x, w):
    return jnp.sum(x @ w)

  ref = jax.nn.softmax(x @ w * 3.0, -1)
  _close(jax.jit(f, static_argnames="scale")(x, w, scale=3.0)["y"], ref)
  _close(jax.vmap(lambda x: f(x, w)["y"])(x), jax.nn.softmax(x @ w * 2.0, -1))
  _close(jax.checkpoint(h)(x, w), jnp.sum(x @ w), 1e-5)
  gw = jax.grad(h, argnums=1)(x, w)
  _close(gw, jax.grad(lambda x, w: jnp.sum(x @ w), argnums=1)(x, w), 1e-5)
  assert_bitwise_equal(jax.grad(h, argnums=1)(x, w), gw, "run to run")
  assert f.__name__ == "f"
  # closing over a traced value (a weight inside an outer jit) is not cached past its trace
  outer = jax.jit(lambda x, w: batch_invariant(lambda y: jnp.sum(y @ w))(x))
  _close(outer(x, w), jnp.sum(x @ w), 1e-5)
  _close(outer(x, 2 * w), 2 * jnp.sum(x @ w), 1e-5)


# Embedding lookups as jnp writes them: indexing (its gradient scatters with
# PROMISE_IN_BOUNDS), take with clipped ids, take with dropped (out-of-range) ids.
_LOOKUPS = {
    "index": (lambda e, ids: e[ids], [[1, 3, 1, 10], [3, 3, 0, 1]]),
    "clip": (lambda e, ids: jnp.take(e, ids, axis=0, mode="clip"), [[1, 3, 1, 14], [3, 3, 0, 12]]),
    "fill": (lambda e, ids: jnp.take(e, ids, axis=0, mode="fill"), [[1, 3, 1, 14], [3, 3, 0, 1]]),
}


@pytest.mark.parametrize("lookup", sorted(_LOOKUPS))
def test_embedding_gradient_is_deterministic_and_correct(lookup):
  take, ids = _LOOKUPS[lookup]
  ids = jnp.array(ids)
  emb = jax.random.normal(jax.random.key(12), (11, 8))
  ct = wide_rows(jax.random.key(13), 8, 8, "float32").reshape(2, 4, 8)
  f = lambda e: jnp.sum(take(e, ids) * ct)
  g = jax.jit(jax.grad(batch_invariant(f)))
  out = g(emb)
  _close(out, jax.grad(f)(emb), 1e-6)
  assert "scatter-add" in str(jax.make_jaxpr(jax.grad(f))(emb))
  # The sorted segment sum (a few whole-array ops), not a loop over the ids.
  assert "while" not in str(jax.make_jaxpr(jax.grad(batch_invariant(f)))(emb))
  for _ in range(3):
    assert_bitwise_equal(g(emb), out, "run to run")


def test_unsupported_primitive_fails_loudly_or_warns():
  x = jnp.ones((1, 1, 8, 8))
  k = jnp.ones((1, 1, 3, 3))
  conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME")
  with pytest.raises(NotImplementedError, match=r"conv_general_dilated .*test_transform.py:\d+"):
    batch_invariant(conv)(x, k)
  with pytest.warns(tr.NotRewrittenWarning, match="conv_general_dilated"):
    out = batch_invariant(conv, strict=False)(x, k)
  np.testing.assert_array_equal(out, conv(x, k))


def test_bad_arguments():
  with pytest.raises(TypeError, match="fn must be callable"):
    batch_invariant(3)
  with pytest.raises(TypeError, match="strict must be a bool"):
    batch_invariant(lambda x: x, strict=1)
  with pytest.raises(ValueError, match="implementation must be one of"):
    batch_invariant(lambda x: x, implementation="nonsense")
  with pytest.raises(ValueError, match="stock"):
    batch_invariant(lambda x: x, implementation="xla")


def test_static_python_arguments_and_cache():
  calls = []

  def f(x, n):
    calls.append(n)
    return jnp.sum(x) * n

  g = batch_invariant(f)
  x = jnp.ones(5)
  assert float(g(x, 2)) == 10.0 and float(g(x + 1, 2)) == 20.0
  assert float(g(x, 3)) == 15.0
  assert calls == [2, 3]  # traced once per static value and input type
  with warnings.catch_warnings():
    warnings.simplefilter("error", tr.NotRewrittenWarning)
    g(x, 2)


@pytest.mark.parametrize("first,second", [(2, 2.0), (1, True), (0.0, -0.0)])
def test_static_arguments_keyed_on_type_and_bits(first, second):
  # Equal-comparing static values are different programs (dtype, sign): keyed on type and
  # bits, and -0.0 apart from 0.0 (which jax.jit's cache confuses).
  def f(x, s):
    return jnp.copysign(jnp.ones_like(x, jnp.float32), s), x + s, jnp.asarray(s)

  g = batch_invariant(f)
  x = jnp.ones(3, jnp.int32)
  for s in (first, second):
    got, want = g(x, s), f(x, s)
    for a, b in zip(got, want):
      assert a.dtype == b.dtype
      assert np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


@pytest.mark.parametrize("name", ["inv", "solve", "cg", "expm"])
def test_linear_algebra_with_inner_solves(name):
  # custom_linear_solve keeps its (matvec, vecmat, solve, transpose_solve) record.
  import jax.scipy.linalg as sl
  import jax.scipy.sparse.linalg as spl
  fns = {"inv": jnp.linalg.inv, "solve": lambda a: jnp.linalg.solve(a, a[:, :1]),
         "cg": lambda a: spl.cg(a @ a.T, jnp.ones(4, jnp.float32))[0], "expm": sl.expm}
  a = np.eye(4, dtype=np.float32) + 0.1 * np.arange(16, dtype=np.float32).reshape(4, 4) / 16
  fn = fns[name]
  ref = {"inv": lambda a: np.linalg.inv(a), "solve": lambda a: np.linalg.solve(a, a[:, :1]),
         "cg": lambda a: np.linalg.solve(a @ a.T, np.ones(4)),
         "expm": None}[name]
  out = batch_invariant(fn)(jnp.asarray(a))
  expected = ref(a.astype(np.float64)) if ref is not None else fn(jnp.asarray(a))
  _close(out, expected, tol=1e-4)
