"""The invariance contract (CONTRACT.md section 1), one suite for every op and implementation.

Each case is an (op, implementation) pair: ``det_matmul``, ``linear_logp`` (public
API) and ``causal_attention`` over ``"cpu"``, ``"interpret"``, ``"triton"``,
``"mosaic"`` and ``"cuda"``. A pair that cannot run here is skipped with the
reason (the op lacks the implementation, or this machine lacks the device);
GPU pairs carry the ``gpu`` marker (``mosaic``/``cuda`` also ``hopper``).

A "row" is what the contract keeps invariant: a token row for ``det_matmul``
and ``linear_logp``, a whole sequence (batch entry) for ``causal_attention``.
Every property compares raw bits (atol = rtol = 0) on inputs that reveal any
reordering (rows and columns scaled by powers of two over a wide range), and
a control shows that the ``"xla"`` baseline changes bits on the same inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, bits, wide_rows

import jaxrl_kernels as jk
from jaxrl_kernels import _backend
from jaxrl_kernels.attention import api as attention_api
from jaxrl_kernels.gemm import api as gemm_api
from jaxrl_kernels.linear_logp import api as logp_api

Rows = tuple  # per-row inputs: arrays whose leading axis is the row


@dataclasses.dataclass(frozen=True)
class Op:
  """An op as the suite sees it: per-row inputs, shared operands and a call."""

  name: str
  implementations: tuple[str, ...]
  n: int  # rows of the full batch
  positions: tuple[int, ...]  # where a row is placed in the full batch
  batch_sizes: tuple[int, ...]  # M sweep: prefixes of the full batch
  chunks: tuple[int, ...]  # a split of the full batch, sizes taken from batch_sizes
  padded: int  # real rows of the padding test (one of batch_sizes), padded to n
  mode_rows: int  # rows of the mode and run-to-run tests (one of batch_sizes)
  make_rows: Callable[[int, int, jnp.dtype], Rows]  # (n, seed, dtype) -> rows
  call: Callable[[Rows, str], tuple]  # (rows, implementation) -> outputs, row-major
  # Input dtype per implementation: float32 where the implementation takes it (the
  # stock path's control is strongest there), bf16 for the Hopper-only kernels.
  dtype: Callable[[str], jnp.dtype] = lambda impl: (
      jnp.bfloat16 if impl in ("mosaic", "cuda") else jnp.float32)


def _take(rows: Rows, idx) -> Rows:
  return tuple(x[idx] for x in rows)


def _cat(*parts: Rows) -> Rows:
  return tuple(jnp.concatenate(xs) for xs in zip(*parts))


# det_matmul: K and N multiples of 64 (N >= 256) so that Mosaic takes the weight.
_GEMM_K, _GEMM_N = 192, 256
_GEMM_W = jax.random.normal(jax.random.key(101), (_GEMM_K, _GEMM_N))


def _gemm_rows(n: int, seed: int, dtype) -> Rows:
  return (wide_rows(jax.random.key(seed), n, _GEMM_K, dtype),)


def _gemm_call(rows: Rows, impl: str) -> tuple:
  return (jk.det_matmul(rows[0], _GEMM_W.astype(rows[0].dtype), implementation=impl),)


# linear_logp: V not a multiple of the vocab tile; entropy too.
_LOGP_H, _LOGP_V = 64, 320
_LOGP_W = jax.random.normal(jax.random.key(102), (_LOGP_H, _LOGP_V)) * 0.5


def _logp_rows(n: int, seed: int, dtype) -> Rows:
  k1, k2 = jax.random.split(jax.random.key(seed))
  hidden = wide_rows(k1, n, _LOGP_H, dtype, spread=3)
  return hidden, jax.random.randint(k2, (n,), 0, _LOGP_V, jnp.int32)


def _logp_call(rows: Rows, impl: str) -> tuple:
  return tuple(jk.linear_logp(rows[0], _LOGP_W.astype(rows[0].dtype), rows[1],
                              return_entropy=True, implementation=impl))


# causal_attention: each row a sequence of T tokens (a full Triton key tile and a
# partial one, two query blocks); on a GPU head dim 64, which the Mosaic kernel takes.
_ATT_T, _ATT_HQ, _ATT_HKV = 70, 2, 1
_ATT_D = 16 if _backend.platform() == "cpu" else 64


def _attention_rows(n: int, seed: int, dtype) -> Rows:
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  shape_kv = (n, _ATT_T, _ATT_HKV, _ATT_D)
  q = jax.random.normal(k1, (n, _ATT_T, _ATT_HQ, _ATT_D))
  k = jax.random.normal(k2, shape_kv)
  scale = 2.0 ** jax.random.randint(k4, (n, _ATT_T, _ATT_HKV, 1), -10, 11).astype(jnp.float32)
  v = jax.random.normal(k3, shape_kv) * scale
  return tuple(x.astype(dtype) for x in (q, k, v))


def _attention_call(rows: Rows, impl: str) -> tuple:
  return (jk.causal_attention(*rows, implementation=impl),)


# Few distinct shapes (each is a compilation of the interpreted kernels): the tests
# reuse the batch sizes, and the jitted calls are shared between tests.
_ROWS = dict(n=512, positions=(0, 137, 511), batch_sizes=(1, 7, 130),
             chunks=(1, 7, 130, 130, 130, *(7,) * 16, 1, 1), padded=130, mode_rows=130)
OPS = {
    "det_matmul": Op("det_matmul", gemm_api.IMPLEMENTATIONS, make_rows=_gemm_rows,
                     call=_gemm_call, **_ROWS),
    "linear_logp": Op("linear_logp", logp_api.IMPLEMENTATIONS, make_rows=_logp_rows,
                      call=_logp_call, **_ROWS),
    # Sequences are expensive in interpret mode: 8 of them, a row at the first, an inner
    # and the last position.
    "causal_attention": Op("causal_attention", attention_api.IMPLEMENTATIONS, n=8,
                           positions=(0, 3, 7), batch_sizes=(1, 3), chunks=(1, 3, 1, 3),
                           padded=3, mode_rows=3, make_rows=_attention_rows,
                           call=_attention_call, dtype=lambda impl: jnp.bfloat16),
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
    return f"{op.name} has no {implementation!r} implementation"
  if implementation == "interpret" and _backend.platform() != "cpu":
    return "interpret mode is tested where JAX's default backend is the CPU"
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


@functools.cache
def _jitted(op: Op, impl: str):
  return jax.jit(lambda rows: op.call(rows, impl))


def _assert_rows_equal(got: tuple, want: tuple, what: str):
  for i, (g, w) in enumerate(zip(got, want, strict=True)):
    assert_bitwise_equal(g, w, f"{what} (output {i})")


def test_batch_invariance(op, implementation):
  """Rows of a batch of M equal the same rows of the full batch, for an M sweep that
  includes 1 and sizes that are no multiple of any tile."""
  f = _jitted(op, implementation)
  rows = op.make_rows(op.n, 1, op.dtype(implementation))
  full = f(rows)
  for m in op.batch_sizes:
    _assert_rows_equal(f(_take(rows, slice(0, m))), _take(full, slice(0, m)), f"M={m}")


def test_position_invariance(op, implementation):
  """One row placed at the first, an inner and the last position of the full batch."""
  f = _jitted(op, implementation)
  row = op.make_rows(1, 2, op.dtype(implementation))
  alone = f(row)
  others = op.make_rows(op.n, 3, op.dtype(implementation))
  for pos in op.positions:
    batch = tuple(o.at[pos].set(r[0]) for o, r in zip(others, row))
    _assert_rows_equal(_take(f(batch), slice(pos, pos + 1)), alone, f"position {pos}")


def test_padding_invariance(op, implementation):
  """Random rows prepended and appended change nothing in the real rows."""
  f = _jitted(op, implementation)
  rows = op.make_rows(op.padded, 4, op.dtype(implementation))
  pad = op.make_rows(op.n - op.padded, 5, op.dtype(implementation))
  before = 1
  padded = _cat(_take(pad, slice(0, before)), rows, _take(pad, slice(before, None)))
  out = _take(f(padded), slice(before, before + op.padded))
  _assert_rows_equal(out, f(rows), "padded")


def test_chunking_invariance(op, implementation):
  """The batch processed in chunks of any sizes gives the bits of one call."""
  f = _jitted(op, implementation)
  rows = op.make_rows(op.n, 6, op.dtype(implementation))
  full = f(rows)
  assert sum(op.chunks) == op.n
  starts = np.cumsum((0, *op.chunks))
  parts = [f(_take(rows, slice(a, b))) for a, b in zip(starts[:-1], starts[1:])]
  _assert_rows_equal(tuple(jnp.concatenate(p) for p in zip(*parts)), full, f"chunks {op.chunks}")


def test_mode_invariance(op, implementation):
  """The forward inside a training step (under jax.grad) gives the rollout's bits."""
  rows = op.make_rows(op.mode_rows, 7, op.dtype(implementation))
  forward = _jitted(op, implementation)(rows)
  float_args = [i for i, x in enumerate(rows) if jnp.issubdtype(x.dtype, jnp.floating)]

  def loss(floats):
    args = list(rows)
    for i, x in zip(float_args, floats):
      args[i] = x
    outs = op.call(tuple(args), implementation)
    return sum(jnp.sum(o.astype(jnp.float32)) for o in outs), outs

  grads, in_grad = jax.jit(jax.grad(loss, has_aux=True))([rows[i] for i in float_args])
  assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
  _assert_rows_equal(in_grad, forward, "inside jax.grad")


