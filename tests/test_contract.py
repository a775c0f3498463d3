"""The invariance contract (CONTRACT.md section 1), one suite for every op and implementation.

Each case is an (op, implementation) pair: ``det_matmul`` and ``linear_logp`` (both weight
layouts; bias and temperature), ``causal_attention`` and ``det_sum`` over ``"cpu"``,
``"interpret"``, ``"triton"``, ``"mosaic"`` and ``"cuda"``. A pair that cannot run here is
skipped with the reason (the op lacks the implementation, or this machine lacks the
device); GPU pairs carry the ``gpu`` marker (``mosaic``/``cuda`` also ``hopper``).

A "row" is what the contract keeps invariant: a token row for ``det_matmul``,
``linear_logp`` and ``det_sum``, a whole sequence (batch entry) for ``causal_attention``.
Every property compares raw bits (atol = rtol = 0) on inputs that reveal any reordering
(rows and columns scaled by powers of two over a wide range), and a control shows that
the ``"xla"`` baseline changes bits on the same kind of inputs.

Shapes depend on the device: small on the CPU (every shape is a compilation of the
interpreted kernels), realistic on a GPU (M up to 8192 rows, H = 1024, V = 32003, head dim
128, T up to 4096), with every input dtype the GPU kernel takes.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, bits, wide_rows
from tp_emulation import emulated_tp_logp

import jaxrl_kernels as jk
from jaxrl_kernels import _backend
from jaxrl_kernels.attention import api as attention_api
from jaxrl_kernels.gemm import api as gemm_api
from jaxrl_kernels.linear_logp import api as logp_api
from jaxrl_kernels.linear_logp import head_logits
from jaxrl_kernels.reduce import REDUCE_LANES

Rows = tuple  # per-row inputs: arrays whose leading axis is the row
Shared = tuple  # operands every row uses (weights, bias): never sliced, differentiated

_ON_GPU = _backend.platform() == "gpu"


@dataclasses.dataclass(frozen=True)
class Op:
  """An op as the suite sees it: per-row inputs, shared operands and a call."""

  name: str
  implementations: tuple[str, ...]
  n: int  # rows of the full batch
  positions: tuple[int, ...]  # where a row is placed in the full batch
  batch_sizes: tuple[int, ...]  # M sweep: prefixes of the full batch
  chunks: tuple[int, ...]  # a split of the full batch
  padded: int  # real rows of the padding test, padded to n
  mode_rows: int  # rows of the mode and run-to-run tests
  make_rows: Callable[[int, int, str], Rows]  # (n, seed, dtype) -> rows
  make_shared: Callable[[str], Shared]  # dtype -> shared operands
  call: Callable[[Rows, Shared, str], tuple]  # (rows, shared, implementation) -> outputs
  dtypes: Callable[[str], tuple[str, ...]]  # implementation -> the input dtypes tested
  row_gradients: bool = False  # the gradient w.r.t. a row's inputs is batch-invariant too
  gradient_batch_sizes: tuple[int, ...] = ()  # that test's M sweep; the largest is the full batch
  variant: bool = False  # another layout of an op: on the CPU the interpreted kernels skip it


def _dtypes(cpu: tuple[str, ...], triton: tuple[str, ...], hopper: tuple[str, ...]):
  """Input dtypes per implementation: on the CPU one dtype per op (each is a compilation
  of the interpreted kernels); on a GPU every dtype the kernel takes."""
  def pick(impl: str) -> tuple[str, ...]:
    return hopper if impl in ("mosaic", "cuda") else triton if impl == "triton" else cpu
  return pick


def _take(rows: Rows, idx) -> Rows:
  return tuple(x[idx] for x in rows)


def _cat(*parts: Rows) -> Rows:
  return tuple(jnp.concatenate(xs) for xs in zip(*parts))


# Batch layouts. On the CPU: few distinct shapes (each is a compilation of the interpreted
# kernels); chunk sizes are taken from the batch sizes so that their programs are reused.
_CPU_ROWS = dict(n=512, positions=(0, 137, 511), batch_sizes=(1, 7, 130),
                 chunks=(1, 7, 130, 130, 130, *(7,) * 16, 1, 1), padded=130, mode_rows=130,
                 gradient_batch_sizes=(1, 7, 130))
# On a GPU: M from 1 to 8192 across the tile sizes and the configs the shape heuristics pick.
_GEMM_GPU_ROWS = dict(n=8192, positions=(0, 137, 511, 4095, 8191),
                      batch_sizes=(1, 2, 7, 64, 65, 200, 256, 1000, 1024, 3000, 4096, 8192),
                      chunks=(1, 7, 65, 1000, 3000, 4119), padded=1000, mode_rows=1000,
                      gradient_batch_sizes=(1, 7, 65, 300, 1000, 4096, 8192))
_LOGP_GPU_ROWS = dict(n=4096, positions=(0, 137, 511, 4095),
                      batch_sizes=(1, 7, 63, 64, 130, 777, 1000, 1777, 4096),
                      chunks=(1, 100, 256, 1000, 2739), padded=512, mode_rows=512,
                      gradient_batch_sizes=(1, 63, 64, 130, 777, 1000, 1777, 4096))

# det_matmul: K and N multiples of 64 (N >= 256) so that Mosaic takes the weight.
_GEMM_K, _GEMM_N = (1024, 1536) if _ON_GPU else (192, 256)


def _gemm_rows(n: int, seed: int, dtype) -> Rows:
  # float16 holds at most 65504: rows scaled by 2**(+-10) (row and column scales
  # multiply) would be inf already, and a weight gradient summed over 1000 such rows
  # too; 2**(+-3) each keeps every value and gradient finite and still reveals reorderings.
  spread = 3 if jnp.dtype(dtype) == jnp.float16 else 10
  return (wide_rows(jax.random.key(seed), n, _GEMM_K, dtype, spread=spread),)


def _gemm_shared(dtype) -> Shared:
  return (jax.random.normal(jax.random.key(101), (_GEMM_K, _GEMM_N)).astype(dtype),)


def _gemm_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return (jk.det_matmul(rows[0], shared[0], implementation=impl),)


def _gemm_t_shared(dtype) -> Shared:
  return (_gemm_shared(dtype)[0].T,)


def _gemm_t_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return (jk.det_matmul(rows[0], shared[0], transpose_b=True, implementation=impl),)


# linear_logp: V not a multiple of the vocab tile; entropy too.
_LOGP_H, _LOGP_V = (1024, 32003) if _ON_GPU else (64, 320)
_LOGP_SPREAD = 4 if _ON_GPU else 3


def _logp_rows(n: int, seed: int, dtype) -> Rows:
  k1, k2 = jax.random.split(jax.random.key(seed))
  hidden = wide_rows(k1, n, _LOGP_H, dtype, spread=_LOGP_SPREAD)
  return hidden, jax.random.randint(k2, (n,), 0, _LOGP_V, jnp.int32)


def _logp_weight(dtype, layout: str = "hv") -> jax.Array:
  w = jax.random.normal(jax.random.key(102), (_LOGP_H, _LOGP_V)) * (2.0 / np.sqrt(_LOGP_H))
  return (w if layout == "hv" else w.T).astype(dtype)


def _logp_shared(dtype) -> Shared:
  return (_logp_weight(dtype),)


def _logp_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return tuple(jk.linear_logp(rows[0], shared[0], rows[1], return_entropy=True,
                              implementation=impl))


def _logp_vh_shared(dtype) -> Shared:
  bias = jax.random.normal(jax.random.key(103), (_LOGP_V,)) * 0.5
  return _logp_weight(dtype, "vh"), bias.astype(dtype)


def _logp_vh_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return tuple(jk.linear_logp(rows[0], shared[0], rows[1], bias=shared[1], temperature=0.9,
                              weight_layout="vh", return_entropy=True, implementation=impl))


# causal_attention: each row a sequence of T tokens, no multiple of the key tile (on the
# CPU a full Triton key tile and a partial one, two query blocks); on a GPU grouped-query
# heads of dim 128 over several key tiles.
_ATT_T, _ATT_HQ, _ATT_HKV, _ATT_D = (520, 8, 2, 128) if _ON_GPU else (70, 2, 1, 16)


def _attention_rows(n: int, seed: int, dtype) -> Rows:
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  shape_kv = (n, _ATT_T, _ATT_HKV, _ATT_D)
  q = jax.random.normal(k1, (n, _ATT_T, _ATT_HQ, _ATT_D))
  k = jax.random.normal(k2, shape_kv)
  scale = 2.0 ** jax.random.randint(k4, (n, _ATT_T, _ATT_HKV, 1), -10, 11).astype(jnp.float32)
  v = jax.random.normal(k3, shape_kv) * scale
  return tuple(x.astype(dtype) for x in (q, k, v))


def _attention_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return (jk.causal_attention(*rows, implementation=impl),)


# det_sum over rows of a length that is no multiple of the lane count.
_SUM_N = (40 if _ON_GPU else 3) * REDUCE_LANES + 17


def _sum_rows(n: int, seed: int, dtype) -> Rows:
  return (wide_rows(jax.random.key(seed), n, _SUM_N, dtype, spread=4),)


def _sum_call(rows: Rows, shared: Shared, impl: str) -> tuple:
  return (jk.det_sum(rows[0], axis=1, implementation=impl),)


_F32, _HALF = ("float32",), ("bfloat16", "float16")
_LOGP = dict(implementations=logp_api.IMPLEMENTATIONS, make_rows=_logp_rows,
             row_gradients=True, **(_LOGP_GPU_ROWS if _ON_GPU else _CPU_ROWS))
OPS = {
    "det_matmul": Op("det_matmul", gemm_api.IMPLEMENTATIONS, make_rows=_gemm_rows,
                     make_shared=_gemm_shared, call=_gemm_call,
                     dtypes=_dtypes(_F32, ("float32", *_HALF), _HALF), row_gradients=True,
                     **(_GEMM_GPU_ROWS if _ON_GPU else _CPU_ROWS)),
    # The weight stored [N, K] and read transposed (a tied embedding, the LM head's "vh").
    "det_matmul_t": Op("det_matmul", gemm_api.IMPLEMENTATIONS, make_rows=_gemm_rows,
                       make_shared=_gemm_t_shared, call=_gemm_t_call,
                       dtypes=_dtypes(_F32, ("float32", *_HALF), _HALF), row_gradients=True,
                       variant=True, **(_GEMM_GPU_ROWS if _ON_GPU else _CPU_ROWS)),
    "linear_logp": Op("linear_logp", make_shared=_logp_shared, call=_logp_call,
                      dtypes=_dtypes(_F32, ("float32", "bfloat16"), ("bfloat16",)), **_LOGP),
    # The transposed weight (the tied-embedding layout), a bias and a temperature.
    "linear_logp_vh": Op("linear_logp", make_shared=_logp_vh_shared, call=_logp_vh_call,
                         dtypes=_dtypes(("bfloat16",), ("bfloat16",), ("bfloat16",)),
                         variant=True, **_LOGP),
    # Sequences are expensive in interpret mode: 8 of them, a row at the first, an inner
    # and the last position.
    "causal_attention": Op("causal_attention", attention_api.IMPLEMENTATIONS, n=8,
                           positions=(0, 3, 7), batch_sizes=(1, 3), chunks=(1, 3, 1, 3),
                           padded=3, mode_rows=3, make_rows=_attention_rows,
                           make_shared=lambda dtype: (), call=_attention_call,
                           dtypes=lambda impl: ("bfloat16",)),
    # "mosaic" and "cuda" run det_sum's Triton kernel: not a pair of their own.
    "det_sum": Op("det_sum", ("triton", "interpret", "cpu", "xla"), make_rows=_sum_rows,
                  make_shared=lambda dtype: (), call=_sum_call,
                  dtypes=_dtypes(_F32, ("float32", *_HALF), ()), **_CPU_ROWS),
}

_GPU = (pytest.mark.gpu,)
_HOPPER = (pytest.mark.gpu, pytest.mark.hopper)
IMPLEMENTATIONS = [pytest.param("cpu", id="cpu"), pytest.param("interpret", id="interpret"),
                   pytest.param("triton", marks=_GPU, id="triton"),
                   pytest.param("mosaic", marks=_HOPPER, id="mosaic"),
                   pytest.param("cuda", marks=_HOPPER, id="cuda")]


def skip_reason(op: Op, implementation: str) -> str | None:
  """Why ``op`` cannot run ``implementation`` here (None when it can)."""
  if implementation not in op.implementations:
    return f"{op.name} has no {implementation!r} implementation of its own"
  if implementation == "interpret" and _ON_GPU:
    return "interpret mode is tested where JAX's default backend is the CPU"
  if implementation == "interpret" and op.variant:
    return (f"interpret mode runs the Triton kernels: this {op.name} layout is tested "
            f"compiled ('triton', on a GPU) and with implementation='cpu' here")
  try:
    _backend.check_available(op.name, implementation)
  except _backend.ImplementationUnavailableError as e:
    return str(e)
  return None


@pytest.fixture(params=list(OPS))
def op(request) -> Op:
  return OPS[request.param]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, op) -> str:
  why = skip_reason(op, request.param)
  if why is not None:
    pytest.skip(why)
  return request.param


def _needs(op: Op, implementation: str) -> None:
  why = skip_reason(op, implementation)
  if why is not None:
    pytest.skip(why)


def _cases(op: Op, implementation: str, seed: int, n: int):
  """``(dtype, rows, shared)`` for every dtype ``implementation`` is tested in."""
  assert op.dtypes(implementation), f"{op.name}: no dtype to test {implementation!r} in"
  for dtype in op.dtypes(implementation):
    yield dtype, op.make_rows(n, seed, dtype), op.make_shared(dtype)


@functools.cache
def _jitted(op: Op, impl: str):
  return jax.jit(lambda rows, shared: op.call(rows, shared, impl))


def _row_weights(m: int) -> jax.Array:
  # Cotangent weights that differ between rows and do not depend on the batch size.
  return 1.0 + 0.25 * (jnp.arange(m) % 7).astype(jnp.float32)


def _float_indices(xs: tuple) -> list[int]:
  return [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.floating)]


@functools.cache
def _grad_step(op: Op, impl: str):
  """``(gradients, outputs)`` of ``sum_r w_r sum(outputs[r])`` w.r.t. the float row inputs
  and every shared operand: a training step's forward and backward."""
  def loss(diff, rows, shared):
    rows = list(rows)
    for i, x in zip(_float_indices(rows), diff[0]):
      rows[i] = x
    outs = op.call(tuple(rows), diff[1], impl)
    total = sum(jnp.sum(o.astype(jnp.float32) * _row_weights(o.shape[0]).reshape(
        (-1,) + (1,) * (o.ndim - 1))) for o in outs)
    return total, outs

  grad = jax.grad(loss, has_aux=True)
  return jax.jit(lambda rows, shared: grad(
      ([rows[i] for i in _float_indices(rows)], list(shared)), rows, shared))


