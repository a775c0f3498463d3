"""Re-emits a jaxpr with every reduction-order-dependent primitive rewritten.

``rewrite_closed_jaxpr`` walks the equations of a jaxpr; an equation whose
primitive has a rule in :mod:`jaxrl_kernels.transform.rules` is replaced by the
rule's output, an equation that holds jaxprs (``jit``, ``cond``, ``while``,
``scan``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ...)
is bound again with each inner jaxpr rewritten the same way, and every other
equation is bound as it is. A call of ``jax.nn.dot_product_attention`` (its
marked ``jit``, or jax's cuDNN ``custom_vjp_call``) becomes the library's
attention where it fits (:mod:`jaxrl_kernels.transform.attention`), and so does
attention written by hand in einsum + mask + softmax + einsum, where the jaxpr proves it
(:mod:`jaxrl_kernels.transform.einsum_attention`).
The library's own kernel calls (``jit`` functions named by
:func:`jaxrl_kernels._backend.kernel_jit`) are bound as they are: they hold the contract.
Custom derivative rules are kept; the jaxprs they produce (a custom JVP, a custom
VJP's forward) are rewritten when JAX asks for them, so the forward alone and the
forward inside a training step run the same rewritten primitives.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from jaxrl_kernels import _backend
from jaxrl_kernels.transform import attention, einsum_attention
from jaxrl_kernels.transform import rules as rules_mod
from jaxrl_kernels.transform.rules import Options, Unsupported


class NotRewrittenWarning(RuntimeWarning):
  """``batch_invariant(strict=False)`` left an order-dependent primitive as it is."""


def _where(eqn) -> str:
  where = source_info_util.summarize(eqn.source_info)
  return where or "(no user source line: JAX built this equation)"


def _sub_jaxprs(params: dict) -> bool:
  for v in params.values():
    if isinstance(v, (core.Jaxpr, core.ClosedJaxpr)):
      return True
    if isinstance(v, tuple) and v and all(isinstance(b, core.ClosedJaxpr) for b in v):
      return True
  return False


def needs_rewrite(jaxpr: core.Jaxpr) -> bool:
  """Whether any equation (at any depth) has a rule or is unsupported."""
  guarded = _backend.platform() == "cpu"  # element-wise rules apply on the CPU only
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in rules_mod.UNSUPPORTED or (
        name in rules_mod.RULES and (guarded or name not in rules_mod.ELEMENTWISE)):
      return True
    for v in eqn.params.values():
      for sub in (v if isinstance(v, tuple) else (v,)):
        if isinstance(sub, core.ClosedJaxpr) and needs_rewrite(sub.jaxpr):
          return True
        if isinstance(sub, core.Jaxpr) and needs_rewrite(sub):
          return True
  return False


def _trace(fun, in_avals: Sequence[Any], debug_info) -> core.ClosedJaxpr:
  # (jaxpr, out_avals, consts, ...): later jax versions may append fields
  traced = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=debug_info), list(in_avals))
  return core.ClosedJaxpr(traced[0], traced[2])


def rewrite_closed_jaxpr(closed: core.ClosedJaxpr, opts: Options,
                         left: list[str]) -> core.ClosedJaxpr:
  """``closed`` with the same input and output types and every rule applied."""
  if not needs_rewrite(closed.jaxpr):
    return closed

  def fun(*args):
    return eval_jaxpr(closed.jaxpr, closed.consts, args, opts, left)

  return _trace(fun, closed.in_avals, closed.jaxpr.debug_info)


def _rewrite_open_jaxpr(jaxpr: core.Jaxpr, opts: Options, left: list[str]) -> core.Jaxpr:
  if not needs_rewrite(jaxpr):
    return jaxpr
  closed = rewrite_closed_jaxpr(core.ClosedJaxpr(jaxpr, ()), opts, left)
  if closed.consts:  # an open jaxpr (remat, shard_map) has nowhere to keep them
    raise Unsupported("the rewritten inner jaxpr captured constants")
  return closed.jaxpr


def _rewrap_thunk(thunk, opts: Options, left: list[str]):
  """A custom VJP's forward thunk whose jaxpr comes back rewritten (the forward runs on
  primal values only, so its fixed-order kernels are never transposed)."""

  def rewritten(*args):
    out = thunk.call_wrapped(*args)
    jaxpr, consts, rest = out[0], out[1], out[2:]
    closed = rewrite_closed_jaxpr(core.ClosedJaxpr(jaxpr, consts), opts, left)
    return (closed.jaxpr, closed.consts, *rest)

  return lu.wrap_init(rewritten, debug_info=thunk.debug_info)


def _jvp_thunk(thunk, call: core.ClosedJaxpr, num_consts: int):
  """A custom JVP rule's jaxpr thunk whose primal outputs are ``call`` (the rewritten
  function) and whose tangents are the rule's own.

  The tangents are left as the rule computes them: JAX transposes them, and a
  fixed-order kernel (a custom VJP) has no transpose. ``batch_invariant``'s
  backward rewrites the transposed program instead.
  """
  if num_consts:
    raise Unsupported("a custom_jvp function with closed-over constants")

  def rewritten(*zeros):
    jaxpr, consts, out_zeros = thunk.call_wrapped(*zeros)
    jvp = core.ClosedJaxpr(jaxpr, consts)
    n_in, n_out = len(call.in_avals), len(out_zeros)

    def fun(*args):
      outs = core.jaxpr_as_fun(jvp)(*args)
      return [*core.jaxpr_as_fun(call)(*args[:n_in]), *outs[n_out:]]

    closed = _trace(fun, jvp.in_avals, jaxpr.debug_info)
    return closed.jaxpr, closed.consts, out_zeros

  return lu.wrap_init(rewritten, debug_info=thunk.debug_info)


def _manual_axes_context(params: dict):
  """The axis environment and mesh a ``shard_map`` body is traced in (for its
  collectives), built as ``jax.shard_map`` builds it."""
  import contextlib

  from jax._src import config
  from jax._src import shard_map as shard_map_lib
  from jax._src.mesh import use_abstract_mesh
  try:
    mesh, manual = params["mesh"], params["newly_manual_axes"]
    stack = contextlib.ExitStack()
    stack.enter_context(shard_map_lib._extend_axis_env(mesh, manual))
    stack.enter_context(use_abstract_mesh(shard_map_lib._as_manual_mesh(mesh, manual)))
    stack.enter_context(config._check_vma(params["check_vma"]))
  except (AttributeError, KeyError, TypeError) as e:
    raise Unsupported(f"a shard_map of this jax version ({e}); apply batch_invariant to the "
                      "function inside shard_map instead") from None
  return stack


def _rewrite_params(eqn, opts: Options, left: list[str]) -> dict:
  if eqn.primitive.name == "shard_map":
    with _manual_axes_context(eqn.params):
      return _rewrite_params_in_context(eqn, opts, left)
  return _rewrite_params_in_context(eqn, opts, left)


def _rewrite_params_in_context(eqn, opts: Options, left: list[str]) -> dict:
  params = dict(eqn.params)
  for key, v in eqn.params.items():
    if isinstance(v, core.ClosedJaxpr):
      params[key] = rewrite_closed_jaxpr(v, opts, left)
    elif isinstance(v, core.Jaxpr):
      params[key] = _rewrite_open_jaxpr(v, opts, left)
    elif (isinstance(v, tuple) and any(isinstance(b, core.ClosedJaxpr) for b in v)
          and all(b is None or isinstance(b, core.ClosedJaxpr) for b in v)):
      # custom_linear_solve holds a namedtuple (matvec, vecmat, solve, transpose_solve)
      # with None for absent members: keep its type.
      new = [None if b is None else rewrite_closed_jaxpr(b, opts, left) for b in v]
      params[key] = type(v)._make(new) if hasattr(type(v), "_make") else tuple(new)
  name = eqn.primitive.name
  if name == "custom_jvp_call":
    params["jvp_jaxpr_fun"] = _jvp_thunk(eqn.params["jvp_jaxpr_fun"], params["call_jaxpr"],
                                         eqn.params["num_consts"])
  elif name == "custom_vjp_call":
    params["fwd_jaxpr_thunk"] = _rewrap_thunk(eqn.params["fwd_jaxpr_thunk"], opts, left)
  return params


def _bind(eqn, params: dict, invals):
  bound = eqn.primitive.get_bind_params(params)
  if isinstance(bound, tuple):  # (subfuns, params) in older jax versions
    subfuns, bound = bound
    return eqn.primitive.bind(*subfuns, *invals, **bound)
  return eqn.primitive.bind(*invals, **bound)


def _not_rewritten(eqn, why: str, opts: Options, left: list[str]) -> None:
  msg = f"{eqn.primitive.name} ({why}) at {_where(eqn)}"
  if opts.strict:
    raise NotImplementedError(
        f"batch_invariant: cannot make {msg} batch-invariant; pass strict=False to keep it "
        "as it is (its bits may then depend on the batch)")
  left.append(msg)


#: Primitives whose output is a rearrangement (or a cast) of their first operand: a weight
#: passed through them is still a weight.
_LAYOUT = frozenset({
    "transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
    "slice", "dynamic_slice", "gather", "copy", "copy_p", "rev", "reduce_precision"})


def activation_products(jaxpr: core.Jaxpr) -> set[int]:
  """The indices of the ``dot_general`` equations of ``jaxpr`` that multiply two activations.

  A weight is an input of ``jaxpr`` (or a constant), possibly rearranged (:data:`_LAYOUT`:
  transposed, reshaped, cast, sliced, gathered from). A product is activation x activation
  when neither operand is a weight (``q @ k.T`` with ``q``, ``k`` computed from the batch),
  or when both operands come from a ``squeeze`` (``jnp.matmul`` drops the batch
  dimensions that are 1 on both sides, so ``q @ k`` at batch 1 has none left). Such a
  product runs the batched path (:func:`rules.dot_general`) whatever its batch
  dimensions, so its bits do not depend on whether the batch was squeezed away.
  """
  weights = set(jaxpr.invars) | set(jaxpr.constvars)
  squeezed: set = set()
  found: set[int] = set()

  def weight(v) -> bool:
    return isinstance(v, core.Literal) or v in weights

  for i, eqn in enumerate(jaxpr.eqns):
    name = eqn.primitive.name
    if name == "dot_general":
      a, b = eqn.invars[:2]
      if (a in squeezed and b in squeezed) or not (weight(a) or weight(b)):
        found.add(i)
    elif name in _LAYOUT and eqn.invars and weight(eqn.invars[0]):
      weights.update(eqn.outvars)
    if name == "squeeze":
      squeezed.update(eqn.outvars)
  return found


def _apply(eqn, invals, opts: Options, left: list[str], activations: bool = False):
  name = eqn.primitive.name
  rule = rules_mod.RULES.get(name)
  if rule is not None:
    try:
      out = rule(opts, eqn, *invals, activations=activations) if name == "dot_general" else (
          rule(opts, eqn, *invals))
    except Unsupported as e:
      _not_rewritten(eqn, str(e), opts, left)
      out = None
    if out is not None:
      return out
    return _bind(eqn, eqn.params, invals)
  if name in ("jit", "pjit") and eqn.params["name"].startswith(_backend.KERNEL_PREFIX):
    # One of the library's own kernel calls (_backend.kernel_jit): it holds the contract
    # as it is (and its glue, e.g. the attention backward's row sums, is already fixed).
    return _bind(eqn, eqn.params, invals)
  if name in attention.CALL_PRIMITIVES:
    try:
      out = attention.rewrite_call(opts, eqn, invals,
                                   lambda fn, *a: _trace_and_eval(fn, a, opts, left))
    except Unsupported as e:
      _not_rewritten(eqn, str(e), opts, left)
      return _bind(eqn, eqn.params, invals)
    if out is not None:
      return out
  if name in rules_mod.UNSUPPORTED:
    _not_rewritten(eqn, rules_mod.UNSUPPORTED[name], opts, left)
    return _bind(eqn, eqn.params, invals)
  if name == "pallas_call" or not _sub_jaxprs(eqn.params):
    return _bind(eqn, eqn.params, invals)
  if name in ("checkpoint", "remat2", "remat"):
    inner = eqn.params["jaxpr"]
    fun = jax.checkpoint(lambda *a: eval_jaxpr(inner, (), a, opts, left),
                         prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    return fun(*invals)
  try:
    params = _rewrite_params(eqn, opts, left)
  except Unsupported as e:
    _not_rewritten(eqn, str(e), opts, left)
    params = eqn.params
  return _bind(eqn, params, invals)


def _trace_and_eval(fn, args, opts: Options, left: list[str]) -> list:
  """``fn(*args)`` (flat outputs) traced and evaluated with the rules applied."""
  closed = jax.make_jaxpr(fn)(*args)
  return eval_jaxpr(closed.jaxpr, closed.consts, jax.tree.leaves(args), opts, left)


def eval_jaxpr(jaxpr: core.Jaxpr, consts, args, opts: Options, left: list[str]) -> list:
  """Evaluates ``jaxpr`` on ``args`` (values or tracers) with the rules applied."""
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  products = activation_products(jaxpr)
  # Hand-written attention: its last product becomes causal_attention, the rest is dead.
  plans = einsum_attention.find(jaxpr, consts, opts)
  dead = set().union(*(p.skip for p in plans.values()))
  for i, eqn in enumerate(jaxpr.eqns):
    if i in dead:
      continue
    if i in plans:
      with source_info_util.user_context(eqn.source_info.traceback,
                                         name_stack=eqn.source_info.name_stack):
        env[eqn.outvars[0]] = einsum_attention.apply(plans[i], read)
      continue
    invals = [read(v) for v in eqn.invars]
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack):
      out = _apply(eqn, invals, opts, left, activations=i in products)
    outs = out if eqn.primitive.multiple_results else [out]
    for v, o in zip(eqn.outvars, outs):
      if not isinstance(v, core.DropVar):
        env[v] = o
  return [read(v) for v in jaxpr.outvars]


def warn_left(left: list[str]) -> None:
  if left:
    warnings.warn("batch_invariant(strict=False) kept these order-dependent primitives as "
                  "they are (their bits may depend on the batch): " + "; ".join(left),
                  NotRewrittenWarning, stacklevel=3)
