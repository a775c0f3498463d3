"""``causal_attention``: grouped-query causal attention, bitwise decode = prefill.

The kernels walk fixed key tiles aligned to key 0, in ascending order, with a
float32 online softmax, in query blocks of a fixed number of rows (a decode
step runs a full block, its other rows seeing no key), and one fixed instruction sequence
per block. A key tile that a query row does not reach is skipped exactly for
that row. So the output bits of query ``(b, i, h)`` at position ``p`` depend
only on ``q[b, i, h]``, ``k[b, :last + 1]``, ``v[b, :last + 1]``
(``last = min(p, kv_lengths[b] - 1)``), the dtype, ``D`` and ``scale``; not on
``B``, ``Tq``, ``S``, the other rows, the cache contents past ``last``, whether
the query is computed one at a time against a KV cache (decode), in chunks, or
with its whole sequence (prefill), nor on whether it runs under ``jax.grad``.

Implementations (the table :data:`BACKENDS`, one file each in this folder):
``"mosaic"`` (``mosaic.py``: TMA + wgmma, Hopper, bf16/fp16, ``D`` in
``attention_mosaic.HEAD_DIMS``; the default there), ``"triton"``
(``triton.py``: any CUDA GPU, every dtype, ``D`` a multiple of 16 up to 256),
``"cpu"`` (``cpu.py``: fixed-shape XLA CPU dots, invariant with XLA's default
CPU flags, any ``D``; the CPU default) and ``"interpret"`` (the Triton kernels
run by the Pallas interpreter on the CPU, for tests of their semantics; never
the default). The kernels have different constants (tiles of 64 x 128, 64 x
64, 32 x 128), so their bits differ from each other; each is invariant on its
own. The default picks one by device, dtype and ``D`` only (static, the same
for a model's decode and prefill), never by ``B``, ``Tq`` or ``S``. Gradients
run the backend's backward (for ``"mosaic"``: its own kernels at ``D = 128``, the
Triton ones at other head dims, ``attention_mosaic_bwd.backward``), fed with the
forward's own output and logsumexp. ``"xla"`` (``xla.py``, the materialised
baseline) has none of these guarantees. The float64 truth is ``reference.py``.

Padding never leaks: keys at or past ``kv_lengths`` are never read (they may
hold NaN), and a query that sees no key (position -1) outputs 0 and adds
nothing to any gradient, whatever its ``q`` or ``d_out`` hold. (A key before
``kv_lengths`` that a query does not see is multiplied by an exact 0 in
``P @ V``: finite values change no bit, but a NaN there reaches the query,
unless it lies past the last key any query of the block sees.) Which keys a query sees
is decided from ``q_positions`` and ``kv_lengths``, never from the softmax denominator:
a NaN or inf score of a seen key (or a finite ``q . k`` that overflows) gives a NaN
output and NaN gradients, as stock attention does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend, _validation
from jaxrl_kernels.attention import cpu, mosaic, triton
from jaxrl_kernels.attention.base import AttentionBackend
from jaxrl_kernels.attention.xla import causal_attention_xla
from jaxrl_kernels.pallas import attention_triton

_OP = "causal_attention"
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")

# The one dispatch table: implementation name -> the kernels of its forward and
# backward. ``"xla"`` (attention/xla.py) is plain XLA under jax's own autodiff.
BACKENDS: dict[str, AttentionBackend] = {
    "mosaic": mosaic.BACKEND,
    "triton": triton.TRITON,
    "interpret": triton.INTERPRET,
    "cpu": cpu.BACKEND,
}
IMPLEMENTATIONS = (*BACKENDS, "xla")


# Queries per call from which the kernels take grouped query heads unfolded
# (_grouped_as_rows): a free layout knob, no output bit depends on it. At 512 queries a
# two-warpgroup block of 128 rows per head is at least 80% full.
UNFOLDED_MIN_QUERIES = 512


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  impl: str  # a key of BACKENDS
  # q and the output as [B, H, Tq, D] (the Mosaic forward's ``heads_major``): a decode
  # step's query heads reach its kernel with no copy.
  heads_major: bool = False
  # Every query row sees at least one key (default positions and lengths, Tq <= S): the
  # backward has no padding rows to clear (``AttentionBackend.backward``'s hint).
  every_row_sees_a_key: bool = False


# One jitted function per kernel shape, however many layers call it (_backend.kernel_jit).
@_backend.kernel_jit(static_argnums=(5,))
def _forward(q, k, v, q_positions, kv_lengths, st):
  """``(out, lse2)`` of the forward kernel of ``st.impl``."""
  be = BACKENDS[st.impl]
  if st.heads_major:  # a backend with the layout only (_grouped_as_rows sets it)
    if be.forward_heads_major is None:
      raise ValueError(f"causal_attention: implementation {st.impl!r} has no heads-major "
                       f"forward")
    return be.forward_heads_major(q, k, v, q_positions, kv_lengths, scale=st.scale)
  return be.forward(q, k, v, q_positions, kv_lengths, scale=st.scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_positions, kv_lengths, st):
  return _forward(q, k, v, q_positions, kv_lengths, st)[0]


def _attention_fwd(q, k, v, q_positions, kv_lengths, st):
  # The very kernel of the primal: forward-only and training bits agree.
  out, lse = _forward(q, k, v, q_positions, kv_lengths, st)
  return out, (q, k, v, q_positions, kv_lengths, out, lse)


@_backend.kernel_jit(static_argnums=(8,))
def _backward(q, k, v, q_positions, kv_lengths, out, lse, d_out, st):
  if st.heads_major:  # the backward kernels take [B, Tq, H, D]
    q, out, d_out = (x.transpose(0, 2, 1, 3) for x in (q, out, d_out))
  dq, dk, dv = BACKENDS[st.impl].backward(q, k, v, q_positions, kv_lengths, out, lse, d_out,
                                          scale=st.scale,
                                          every_row_sees_a_key=st.every_row_sees_a_key)
  return (dq.transpose(0, 2, 1, 3) if st.heads_major else dq), dk, dv


def _attention_bwd(st, res, d_out):
  dq, dk, dv = _backward(*res, d_out, st)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _validate(q, k, v, q_positions, kv_lengths, scale, impl):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      want = "[B, Tq, Hq, D]" if name == "q" else "[B, S, Hkv, D]"
      raise ValueError(f"causal_attention: {name} must be {want} (rank 4), got shape {x.shape}")
    if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
      raise TypeError(f"causal_attention: {name} must be one of {_FLOAT_DTYPES}, got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"causal_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"causal_attention: k and v must have the same shape, got {k.shape} and "
                     f"{v.shape}")
  bsz, tq, hq, d = q.shape
  if k.shape[0] != bsz:
    raise ValueError(f"causal_attention: q has batch {bsz} but k/v have {k.shape[0]}")
  if k.shape[3] != d:
    raise ValueError(f"causal_attention: q has head dim {d} but k/v have {k.shape[3]}")
  hkv = k.shape[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(f"causal_attention: the number of query heads ({hq}) must be a multiple "
                     f"of the number of kv heads ({hkv})")
  if impl in ("triton", "interpret", "mosaic") and triton.supported(d, q.dtype) is not None:
    raise ValueError(f"causal_attention: the kernels support head dims that are multiples of 16 "
                     f"in [16, {attention_triton.MAX_HEAD_DIM}], got {d}")
  if q_positions is not None:
    if q_positions.shape != (bsz, tq):
      raise ValueError(f"causal_attention: q_positions must have shape (B, Tq) = {(bsz, tq)}, "
                       f"got {q_positions.shape}")
    if not jnp.issubdtype(q_positions.dtype, jnp.integer):
      raise TypeError(f"causal_attention: q_positions must be integers, got {q_positions.dtype}")
  if kv_lengths is not None:
    if kv_lengths.shape != (bsz,):
      raise ValueError(f"causal_attention: kv_lengths must have shape (B,) = {(bsz,)}, got "
                       f"{kv_lengths.shape}")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
      raise TypeError(f"causal_attention: kv_lengths must be integers, got {kv_lengths.dtype}")
  if scale is None:
    return 1.0 / math.sqrt(d)
  # A static, finite, positive number (it is part of the kernels' jit cache key).
  return _validation.as_scalar(_OP, "scale", scale, positive=True, allow_traced=False)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     q_positions: jax.Array | None = None, kv_lengths: jax.Array | None = None,
                     scale: float | None = None, implementation: str | None = None) -> jax.Array:
  """Causal grouped-query attention over left-aligned keys.

  ``out[b, i, h] = sum_j softmax_j(scale q[b, i, h] . k[b, j, h // G]) v[b, j, h // G]``
  over the keys ``j`` the query sees: ``j <= q_positions[b, i]`` and
  ``j < kv_lengths[b]`` (``G = Hq // Hkv``). A query that sees no key (e.g.
  position -1 for padding) outputs exactly 0 and gets zero gradient.

  Args:
    q: ``[B, Tq, Hq, D]`` bf16, fp16 or fp32.
    k, v: ``[B, S, Hkv, D]``, q's dtype; key ``j`` sits at position ``j``.
    q_positions: ``[B, Tq]`` int, default ``S - Tq + arange(Tq)`` (the queries
      are the last ``Tq`` tokens; ``Tq == S`` is a prefill).
    kv_lengths: ``[B]`` int, default ``S``: keys at or past it are never read
      (a KV cache may hold garbage there, NaN included).
    scale: static positive finite number, default ``1 / sqrt(D)``.
    implementation: ``"mosaic"`` (Hopper, bf16/fp16, ``D`` in {64, 128}; the
      default there, other head dims and fp32 default to ``"triton"``),
      ``"triton"`` (any CUDA GPU; ``D`` a multiple of 16 up to 256),
      ``"cpu"`` (XLA CPU code, any ``D``; the CPU default), ``"interpret"``
      (the Triton kernels on CPU, for tests) or ``"xla"`` (materialised
      baseline; not invariant, never the default). One that
      cannot run here raises ``_backend.ImplementationUnavailableError``.

  Returns:
    ``[B, Tq, Hq, D]`` in q's dtype; bitwise decode/prefill-, batch-, padding-,
    chunk- and mode-invariant for ``"mosaic"``, ``"triton"``, ``"cpu"`` and
    ``"interpret"`` (each on its own; module docstring).

  Gradients w.r.t. q, k, v (``jax.custom_vjp``, flash-attention style backward
  recomputing the probabilities from the saved logsumexp; deterministic run to
  run, for ``"cpu"`` dq rows are batch-invariant; dk/dv sum over the rows of a
  batch entry).
  No forward-mode ``jax.jvp``.

  >>> import jax.numpy as jnp
  >>> q = k = v = jnp.ones((1, 3, 2, 16))
  >>> causal_attention(q, k, v, implementation="cpu").shape
  (1, 3, 2, 16)
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  q_positions = None if q_positions is None else jnp.asarray(q_positions)
  kv_lengths = None if kv_lengths is None else jnp.asarray(kv_lengths)
  impl = _backend.resolve(_OP, implementation, q.dtype, supported=IMPLEMENTATIONS)
  scale = _validate(q, k, v, q_positions, kv_lengths, scale, impl)
  if impl == "mosaic":
    why = mosaic.BACKEND.supported(q.shape[3], q.dtype)
    if why is not None:
      if implementation == "mosaic":
        raise ValueError(f"causal_attention: implementation='mosaic' does not support this "
                         f"input: {why}; use implementation='triton'")
      # The default routes by dtype and head dim only (static, equal for a model's
      # decode and prefill), never by B, Tq or S.
      impl = "triton"
  bsz, tq, _, _ = q.shape
  s_len = k.shape[1]
  # The default positions S - Tq + i with the default lengths S: every query sees key 0
  # when Tq <= S, so no row is padding (a static hint to the backward; same bits).
  every_row = q_positions is None and kv_lengths is None and tq <= s_len
  if q_positions is None:
    q_positions = jnp.broadcast_to(s_len - tq + jnp.arange(tq, dtype=jnp.int32), (bsz, tq))
  if kv_lengths is None:
    kv_lengths = jnp.full((bsz,), s_len, jnp.int32)
  q_positions = q_positions.astype(jnp.int32)
  kv_lengths = kv_lengths.astype(jnp.int32)
  if impl == "xla":
    return causal_attention_xla(q, k, v, q_positions, kv_lengths, scale=scale)
  if q.size == 0 or s_len == 0:
    return jnp.zeros_like(q)
  return _grouped_as_rows(q, k, v, q_positions, kv_lengths,
                          _Static(scale, impl, every_row_sees_a_key=every_row))


def _grouped_as_rows(q, k, v, q_positions, kv_lengths, st):
  """The kernel call; below ``UNFOLDED_MIN_QUERIES`` queries, with each KV group's query
  heads as rows of one head.

  ``q [B, T, Hkv * G, D]`` is presented to the kernels as ``[B, T * G, Hkv, D]`` (row
  ``t * G + g`` is query ``t`` of head ``h * G + g``, at position ``q_positions[b, t]``),
  so one kernel program serves a whole group: a decode step fills ``G`` rows of a query
  block instead of one, and each KV tile is read once per group instead of ``G`` times.
  The kernels' instructions are unchanged, and a row's bits do not depend on which block
  slot it occupies or on its block-mates (the contract's decode == prefill, batch and
  chunking invariances), so every output row has the bits of the unfolded call
  (``tests/attention/test_attention.py::test_group_folding_keeps_the_bits``). Gradients:
  ``dq`` rows likewise; ``dk``/``dv`` sum over the group's rows in the folded order.
  A one-query call on the Mosaic kernel takes the heads-major form ``[B, Hkv, G, D]`` of
  the same rows instead (``attention_mosaic.forward(heads_major=True)``): a reshape of
  ``q``, no copy, and the same bits.

  From ``UNFOLDED_MIN_QUERIES`` queries on (a prefill, a training row) the kernels take
  ``q`` as it is, each program on one query head (``h // G`` selects its K/V): its
  query blocks are full without the fold, and the forward makes no transposed copy;
  neither does either backward: the fold's four copies of ``q``, the output, ``d_out`` and
  ``dq`` are passes over memory the unfolded layout does not make
  (``benchmarks/results/attention.md``). Same output and ``dq`` bits either way (the
  paragraph above); ``dk``/``dv`` sum the group's rows in another order than the folded
  one (the Triton backward head by head, the Mosaic one block by block with the heads
  inner).
  """
  bsz, tq, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  if tq == 1 and st.impl == "mosaic":
    # One query per row: [B, 1, Hkv * G, D] is [B, Hkv, G, D] in memory, each KV head's
    # G query heads its rows (heads-major), a reshape rather than a transposed copy.
    rows = q.reshape(bsz, hkv, group, d)
    out = _attention(rows, k, v, jnp.repeat(q_positions, group, axis=1), kv_lengths,
                     dataclasses.replace(st, heads_major=True))
    return out.reshape(bsz, 1, hq, d)
  if group == 1 or tq >= UNFOLDED_MIN_QUERIES:
    return _attention(q, k, v, q_positions, kv_lengths, st)
  out = _attention(attention_triton.fold_groups(q, group), k, v,
                   jnp.repeat(q_positions, group, axis=1), kv_lengths, st)
  return attention_triton.unfold_groups(out, group)