def _assert_rows_equal(got: tuple, want: tuple, what: str):
  for i, (g, w) in enumerate(zip(got, want, strict=True)):
    assert_bitwise_equal(g, w, f"{what} (output {i})")


def test_batch_invariance(op, implementation):
  """Rows of a batch of M equal the same rows of the full batch, for an M sweep that
  includes 1 and sizes that are no multiple of any tile."""
  f = _jitted(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 1, op.n):
    full = f(rows, shared)
    for m in op.batch_sizes:
      _assert_rows_equal(f(_take(rows, slice(0, m)), shared), _take(full, slice(0, m)),
                         f"{dtype} M={m}")


def test_row_gradients_batch_invariance(op, implementation):
  """The gradient w.r.t. a row's inputs (dA of a GEMM, dH of the LM head) is the same bits
  in a batch of M rows as in the full batch (weight gradients sum over rows: they are
  deterministic run to run, not batch-invariant)."""
  if not op.row_gradients:
    pytest.skip(f"{op.name}'s input gradients are not claimed batch-invariant")
  g = _grad_step(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 10, max(op.gradient_batch_sizes)):
    sizes = sorted(op.gradient_batch_sizes)
    full = g(_take(rows, slice(0, sizes[-1])), shared)[0][0]
    for m in sizes[:-1]:
      part = g(_take(rows, slice(0, m)), shared)[0][0]
      _assert_rows_equal(tuple(part), tuple(x[:m] for x in full), f"{dtype} d(rows) M={m}")


