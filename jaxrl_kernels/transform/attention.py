"""``jax.nn.dot_product_attention`` under ``batch_invariant``: the library's
:func:`~jaxrl_kernels.causal_attention` where the arguments fit, the rewritten
einsum + softmax form otherwise.

How the call shows in a jaxpr (jax 0.10 and 0.11 alike):

* ``implementation=None`` / ``"xla"``: inlined as plain equations (a
  ``dot_general`` over a ``[B, T, K, G, H]`` view of the queries, the mask as a
  ``select_n``, ``jax.nn.softmax``'s ``reduce_max``/``exp``/``reduce_sum``, a
  second ``dot_general``): nothing names it. So while ``batch_invariant`` traces
  the user's function, ``jax.nn.dot_product_attention`` is a thin wrapper
  (:func:`intercepting`) that emits the stock call inside a ``jit`` whose name
  records the call's static arguments (:class:`AttentionCall`). Run anywhere
  else, that ``jit`` is the stock computation; the interpreter replaces it. A
  reference to the function taken before the trace (``from jax.nn import
  dot_product_attention``) is not intercepted: its XLA form is rewritten as code.
* ``implementation="cudnn"``: a ``custom_vjp_call`` of ``_dot_product_attention``
  whose body is one ``dot_product_attention_fwd_wrapper`` equation (the cuDNN
  custom call) with the mask type, layout, scale and window as parameters.
  :func:`rewrite_call` recognises that form wherever it appears.

Mapping to ``causal_attention`` (which sees key ``j`` from query ``i`` when
``j <= q_positions[b, i]`` and ``j < kv_lengths[b]``): jax's causal mask is
``tril(ones(T, S))`` (query ``i`` sees keys ``j <= i``), so ``q_positions =
arange(T)``; without it ``q_positions = S - 1`` (every key); query rows at or
past ``query_seq_lengths`` get position -1 (output 0, as jax zeroes them);
``key_value_seq_lengths`` clipped to ``[0, S]`` is ``kv_lengths``. It fits for
q, k, v of rank 4 (``BTNH``) or 3 (``TNH``) in one of bf16/fp16/fp32, no ``bias``/``mask``/
``local_window_size``, no ``return_residual``, a static positive scale, and a
head dim the kernels that would run take (multiples of 16 up to 256 on a GPU;
any on the CPU). One difference is not a reduction order: a query that sees no
key at all (``key_value_seq_lengths = 0``) gets 0 here, where jax's XLA form
averages every value (a softmax over equal large negative logits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from jaxrl_kernels import _backend
from jaxrl_kernels.attention import api as attention_api
from jaxrl_kernels.transform.rules import Options, Unsupported

#: The name prefix of the ``jit`` that marks an intercepted call.
MARKER = "batch_invariant_dot_product_attention"
#: The primitive of jax's cuDNN attention forward (inside a ``custom_vjp_call``).
CUDNN_PRIMITIVE = "dot_product_attention_fwd_wrapper"
_DTYPES = ("bfloat16", "float16", "float32")
_STOCK = jax.nn.dot_product_attention


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """The static arguments of one ``jax.nn.dot_product_attention`` call that may fit.

  The marker ``jit`` takes ``(q, k, v, [query_seq_lengths], [key_value_seq_lengths])``.
  """

  is_causal: bool
  scale: float | None
  has_q_lengths: bool
  has_kv_lengths: bool
  implementation: str | None  # jax's: None, "xla" or "cudnn"


_lock = threading.Lock()
_calls: dict[str, AttentionCall] = {}
_installed = 0
_state = threading.local()


@functools.cache
def _marker(call: AttentionCall) -> Callable:
  """The ``jit`` of the stock call, named after ``call`` (one per distinct call)."""

  def stock(q, k, v, *lengths):
    it = iter(lengths)
    q_len = next(it) if call.has_q_lengths else None
    kv_len = next(it) if call.has_kv_lengths else None
    return _STOCK(q, k, v, scale=call.scale, is_causal=call.is_causal,
                  query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                  implementation=call.implementation)

  with _lock:
    name = f"{MARKER}_{len(_calls)}"
    _calls[name] = call
  stock.__name__ = stock.__qualname__ = name
  return jax.jit(stock)


def _static_scale(scale) -> bool:
  """A Python or NumPy number, finite and positive (``causal_attention`` takes a static one)."""
  if scale is None:
    return True
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
    return False
  return math.isfinite(float(scale)) and float(scale) > 0


# Stands in for jax.nn.dot_product_attention while batch_invariant traces (its signature).
@functools.wraps(_STOCK)
def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
  kwargs = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                implementation=implementation, return_residual=return_residual)
  if not getattr(_state, "depth", 0):  # another thread, not tracing for batch_invariant
    return _STOCK(query, key, value, bias, mask, **kwargs)
  ranks = {jnp.ndim(x) for x in (query, key, value)}
  fits = (bias is None and mask is None and local_window_size is None and not return_residual
          and isinstance(is_causal, bool) and _static_scale(scale) and ranks in ({3}, {4}))
  if not fits:
    if implementation == "cudnn":  # the cuDNN kernel's order is its own: the XLA form
      kwargs["implementation"] = "xla"
    return _STOCK(query, key, value, bias, mask, **kwargs)
  call = AttentionCall(is_causal, None if scale is None else float(scale),
                       query_seq_lengths is not None, key_value_seq_lengths is not None,
                       implementation)
  lengths = [x for x in (query_seq_lengths, key_value_seq_lengths) if x is not None]
  if ranks == {3}:  # [T, N, H]: a batch of one, as jax reads it
    return _marker(call)(*(jnp.asarray(x)[None] for x in (query, key, value)), *lengths)[0]
  return _marker(call)(query, key, value, *lengths)


@contextlib.contextmanager
def intercepting():
  """While active on this thread, ``jax.nn.dot_product_attention`` emits the marker.

  Other threads calling it meanwhile get the stock function (the wrapper checks
  a thread-local depth), so the patch is invisible outside the trace.
  """
  global _installed
  with _lock:
    if _installed == 0:
      jax.nn.dot_product_attention = dot_product_attention
    _installed += 1
  _state.depth = getattr(_state, "depth", 0) + 1
  try:
    yield
  finally:
    _state.depth -= 1
    with _lock:
      _installed -= 1
      if _installed == 0:
        jax.nn.dot_product_attention = _STOCK


def _implementation(opts: Options, dtype, d: int) -> tuple[bool, str | None]:
  """(fits, the ``causal_attention`` implementation) for ``opts`` at this dtype and D."""
  impl = opts.implementation if opts.implementation in attention_api.BACKENDS else None
  kernels = impl in ("mosaic", "triton", "interpret") or (
      impl is None and _backend.platform() == "gpu")
  if kernels and attention_api.BACKENDS["triton"].supported(d, dtype) is not None:
    return False, None
  if impl == "mosaic" and attention_api.BACKENDS["mosaic"].supported(d, dtype) is not None:
    impl = "triton"  # the Mosaic kernel's head dims and dtypes are a subset
  return True, impl


def fitting_implementation(opts: Options, q, k, v) -> tuple[bool, str | None]:
  """(fits, the ``causal_attention`` implementation) for q ``[B, T, N, H]`` and k, v
  ``[B, S, K, H]`` (arrays or avals): one float dtype, ``N`` a multiple of ``K``, no
  empty axis, a head dim the kernels that would run take."""
  if not all(len(x.shape) == 4 for x in (q, k, v)) or not q.dtype == k.dtype == v.dtype:
    return False, None
  if jnp.dtype(q.dtype).name not in _DTYPES or k.shape != v.shape:
    return False, None
  b, _, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  if (k.shape[0] != b or k.shape[3] != d or hkv == 0 or hq % hkv or math.prod(q.shape) == 0
      or s == 0):
    return False, None
  return _implementation(opts, q.dtype, d)


def library_attention(opts: Options, q, k, v, *, is_causal: bool, scale: float | None,
                      q_lengths=None, kv_lengths=None):
  """``jax.nn.dot_product_attention`` (BTNH) as ``causal_attention``, or None if it
  does not fit (module docstring)."""
  fits, impl = fitting_implementation(opts, q, k, v)
  if not fits:
    return None
  b, t, _, d = q.shape
  s = k.shape[1]
  rows = jnp.arange(t, dtype=jnp.int32)
  pos = rows if is_causal else jnp.full((t,), s - 1, jnp.int32)
  pos = jnp.broadcast_to(pos, (b, t))
  if q_lengths is not None:
    pos = jnp.where(rows[None, :] < q_lengths.astype(jnp.int32)[:, None], pos, -1)
  if kv_lengths is not None:
    kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, s)
  return attention_api.causal_attention(
      q, k, v, q_positions=pos, kv_lengths=kv_lengths,
      scale=1.0 / math.sqrt(d) if scale is None else scale, implementation=impl)


def _marker_call(opts: Options, eqn, invals):
  call = _calls.get(eqn.params.get("name"))
  n_in = 3 + call.has_q_lengths + call.has_kv_lengths if call else 0
  if call is None or len(invals) != n_in or len(eqn.outvars) != 1:
    return None  # not ours, or transformed inside fn (vmap, jvp): its body is rewritten
  q, k, v, *lengths = invals
  q_len = lengths.pop(0) if call.has_q_lengths else None
  kv_len = lengths.pop(0) if call.has_kv_lengths else None
  out = library_attention(opts, q, k, v, is_causal=call.is_causal, scale=call.scale,
                          q_lengths=q_len, kv_lengths=kv_len)
  return None if out is None else [out]


def _cudnn_call(opts: Options, eqn, invals, rewrite: Callable):
  """A ``custom_vjp_call`` wrapping jax's cuDNN attention forward, as ours or as the
  rewritten XLA form; None for any other ``custom_vjp_call``."""
  closed = eqn.params["call_jaxpr"]
  inner = closed.jaxpr
  if len(inner.eqns) != 1 or inner.eqns[0].primitive.name != CUDNN_PRIMITIVE:
    return None
  fwd = inner.eqns[0]
  env = dict(zip(inner.constvars, closed.consts))
  env.update(zip(inner.invars, invals[eqn.params.get("num_consts", 0):]))
  args = [a.val if isinstance(a, core.Literal) else env[a] for a in fwd.invars]
  q, k, v, bias, q_len, kv_len, *rest = args
  p = fwd.params
  if p["dropout_rate"] or any(x.size for x in rest) or len(fwd.outvars) != 1:
    raise Unsupported("cuDNN attention with dropout, packed segments, pages or a residual")
  if len(inner.outvars) != 1 or inner.outvars[0] is not fwd.outvars[0]:
    return None
  bnth = int(getattr(p["layout"], "value", p["layout"])) == 1
  if bnth:  # [B, N, T, H] -> [B, T, N, H]
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  mask = getattr(p["mask_type"], "name", str(p["mask_type"]))
  if mask not in ("NO_MASK", "PADDING", "CAUSAL", "PADDING_CAUSAL"):
    raise Unsupported(f"cuDNN attention with mask type {mask}")
  is_causal = "CAUSAL" in mask
  padded = "PADDING" in mask
  q_len, kv_len = (q_len, kv_len) if padded else (None, None)
  has_bias = bool(p["variadic_args"][0])
  window = p["sliding_window_length"]
  out = None
  if not has_bias and window is None:
    out = library_attention(opts, q, k, v, is_causal=is_causal, scale=float(p["scale"]),
                            q_lengths=q_len, kv_lengths=kv_len)
  if out is None:
    def xla(q, k, v, bias, q_len, kv_len):
      return _STOCK(q, k, v, bias if has_bias else None, scale=float(p["scale"]),
                    is_causal=is_causal, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                    local_window_size=None if window is None else (window - 1, 0),
                    implementation="xla")
    out = rewrite(xla, q, k, v, bias, q_len, kv_len)[0]
  if bnth:
    out = jnp.swapaxes(out, 1, 2)
  return [out.astype(eqn.outvars[0].aval.dtype)]


#: Primitives that may hold an attention call.
CALL_PRIMITIVES = ("jit", "pjit", "custom_vjp_call")


def rewrite_call(opts: Options, eqn, invals, rewrite: Callable):
  """The outputs of ``eqn`` as the library's attention (or the rewritten XLA form of a
  cuDNN call), or None to rewrite ``eqn`` as any other call.

  ``rewrite(fn, *args)`` traces ``fn`` and evaluates it with every rule applied.
  """
  if eqn.primitive.name == "custom_vjp_call":
    return _cudnn_call(opts, eqn, invals, rewrite)
  return _marker_call(opts, eqn, invals)
