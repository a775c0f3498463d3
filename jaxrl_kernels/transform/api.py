"""``batch_invariant``: a function transformation that makes a JAX model's results
independent of the batch, of padding and of decode vs prefill (docs/transform.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from jaxrl_kernels import _backend
from jaxrl_kernels.transform import attention, interpreter
from jaxrl_kernels.transform.rules import Options


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, core.Tracer))


def _static_key(x) -> Any:
  """A static argument's cache key: its type and its bits, as ``jax.jit`` keys them
  (2 and 2.0, 1 and True, 0.0 and -0.0 are different programs)."""
  if isinstance(x, float):
    return (type(x), x.hex())
  if isinstance(x, complex):
    return (type(x), x.real.hex(), x.imag.hex())
  return (type(x), x)


def _differentiable(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


class _Rewritten:
  """One traced and rewritten program: ``fn`` at one set of input types."""

  def __init__(self, closed: core.ClosedJaxpr, out_tree, opts: Options):
    left: list[str] = []
    self.jaxpr = interpreter.rewrite_closed_jaxpr(closed, opts, left)
    interpreter.warn_left(left)
    self.out_tree = out_tree
    self.opts = opts
    in_avals = self.jaxpr.in_avals
    self.diff = [_differentiable(a) for a in in_avals]
    self.out_diff = [_differentiable(a) for a in self.jaxpr.out_avals]
    self.call = jax.jit(self._call)

  def _split(self, xs):
    return ([x for x, d in zip(xs, self.diff) if d], [x for x, d in zip(xs, self.diff) if not d])

  def _merge(self, diff, rest):
    diff, rest = iter(diff), iter(rest)
    return [next(diff) if d else next(rest) for d in self.diff]

  def _call(self, *xs):
    return list(self._run(*xs))

  @functools.cached_property
  def _run(self):
    fun = core.jaxpr_as_fun(self.jaxpr)

    # The backward is the VJP of the rewritten program, itself rewritten: the
    # transposes of broadcasts (sums) and of gathers (scatter-adds) in it get
    # the fixed-order forms too.
    @jax.custom_vjp
    def run(*xs):
      return fun(*xs)

    def run_fwd(*xs):
      diff, rest = self._split(xs)
      out, vjp_fn = jax.vjp(lambda *d: fun(*self._merge(d, rest)), *diff)
      return out, vjp_fn

    def run_bwd(vjp_fn, cts):
      cts = [c for c, d in zip(cts, self.out_diff) if d]

      def backward(vjp_fn, cts):
        it = iter(cts)
        full = [next(it) if d else np.zeros(a.shape, jax.dtypes.float0)
                for d, a in zip(self.out_diff, self.jaxpr.out_avals)]
        return vjp_fn(full)

      closed, out_shape = jax.make_jaxpr(backward, return_shape=True)(vjp_fn, cts)
      left: list[str] = []
      rewritten = interpreter.rewrite_closed_jaxpr(closed, self.opts, left)
      interpreter.warn_left(left)
      flat = core.jaxpr_as_fun(rewritten)(*jax.tree.leaves((vjp_fn, cts)))
      grads = jax.tree.unflatten(jax.tree.structure(out_shape), flat)
      return tuple(self._merge(grads, [None] * (len(self.diff) - len(grads))))

    run.defvjp(run_fwd, run_bwd)
    return run


def batch_invariant(fn: Callable | None = None, *, implementation: str | None = None,
                    strict: bool = True) -> Callable:
  """Transforms ``fn`` so that every reduction in it runs in a fixed order.

  ``batch_invariant(fn)`` has ``fn``'s signature and returns the same pytrees.
  On each call it traces ``fn`` to a jaxpr (cached by the input types and
  pytree structure) and runs it with every primitive whose result depends on
  a reduction order replaced:

  * ``dot_general`` (every dimension-number form, float inputs) by
    ``det_matmul``: batch dims vmapped, a fixed K tile walked from index 0;
  * ``reduce_sum``/``reduce_prod`` (``jnp.sum``, ``jnp.mean``, softmax and
    logsumexp denominators) by :func:`jaxrl_kernels.reduce.det_sum`/``det_prod``;
  * ``cumsum``/``cumprod``/``cumlogsumexp`` by their fixed-order forms;
  * scatter-add with repeated indices by an ordered loop.

  Reductions whose result does not depend on the order (max, min, argmax,
  argmin, cummax, integer sums) and element-wise ops are kept. Inner jaxprs
  (``jit``, ``cond``, ``while``, ``scan``, ``remat``, custom JVP/VJP functions)
  are rewritten too. The gradient (``jax.grad`` of the result) is the VJP of
  the rewritten program with its own sums and scatter-adds rewritten as well.
  Forward-mode differentiation (``jax.jvp``) is not supported.

  A row of every result is then bitwise the same whatever the other rows of
  the batch hold and however many there are, and a sum over keys gives the
  same bits when masked (exactly zero) keys are appended, so one-token decode
  against a zero-initialised KV cache matches the full forward.

  Arguments that are not arrays (Python numbers, strings, flags) are static:
  a new value traces ``fn`` again.

  Args:
    fn: the function to transform; None to use ``batch_invariant(...)`` as a
      decorator with arguments.
    implementation: the kernels' implementation for every rewritten op
      (``"mosaic"``, ``"triton"``, ``"interpret"``, ``"cuda"``, ``"cpu"``), or
      None (by device, as every op of the library).
    strict: raise ``NotImplementedError`` (naming the primitive and its source
      line) on an order-dependent primitive without a rewrite; False keeps it
      as it is with a :class:`NotRewrittenWarning`.

  >>> import jax.numpy as jnp
  >>> f = batch_invariant(lambda x, w: jnp.mean(x @ w, axis=-1))
  >>> f(jnp.ones((2, 4)), jnp.ones((4, 3))).tolist()
  [4.0, 4.0]
  """
  if fn is None:
    return functools.partial(batch_invariant, implementation=implementation, strict=strict)
  if not callable(fn):
    raise TypeError(f"batch_invariant: fn must be callable, got {type(fn).__name__}")
  if not isinstance(strict, (bool, np.bool_)):
    raise TypeError(f"batch_invariant: strict must be a bool, got {strict!r}")
  if implementation is not None and implementation not in _backend.IMPLEMENTATIONS:
    raise ValueError(f"batch_invariant: implementation must be one of "
                     f"{_backend.IMPLEMENTATIONS} or None, got {implementation!r}")
  if implementation == "xla":
    raise ValueError("batch_invariant: implementation='xla' is the stock, order-dependent "
                     "path; call fn itself for it")
  opts = Options(implementation=implementation, strict=bool(strict))
  cache: dict[Any, _Rewritten] = {}

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_pos = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    dyn = [leaves[i] for i in dyn_pos]
    static = tuple((i, _static_key(leaf)) for i, leaf in enumerate(leaves)
                   if not _is_array(leaf))
    avals = tuple(core.shaped_abstractify(x) for x in dyn)

    try:
      key = (treedef, static, avals)
      hash(key)
    except TypeError:
      key = None
    entry = cache.get(key) if key is not None else None
    if entry is None:
      out_tree_box = []

      def traced(*xs):
        full = list(leaves)
        for i, x in zip(dyn_pos, xs):
          full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        out = fn(*a, **k)
        flat, tree = jax.tree.flatten(out)
        out_tree_box.append(tree)
        return flat

      # jax.nn.dot_product_attention leaves no trace of itself in a jaxpr: mark it.
      with attention.intercepting():
        closed = jax.make_jaxpr(traced)(*dyn)  # abstracts them, shardings included
      entry = _Rewritten(closed, out_tree_box[0], opts)
      # A program that closes over another trace's values lives as long as that trace.
      if key is not None and not any(isinstance(c, core.Tracer) for c in closed.consts):
        cache[key] = entry
    return jax.tree.unflatten(entry.out_tree, entry.call(*dyn))

  return wrapped