def test_position_invariance(op, implementation):
  """One row placed at the first, an inner and the last position of the full batch."""
  f = _jitted(op, implementation)
  for dtype, row, shared in _cases(op, implementation, 2, 1):
    alone = f(row, shared)
    others = op.make_rows(op.n, 3, dtype)
    for pos in op.positions:
      batch = tuple(o.at[pos].set(r[0]) for o, r in zip(others, row))
      _assert_rows_equal(_take(f(batch, shared), slice(pos, pos + 1)), alone,
                         f"{dtype} position {pos}")


def test_padding_invariance(op, implementation):
  """Random rows prepended and appended change nothing in the real rows."""
  f = _jitted(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 4, op.padded):
    pad = op.make_rows(op.n - op.padded, 5, dtype)
    before = 1
    padded = _cat(_take(pad, slice(0, before)), rows, _take(pad, slice(before, None)))
    out = _take(f(padded, shared), slice(before, before + op.padded))
    _assert_rows_equal(out, f(rows, shared), f"{dtype} padded")


def test_chunking_invariance(op, implementation):
  """The batch processed in chunks of any sizes gives the bits of one call."""
  f = _jitted(op, implementation)
  assert sum(op.chunks) == op.n
  starts = np.cumsum((0, *op.chunks))
  for dtype, rows, shared in _cases(op, implementation, 6, op.n):
    full = f(rows, shared)
    parts = [f(_take(rows, slice(a, b)), shared) for a, b in zip(starts[:-1], starts[1:])]
    _assert_rows_equal(tuple(jnp.concatenate(p) for p in zip(*parts)), full,
                       f"{dtype} chunks {op.chunks}")