def test_run_to_run(op, implementation):
  f = _jitted(op, implementation)
  rows = op.make_rows(op.mode_rows, 8, op.dtype(implementation))
  first = [bits(x) for x in f(rows)]
  for _ in range(20):
    for a, b in zip(first, f(rows)):
      assert np.array_equal(a, bits(b))


# ---------------------------------------------------------------------------- controls
# On the CPU, where the suite's small shapes are tuned to reveal XLA's reorderings; the
# GPU controls at large shapes are in tests/gemm/test_det_matmul_gpu.py and
# tests/attention/test_attention_gpu.py.
cpu_only = pytest.mark.skipif(_backend.platform() != "cpu",
                              reason="the controls at these shapes are for the CPU")


def _differs(a: tuple, b: tuple) -> bool:
  return any(not np.array_equal(bits(x), bits(y)) for x, y in zip(a, b))


@cpu_only
@pytest.mark.parametrize("name", ["det_matmul", "linear_logp"])
def test_control_xla_changes_bits_with_the_batch(name):
  """The stock path (jnp.dot, log_softmax) changes some row's bits with the batch size
  on the suite's inputs: the invariance tests above could see a reordering."""
  op = OPS[name]
  f = _jitted(op, "xla")
  rows = op.make_rows(op.n, 1, op.dtype("xla"))
  full = f(rows)
  changed = [r for r in range(0, op.n, 17)
             if _differs(f(_take(rows, slice(r, r + 1))), _take(full, slice(r, r + 1)))]
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


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_decode_and_chunked_prefill(implementation):
  """Attention's own chunking: queries computed one at a time (decode) or in chunks
  against a KV cache holding NaN past ``kv_lengths`` give the prefill's bits."""
  op = OPS["causal_attention"]
  why = skip_reason(op, implementation)
  if why is not None:
    pytest.skip(why)
  q, k, v = op.make_rows(2, 9, op.dtype(implementation))
  t = _ATT_T
  f = jax.jit(lambda q, k, v, pos, kvl: jk.causal_attention(
      q, k, v, q_positions=pos, kv_lengths=kvl, implementation=implementation))
  prefill = jk.causal_attention(q, k, v, implementation=implementation)
  for cuts in ((0, 1, 64, 65, t),):
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
      cached = jnp.arange(t)[None, :, None, None] < hi
      kc, vc = (jnp.where(cached, x, jnp.nan) for x in (k, v))
      pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (2, hi - lo))
      parts.append(f(q[:, lo:hi], kc, vc, pos, jnp.full((2,), hi, jnp.int32)))
    assert_bitwise_equal(jnp.concatenate(parts, 1), prefill, f"chunks {cuts}")