def test_mode_invariance(op, implementation):
  """The forward inside a training step (under jax.grad, w.r.t. the inputs and the
  weights) gives the rollout's bits, and the gradients are finite."""
  for dtype, rows, shared in _cases(op, implementation, 7, op.mode_rows):
    forward = _jitted(op, implementation)(rows, shared)
    grads, in_grad = _grad_step(op, implementation)(rows, shared)
    for g in jax.tree.leaves(grads):
      assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), f"{dtype}: a gradient"
    _assert_rows_equal(in_grad, forward, f"{dtype} inside jax.grad")


def test_run_to_run(op, implementation):
  """The same inputs give the same bits every run: 20 forwards, 5 training steps (every
  gradient, weights included)."""
  f, g = _jitted(op, implementation), _grad_step(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 8, op.mode_rows):
    first = [bits(x) for x in f(rows, shared)]
    for _ in range(20):
      for a, b in zip(first, f(rows, shared), strict=True):
        assert np.array_equal(a, bits(b)), f"{dtype} forward"
    grads = [bits(x) for x in jax.tree.leaves(g(rows, shared)[0])]
    for _ in range(5):
      for a, b in zip(grads, jax.tree.leaves(g(rows, shared)[0]), strict=True):
        assert np.array_equal(a, bits(b)), f"{dtype} gradient"


# ------------------------------------------------------------------------- linear_logp


@pytest.mark.parametrize("variant", ["linear_logp", "linear_logp_vh"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_logp_without_entropy_has_the_bits_with_it(variant, implementation):
  """Dropping the entropy (the sampler's call) leaves every log-prob's bits as they are."""
  op = OPS[variant]
  _needs(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 11, op.mode_rows):
    both = _jitted(op, implementation)(rows, shared)
    alone = jax.jit(lambda rows, shared: jk.linear_logp(
        rows[0], shared[0], rows[1], implementation=implementation,
        **({} if variant == "linear_logp" else dict(bias=shared[1], temperature=0.9,
                                                      weight_layout="vh"))))(rows, shared)
    assert_bitwise_equal(alone, both[0], f"{dtype} logp without entropy")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, pytest.param("xla", id="xla")])
def test_traced_temperature_has_the_static_bits(implementation, temperature):
  """A temperature annealed inside jit reaches every kernel as an operand: the same value
  gives the same bits (logp, entropy, dH, the sampler's logits) whether it is a Python
  float or a traced scalar."""
  op = OPS["linear_logp_vh"]
  _needs(op, implementation)
  for dtype in op.dtypes(implementation if implementation != "xla" else "cpu"):
    (x, tg), (w, b) = op.make_rows(25, 14, dtype), op.make_shared(dtype)
    kw = dict(bias=b, weight_layout="vh", implementation=implementation)

    def out(x, t, kw=kw, tg=tg, w=w):
      lp, ent = jk.linear_logp(x, w, tg, temperature=t, return_entropy=True, **kw)
      g = jax.grad(lambda x: jnp.sum(jk.linear_logp(x, w, tg, temperature=t, **kw)))(x)
      return lp, ent, g, head_logits(x, w, temperature=t, **kw)

    static = jax.jit(lambda x, out=out: out(x, temperature))(x)
    traced = jax.jit(out)(x, jnp.float32(temperature))
    for name, a, c in zip(("logp", "entropy", "dH", "logits"), static, traced):
      assert_bitwise_equal(a, c, f"{dtype} {name}: static vs traced temperature")


# Shards on the vocab tile grid: halves, and uneven shards (one tile, most tiles, the rest).
_VOCAB_CUTS = (((0, 16000, _LOGP_V), (0, 128 * 31, 128 * 125, _LOGP_V)) if _ON_GPU else
               ((0, 128, _LOGP_V), (0, 128, 256, _LOGP_V)))
# The interpreted kernels' TP runs over a real 8-device shard_map in
# tests/linear_logp/test_vocab_parallel.py; their emulation here is the slow run's.
_PARTIALS = [pytest.param("interpret", marks=pytest.mark.slow, id="interpret")
             if p.values[0] == "interpret" else p
             for p in IMPLEMENTATIONS if p.values[0] in logp_api.PARTIAL_IMPLEMENTATIONS]


@pytest.mark.parametrize("layout", ["hv", pytest.param("vh", marks=pytest.mark.slow)])
@pytest.mark.parametrize("implementation", _PARTIALS)
def test_vocab_shards_merge_to_the_unsharded_bits(layout, implementation):
  """Tensor parallelism over the vocabulary, emulated on one device: the tile partials of
  TP = 2, 4, 8 padded shards (and of uneven shards cut on the tile grid), merged in
  tile order, give linear_logp's bits; the shards' target logits sum exactly."""
  op = OPS["linear_logp"]
  _needs(op, implementation)
  v = _LOGP_V
  dtype = op.dtypes(implementation)[-1]
  x, tg = op.make_rows(op.mode_rows, 12, dtype)
  w = _logp_weight(dtype, layout)
  lp, ent = jk.linear_logp(x, w, tg, return_entropy=True, weight_layout=layout,
                           implementation=implementation)
  for tp in (2, 4, 8):
    lp_tp, ent_tp = emulated_tp_logp(x, w, tg, tp, v, layout=layout,
                                     implementation=implementation)
    assert_bitwise_equal(lp_tp, lp, f"emulated TP={tp} logp")
    assert_bitwise_equal(ent_tp, ent, f"emulated TP={tp} entropy")
  # A vocabulary of 2 tiles over TP = 8: shards 2..7 hold padding only (valid_vocab 0).
  small = w[:, :200] if layout == "hv" else w[:200]
  tg_small = tg % 200
  lp_s, ent_s = jk.linear_logp(x, small, tg_small, return_entropy=True, weight_layout=layout,
                               implementation=implementation)
  lp_tp, ent_tp = emulated_tp_logp(x, small, tg_small, 8, 200, layout=layout,
                                   implementation=implementation)
  assert_bitwise_equal(lp_tp, lp_s, "emulated TP=8, padding-only shards, logp")
  assert_bitwise_equal(ent_tp, ent_s, "emulated TP=8, padding-only shards, entropy")
  kw = dict(weight_layout=layout, implementation=implementation)
  full = logp_api.tile_partials(x, w, None, tg, **kw)
  ref = logp_api.merge_partials(*full[:3], implementation=implementation)
  for cuts in _VOCAB_CUTS:
    shards = [logp_api.tile_partials(
        x, w[:, lo:hi] if layout == "hv" else w[lo:hi], None, tg, vocab_offset=lo, **kw)
        for lo, hi in zip(cuts[:-1], cuts[1:])]
    cat = [jnp.concatenate([s[i] for s in shards]) for i in range(3)]
    for got, want in zip(logp_api.merge_partials(*cat, implementation=implementation), ref):
      assert_bitwise_equal(got, want, f"merge of shards {cuts}")
    assert_bitwise_equal(sum(s[3] for s in shards), full[3], f"target logit {cuts}")


# ---------------------------------------------------------------------- causal_attention


def _nan_cache(x: jax.Array, keep, s_cache: int) -> jax.Array:
  """``x [B, T, H, D]`` in a cache of ``s_cache`` keys holding NaN at and past ``keep``
  (an int, or ``[B]`` per sequence)."""
  pad = jnp.pad(x, ((0, 0), (0, s_cache - x.shape[1]), (0, 0), (0, 0)),
                constant_values=jnp.nan)
  keep = jnp.asarray(keep).reshape(-1, 1, 1, 1)
  return jnp.where(jnp.arange(s_cache)[None, :, None, None] < keep, pad, jnp.nan)


def _attention_inputs(seed, b, t, hq, hkv, d, dtype):
  """q ``[b, t, hq, d]``, k and v ``[b, t, hkv, d]``; v rows scaled by 2**e, e in [-10, 10]."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k1, (b, t, hq, d))
  k = jax.random.normal(k2, (b, t, hkv, d))
  v = jax.random.normal(k3, (b, t, hkv, d))
  v = v * 2.0 ** jax.random.randint(k4, (b, t, hkv, 1), -10, 11).astype(jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# (dtype, B, T, Hq, Hkv, D, decoded positions, cache length): positions at and around the
# key tiles and query blocks, grouped-query heads, head dims the Mosaic kernel takes.
_DECODE_CASES = [
    ("bfloat16", 2, 1024, 8, 8, 128, (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 511, 777,
                                      1023), 1124),
    ("float32", 2, 1024, 8, 8, 128, (0, 1, 63, 64, 65, 511, 777, 1023), 1124),
    ("bfloat16", 2, 300, 4, 2, 64, (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 299), 400),
    ("float16", 2, 300, 4, 1, 128, (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 299), 400),
    ("bfloat16", 1, 4096, 8, 2, 128, (0, 100, 2047, 2048, 3333, 4095), 4160),
    # 41 x 4 decode CTAs, more than an H100's SMs: the Mosaic decode runs two batch
    # entries per CTA (attention_mosaic.lanes_for), an odd batch leaving one lane empty.
    ("bfloat16", 41, 256, 16, 4, 64, (0, 1, 63, 64, 65, 127, 128, 129, 255), 300),
] if _ON_GPU else [
    ("bfloat16", 2, 70, 2, 1, 16, (0, 1, 63, 64, 65, 69), 100),
    pytest.param(("float32", 2, 70, 4, 2, 16, (0, 5, 64, 69), 100), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", _DECODE_CASES, ids=lambda c: f"{c[0]}-T{c[2]}-D{c[5]}")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_decode_equals_prefill(implementation, case):
  """Each token decoded alone (one query against a longer KV cache holding NaN at and past
  its own length; the batch's sequences at different positions) gives the prefill's bits."""
  dtype, b, t, hq, hkv, d, positions, s_cache = case
  _needs(OPS["causal_attention"], implementation)
  if implementation == "mosaic" and dtype == "float32":
    pytest.skip("the Mosaic attention takes bf16 and fp16 inputs")
  q, k, v = _attention_inputs(1, b, t, hq, hkv, d, dtype)
  prefill = jax.jit(lambda q, k, v: jk.causal_attention(q, k, v, implementation=implementation))
  decode = jax.jit(lambda q, k, v, pos: jk.causal_attention(
      q, _nan_cache(k, pos + 1, s_cache), _nan_cache(v, pos + 1, s_cache),
      q_positions=pos[:, None], kv_lengths=pos + 1, implementation=implementation))
  want = prefill(q, k, v)
  for i in range(len(positions)):
    pos = np.array([positions[(i + j) % len(positions)] for j in range(b)], np.int32)
    got = decode(q[np.arange(b), pos][:, None], k, v, jnp.asarray(pos))
    assert_bitwise_equal(got[:, 0], want[np.arange(b), pos], f"{dtype} decode at {pos}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_chunked_prefill(implementation):
  """Queries computed in chunks (one at a time, then blocks) against a KV cache holding
  NaN past ``kv_lengths`` give the prefill's bits."""
  op = OPS["causal_attention"]
  _needs(op, implementation)
  t = _ATT_T
  f = jax.jit(lambda q, k, v, pos, kvl: jk.causal_attention(
      q, k, v, q_positions=pos, kv_lengths=kvl, implementation=implementation))
  for dtype in op.dtypes(implementation):
    q, k, v = op.make_rows(2, 9, dtype)
    prefill = jk.causal_attention(q, k, v, implementation=implementation)
    cuts = (0, 1, 64, 65, t)
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
      pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (2, hi - lo))
      parts.append(f(q[:, lo:hi], _nan_cache(k, hi, t), _nan_cache(v, hi, t), pos,
                     jnp.full((2,), hi, jnp.int32)))
    assert_bitwise_equal(jnp.concatenate(parts, 1), prefill, f"{dtype} chunks {cuts}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_query_padding_packing_and_garbage(implementation):
  """Within a sequence: padding queries (position -1) before and after the real ones give
  +0 and change nothing; queries in any order (packed, permuted) keep their bits; keys
  past ``kv_lengths`` holding inf and NaN are never read, and a query past
  ``kv_lengths`` sees exactly the keys below it."""
  op = OPS["causal_attention"]
  _needs(op, implementation)
  b, t, hq, hkv, d = (2, 260, 4, 4, 128) if _ON_GPU else (2, 70, 2, 1, 16)
  extra, before, after, n = 90, 37, 30, 200 if _ON_GPU else 52
  f = jax.jit(lambda q, k, v, pos, kvl: jk.causal_attention(
      q, k, v, q_positions=pos, kv_lengths=kvl, implementation=implementation))
  arange = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  full_len = jnp.full((b,), t, jnp.int32)
  for dtype in op.dtypes(implementation):
    q, k, v = _attention_inputs(6, b, t, hq, hkv, d, dtype)
    prefill = f(q, k, v, arange, full_len)
    # Padding queries and garbage keys (inf in K, NaN in V) past kv_lengths.
    qp = jnp.concatenate([q[:, :before], q, q[:, :after]], 1)
    pos = np.concatenate([-np.ones((b, before)), arange, -np.ones((b, after))], 1)
    kp = jnp.concatenate([k, jnp.full((b, extra, hkv, d), jnp.inf, dtype)], 1)
    vp = jnp.concatenate([v, jnp.full((b, extra, hkv, d), jnp.nan, dtype)], 1)
    out = f(qp, kp, vp, pos.astype(np.int32), full_len)
    assert_bitwise_equal(out[:, before:before + t], prefill, f"{dtype} padded")
    assert not np.any(bits(out[:, :before])) and not np.any(bits(out[:, before + t:])), (
        f"{dtype}: padding queries must give +0")
    # Permuted queries.
    perm = np.random.default_rng(0).permutation(t)
    assert_bitwise_equal(f(q[:, perm], k, v, arange[:, perm], full_len), prefill[:, perm],
                         f"{dtype} permuted positions")
    # kv_lengths n < T: rows below n are the prefill's, rows past it see keys < n only.
    cut = f(q, _nan_cache(k[:, :n], n, t), _nan_cache(v[:, :n], n, t), arange,
            jnp.full((b,), n, jnp.int32))
    assert np.all(np.isfinite(np.asarray(cut, np.float32)))
    assert_bitwise_equal(cut[:, :n], prefill[:, :n], f"{dtype} rows below kv_lengths")
    last = f(q[:, n:], k[:, :n], v[:, :n], np.full((b, t - n), n - 1, np.int32),
             jnp.full((b,), n, jnp.int32))
    for i in (n, n + 1, t - 1):
      assert_bitwise_equal(cut[:, i], last[:, i - n], f"{dtype} row {i} past kv_lengths")


# ------------------------------------------------------------------------------- det_sum


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_det_sum_trailing_zeros(implementation):
  """Exact zeros appended along the summed axis (masked keys, a longer zero-initialised
  cache) leave every sum's bits as they are."""
  op = OPS["det_sum"]
  _needs(op, implementation)
  for dtype, rows, shared in _cases(op, implementation, 13, 64):
    f = _jitted(op, implementation)
    for extra in (7, 16 * REDUCE_LANES) if _ON_GPU else (3 * REDUCE_LANES + 7,):
      padded = (jnp.pad(rows[0], ((0, 0), (0, extra))),)
      assert_bitwise_equal(f(padded, shared)[0], f(rows, shared)[0], f"{dtype} +{extra} zeros")


# ---------------------------------------------------------------------------- controls
# The stock paths change bits on such inputs: the invariance tests above could see a
# reordering. On the CPU at the suite's shapes; on a GPU at the shapes where cuBLAS and
# XLA's GPU reductions pick their algorithm by the batch.
cpu_only = pytest.mark.skipif(_ON_GPU, reason="the controls at these shapes are for the CPU")


def _differs(a: tuple, b: tuple) -> bool:
  return any(not np.array_equal(bits(x), bits(y)) for x, y in zip(a, b))


@cpu_only
@pytest.mark.parametrize("name", ["det_matmul", "linear_logp"])
def test_control_xla_changes_bits_with_the_batch(name):
  op = OPS[name]
  f = _jitted(op, "xla")
  rows, shared = op.make_rows(op.n, 1, "float32"), op.make_shared("float32")
  full = f(rows, shared)
  changed = [r for r in range(0, op.n, 17)
             if _differs(f(_take(rows, slice(r, r + 1)), shared), _take(full, slice(r, r + 1)))]
  assert changed, f"{name}: 'xla' gave batch-invariant rows here: the inputs are too weak"


@cpu_only
def test_control_xla_attention_changes_bits_decode_vs_prefill():
  """The materialised attention changes a query's bits between its prefill and its
  decode step (one query against the cache) on the suite's inputs (float32 output:
  a bf16 rounding can hide the difference)."""
  q, k, v = OPS["causal_attention"].make_rows(2, 1, jnp.float32)
  f = jax.jit(lambda q, k, v: jk.causal_attention(q, k, v, implementation="xla"))
  prefill = f(q, k, v)
  changed = 0
  for p in (3, 40, 64, 69):
    dec = f(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1])
    changed += _differs((dec,), (prefill[:, p:p + 1],))
  assert changed


@pytest.mark.gpu
def test_control_gpu_dot_changes_bits_with_the_batch():
  k, n = 4096, 4096
  x = wide_rows(jax.random.key(10), 4096, k, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(11), (k, n)).astype(jnp.bfloat16)
  f = jax.jit(lambda x: jnp.dot(x, w))
  full = bits(f(x))
  changed = sum(not np.array_equal(bits(f(x[r:r + 1])), full[r:r + 1])
                for r in range(0, 4096, 256))
  assert changed > 0, "jnp.dot was batch-invariant on these inputs"


@pytest.mark.gpu
def test_control_gpu_xla_logp_changes_bits_with_the_batch():
  x = wide_rows(jax.random.key(3), 4096, 1024, jnp.bfloat16, spread=4)
  tg = jax.random.randint(jax.random.key(4), (4096,), 0, 32003)
  w = (jax.random.normal(jax.random.key(1), (1024, 32003), jnp.float32)
       * (2.0 / np.sqrt(1024))).astype(jnp.bfloat16)
  f = jax.jit(lambda x, t: jk.linear_logp(x, w, t, return_entropy=True, implementation="xla"))
  small = f(x[:1], tg[:1])
  changed = any(_differs(tuple(o[:1] for o in f(x[:m], tg[:m])), small)
                for m in (7, 64, 1000, 4096))
  assert changed, "materialized XLA gave the same bits at every batch size"


@pytest.mark.gpu
def test_control_gpu_xla_logp_changes_bits_at_a_deep_hidden_size():
  """A deep H (8192): cuBLAS picks split-K and other tiles by M."""
  h, v = 8192, 1024
  x = wide_rows(jax.random.key(21), 4096, h, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(22), (h, v)).astype(jnp.bfloat16) * 0.05
  tg = jax.random.randint(jax.random.key(23), (4096,), 0, v)
  f = jax.jit(lambda x, t: jk.linear_logp(x, w, t, return_entropy=True, implementation="xla"))
  lp, ent = f(x, tg)
  changed = any(_differs((lp[r:r + 1], ent[r:r + 1]), f(x[r:r + 1], tg[r:r + 1]))
                for r in range(4))
  assert changed, "materialized XLA gave the same bits at M = 1 and M = 4096"


@pytest.mark.gpu
def test_control_gpu_xla_attention_changes_bits_decode_vs_prefill():
  b, t = 2, 1024
  q, k, v = _attention_inputs(1, b, t, 8, 8, 128, jnp.bfloat16)
  prefill = jk.causal_attention(q, k, v, implementation="xla")
  differ = 0
  for p in (63, 511, 777, t - 1):
    dec = jk.causal_attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], implementation="xla")
    differ += int(np.sum(bits(dec) != bits(prefill[:, p:p + 1])))
  assert differ > 0


@pytest.mark.gpu
def test_control_gpu_jnp_sum_changes_bits():
  """XLA's GPU reduction picks its tree from the shape: a row alone, or with trailing
  zeros, sums in another order."""
  x = wide_rows(jax.random.key(1), 4096, 8192 + 17, "float32")
  f = jax.jit(lambda x: jnp.sum(x, axis=1))
  full = np.asarray(f(x))
  alone = np.stack([np.asarray(f(x[r:r + 1]))[0] for r in range(16)])
  padded = np.asarray(f(jnp.pad(x[:16], ((0, 0), (0, 50000)))))
  assert (not np.array_equal(bits(alone), bits(full[:16]))
          or not np.array_equal(bits(padded), bits(full[:16])))


def test_package_version_is_pyproject_version():
  import tomllib

  from jaxrl_kernels._version import __version__
  root = pathlib.Path(__file__).resolve().parents[1]
  with open(root / "pyproject.toml", "rb") as f:
    assert tomllib.load(f)["project"]["version"] == __version__
