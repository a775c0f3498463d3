"""Attention written by hand in jnp under ``batch_invariant``: the whole subgraph becomes
the library's :func:`~jaxrl_kernels.causal_attention` where it provably is attention.

The form recognised (the Llama/Qwen form, in any einsum layout)::

    k = jnp.repeat(k, G, axis=h); v = jnp.repeat(v, G, axis=h)     # optional (GQA)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale                 # or / c, either order
    s = jnp.where(mask, s, fill)                                     # or s + bias; optional
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(...)  # over the keys
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)

As a jaxpr (jax 0.10 and 0.11 alike): a ``dot_general`` contracting one head-dim axis
of q and k with the batch and head axes as batch dimensions; element-wise steps on the
scores (``convert_element_type``, ``transpose``, ``mul``/``div`` by a static positive
scalar, ``select_n`` against a fill, ``add`` of a bias), possibly inside ``jit`` calls
(``jnp.where`` is one); jax.nn.softmax over the key axis (inlined: ``reduce_max``,
``max`` with -inf, ``stop_gradient``, ``sub``, ``exp``, ``reduce_sum``, ``div``; or its
``custom_jvp_call`` form); a second ``dot_general`` contracting the keys of the
probabilities with those of v. ``jnp.repeat`` by a static count is a ``broadcast_in_dim``
that adds an axis right after the head axis and a ``reshape`` that merges the two
(head ``n`` reads kv head ``n // G``, as ``causal_attention`` reads it); any other
head expansion (``jnp.tile``, which reads ``n % K``) is passed as k and v with all
``N`` heads. Every intermediate value must be used by the
next step only, so the subgraph can be dropped whole.

The mask is proved, not guessed: every mask (a ``select_n`` predicate, or where a bias
is 0) is evaluated symbolically over the score's index space, through broadcasts,
reshapes, casts, ``jit`` calls (``jnp.tril`` is one), ``iota``, integer ``add``/``sub``,
comparisons, ``and``/``not`` and boolean ``select_n``, down to ``iota`` along the query
or key axis, constants and integer arrays of the traced program that vary over the batch
and query axes only (a decode step's position). The result must be a conjunction of
``key <= U(batch, query)`` bounds; ``q_positions`` is their minimum (clipped to
``[-1, S - 1]``). A concrete boolean mask (closed over) must hold a prefix of keys in
each row. A bound on keys from below (a sliding window), a mask that depends on the
head or on data over the keys (a padding mask passed in), or a scale after the mask that
lifts a finite fill above -1e9, leaves the pattern alone: the equations are rewritten one
by one. A mask that takes every key from some queries (``key <= query - 5``) is taken:
those queries see no key (below).

The fill counts as -inf when it is -inf, at most -1e9, or the scores' dtype's lowest
value: ``exp(fill - max)`` is then exactly 0 wherever a seen score exceeds
``fill + 104``. A query that sees no key gets 0 here (stock: NaN with -inf, the mean of
the values with a finite fill), as in :mod:`jaxrl_kernels.transform.attention`.

The scale is the product of the static multipliers and reciprocal divisors; a divisor
that is ``sqrt(D)`` as the literal's dtype holds it (or a multiplier that is
``1/sqrt(D)``) is taken as ``1/sqrt(D)``, the scale ``jax.nn.dot_product_attention``
passes. The call and its implementation are those of the ``dot_product_attention``
path (:func:`attention.fitting_implementation`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax._src import core

from jaxrl_kernels.attention import api as attention_api
from jaxrl_kernels.transform import attention
from jaxrl_kernels.transform.rules import Options

#: A finite fill at or below this counts as -inf (module docstring).
FILL_BELOW = -1e9
_CALLS = ("jit", "pjit")
_LAYOUT = ("broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p")
_CMP_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}  # a OP b <=> b FLIP(OP) a
_CMP_NOT = {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge"}


class _NoMatch(Exception):
  """The subgraph is not provably attention."""


def _require(ok, why: str = "") -> None:
  if not ok:
    raise _NoMatch(why)


class _Scope:
  """A jaxpr with its producers and consumers; ``outer`` maps its inputs to the atoms
  of the enclosing jaxpr (``None`` for the jaxpr the interpreter evaluates)."""

  def __init__(self, jaxpr: core.Jaxpr, consts: dict, outer=None):
    self.jaxpr, self.consts, self.outer = jaxpr, consts, outer
    self.producer: dict = {}
    self.consumers: dict = defaultdict(list)
    self.index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        self.producer[v] = eqn
      for a in eqn.invars:
        if isinstance(a, core.Var):
          self.consumers[a].append(eqn)
    self.outvars = [v for v in jaxpr.outvars if isinstance(v, core.Var)]
    self.invars = list(jaxpr.invars)

  def uses(self, v) -> int:
    return len(self.consumers[v]) + sum(o is v for o in self.outvars)

  def inner(self, eqn, closed) -> _Scope:
    jaxpr = closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed
    consts = dict(zip(jaxpr.constvars, getattr(closed, "consts", ())))
    return _Scope(jaxpr, consts, (self, list(eqn.invars)))

  def outer_atom(self, v):
    """The enclosing scope and atom of input ``v``, or None."""
    if self.outer is None or v not in self.invars:
      return None
    scope, atoms = self.outer
    return scope, atoms[self.invars.index(v)]


def _call_body(eqn):
  return eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None


def _operand_roles(shape, out_shape, roles) -> tuple:
  """The roles of an operand of an (implicitly broadcasting) element-wise op."""
  if len(shape) == 0:
    return ()
  return tuple(r if s == o else None for s, o, r in zip(shape, out_shape, roles))


def _layout_roles(eqn, roles) -> tuple:
  """The roles of the operand of a layout equation whose output has ``roles``."""
  name = eqn.primitive.name
  x, out = eqn.invars[0], eqn.outvars[0]
  shape, out_shape = x.aval.shape, out.aval.shape
  if name == "broadcast_in_dim":
    return tuple(roles[d] if shape[i] == out_shape[d] else None
                 for i, d in enumerate(eqn.params["broadcast_dimensions"]))
  if name == "squeeze":
    dims = {d % len(shape) for d in eqn.params["dimensions"]}
    it = iter(roles)
    return tuple(None if i in dims else next(it) for i in range(len(shape)))
  if name == "reshape":
    _require(eqn.params.get("dimensions") is None, "reshape with dimensions")
    ins = [i for i, s in enumerate(shape) if s != 1]
    outs = [j for j, s in enumerate(out_shape) if s != 1]
    _require([shape[i] for i in ins] == [out_shape[j] for j in outs], "reshape merges axes")
    new = [None] * len(shape)
    for i, j in zip(ins, outs):
      new[i] = roles[j]
    return tuple(new)
  return tuple(roles)  # copy


def _const(scope: _Scope, atom):
  """The concrete value of ``atom`` as a NumPy array of its rank whose axes are its own
  or 1 where it is a broadcast (a fill broadcast to the scores stays one element), or
  None."""
  if isinstance(atom, core.Literal):
    return np.asarray(atom.val)
  if atom in scope.consts:
    val = scope.consts[atom]
    return None if isinstance(val, core.Tracer) else np.asarray(val)
  up = scope.outer_atom(atom)
  if up is not None:
    return _const(*up)
  eqn = scope.producer.get(atom)
  if eqn is None:
    return None
  name = eqn.primitive.name
  out = eqn.outvars[0].aval
  if name in ("broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "copy",
              "copy_p"):
    x = _const(scope, eqn.invars[0])
    if x is None:
      return None
    if name == "broadcast_in_dim":
      shape = [1] * len(out.shape)
      for i, d in enumerate(eqn.params["broadcast_dimensions"]):
        shape[d] = x.shape[i]
      return x.reshape(shape)
    if name == "convert_element_type":
      return x.astype(out.dtype)
    if x.size == 1:
      return x.reshape((1,) * len(out.shape))
    return np.broadcast_to(x, eqn.invars[0].aval.shape).reshape(out.shape)
  body = _call_body(eqn)
  if body is not None and len(eqn.outvars) == 1:
    inner = scope.inner(eqn, body)
    return _const(inner, inner.jaxpr.outvars[0])
  return None


@dataclasses.dataclass
class _Affine:
  """``sum(coef[r] * index_r) + const + sum(sign * data)`` over the score's index space;
  each data term is ``(sign, source, roles)``: a top-level var or a concrete array whose
  axes have those roles."""

  coef: dict = dataclasses.field(default_factory=dict)
  const: int = 0
  data: list = dataclasses.field(default_factory=list)

  def scaled(self, c: int) -> _Affine:
    return _Affine({r: c * v for r, v in self.coef.items()}, c * self.const,
                   [(c * s, src, roles) for s, src, roles in self.data])

  def plus(self, other: _Affine) -> _Affine:
    coef = dict(self.coef)
    for r, v in other.coef.items():
      coef[r] = coef.get(r, 0) + v
    return _Affine({r: v for r, v in coef.items() if v}, self.const + other.const,
                   self.data + other.data)


def _own_roles(c, aval, roles) -> tuple:
  """``roles`` without those of the axes along which ``c`` (of :func:`_const`) is a
  broadcast."""
  return tuple(r if n == m else None for n, m, r in zip(c.shape, aval.shape, roles))


def _signed_int(aval) -> bool:
  # 32 and 64 bits only: the bounds are exact integer arithmetic, which narrow types wrap.
  return jnp.dtype(aval.dtype) in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64))


def _int(scope: _Scope, atom, roles) -> _Affine:
  """An integer array as an :class:`_Affine` of the index roles."""
  _require(_signed_int(atom.aval), "mask arithmetic on non-signed integers")
  c = _const(scope, atom)
  if c is not None:
    if c.size == 1:
      return _Affine(const=int(c.reshape(())))
    return _Affine(data=[(1, ("value", c), _own_roles(c, atom.aval, roles))])
  up = scope.outer_atom(atom)
  if up is not None:
    return _int(*up, roles)
  eqn = scope.producer.get(atom)
  if eqn is None:  # an input or a traced constant
    _require(scope.outer is None, "a traced value inside a call")
    return _Affine(data=[(1, ("var", atom), tuple(roles))])
  name = eqn.primitive.name
  out_shape = eqn.outvars[0].aval.shape
  if name == "iota":
    dim = eqn.params["dimension"]
    if roles[dim] is None:
      _require(out_shape[dim] == 1, "iota along a broadcast axis")
      return _Affine()
    return _Affine(coef={roles[dim]: 1})
  if name in _LAYOUT or name == "convert_element_type":
    src = eqn.invars[0].aval
    _require(jnp.dtype(src.dtype).itemsize <= jnp.dtype(eqn.outvars[0].aval.dtype).itemsize,
             "a narrowing integer cast in the mask")
    return _int(scope, eqn.invars[0], _layout_roles(eqn, roles))
  if name in ("add", "sub"):
    a, b = (_int(scope, x, _operand_roles(x.aval.shape, out_shape, roles))
            for x in eqn.invars)
    return a.plus(b if name == "add" else b.scaled(-1))
  if name == "neg":
    return _int(scope, eqn.invars[0], roles).scaled(-1)
  if name == "mul":
    x, y = eqn.invars
    for a, b in ((x, y), (y, x)):
      c = _const(scope, b)
      if c is not None and c.size == 1:
        return _int(scope, a, _operand_roles(a.aval.shape, out_shape, roles)).scaled(
            int(c.reshape(())))
  body = _call_body(eqn)
  if body is not None and len(eqn.outvars) == 1:
    inner = scope.inner(eqn, body)
    return _int(inner, inner.jaxpr.outvars[0], roles)
  _require(scope.outer is None, f"{name} inside a call")
  return _Affine(data=[(1, ("var", atom), tuple(roles))])  # computed by the program


def _bool(scope: _Scope, atom, roles, negate: bool = False) -> list:
  """The keys a boolean mask lets through (``not mask`` if ``negate``), as a conjunction:
  ``("cmp", diff, op)`` for ``diff OP 0`` and ``("prefix", array, roles)``."""
  c = _const(scope, atom)
  if c is not None:
    c = np.logical_not(c) if negate else c.astype(bool)
    if c.all():
      return []
    _require(c.ndim > 0, "a mask that is false everywhere")
    return [("prefix", c, _own_roles(c, atom.aval, roles))]
  up = scope.outer_atom(atom)
  if up is not None:
    return _bool(*up, roles, negate)
  eqn = scope.producer.get(atom)
  _require(eqn is not None, "a mask that is data")
  name = eqn.primitive.name
  out_shape = eqn.outvars[0].aval.shape
  if name in _LAYOUT or (name == "convert_element_type"
                         and eqn.invars[0].aval.dtype == jnp.bool_):
    return _bool(scope, eqn.invars[0], _layout_roles(eqn, roles), negate)
  if name in _CMP_FLIP:
    a, b = (_int(scope, x, _operand_roles(x.aval.shape, out_shape, roles))
            for x in eqn.invars)
    return [("cmp", a.plus(b.scaled(-1)), _CMP_NOT[name] if negate else name)]
  if name == "not":
    return _bool(scope, eqn.invars[0], roles, not negate)
  if name in ("and", "or") and (name == "and") != negate:  # a conjunction
    return [t for x in eqn.invars
            for t in _bool(scope, x, _operand_roles(x.aval.shape, out_shape, roles), negate)]
  if name == "select_n" and len(eqn.invars) == 3:
    pred, if_false, if_true = eqn.invars
    f, t = _const(scope, if_false), _const(scope, if_true)
    pred_roles = _operand_roles(pred.aval.shape, out_shape, roles)
    if f is not None and not f.any():  # pred and if_true
      if t is not None and t.all():
        return _bool(scope, pred, pred_roles, negate)
      _require(not negate, "a negated select")
      return (_bool(scope, pred, pred_roles)
              + _bool(scope, if_true, _operand_roles(if_true.aval.shape, out_shape, roles)))
    if f is not None and f.all() and t is not None and not t.any():
      return _bool(scope, pred, pred_roles, not negate)
  body = _call_body(eqn)
  if body is not None and len(eqn.outvars) == 1:
    inner = scope.inner(eqn, body)
    return _bool(inner, inner.jaxpr.outvars[0], roles, negate)
  raise _NoMatch(f"a mask built by {name}")


def _is_fill(value, dtype) -> bool:
  """Whether every element of ``value`` counts as -inf for a softmax in ``dtype``."""
  v = np.asarray(value, np.float64)
  lowest = float(np.finfo(dtype).min) if jnp.issubdtype(dtype, jnp.floating) else -np.inf
  return bool(np.all((v <= FILL_BELOW) | (v == lowest)))


def _bias(scope: _Scope, atom, roles, dtype, fills: list) -> list:
  """The keys an additive bias lets through (where it is 0; -inf-like elsewhere); the
  largest fill value is appended to ``fills``."""
  c = _const(scope, atom)
  if c is not None:
    zero = c == 0
    _require(np.all(zero | (np.asarray(c, np.float64) <= FILL_BELOW)
                    | (np.asarray(c, np.float64) == float(np.finfo(dtype).min))),
             "a bias that is not 0 or a fill")
    if zero.all():
      return []
    fills.append(float(np.max(np.asarray(c, np.float64)[~zero])))
    return [("prefix", zero, _own_roles(zero, atom.aval, roles))]
  up = scope.outer_atom(atom)
  if up is not None:
    return _bias(*up, roles, dtype, fills)
  eqn = scope.producer.get(atom)
  _require(eqn is not None, "a bias that is data")
  name = eqn.primitive.name
  out_shape = eqn.outvars[0].aval.shape
  if name in _LAYOUT or name == "convert_element_type":
    _require(jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating), "a non-float bias")
    return _bias(scope, eqn.invars[0], _layout_roles(eqn, roles), dtype, fills)
  if name == "select_n" and len(eqn.invars) == 3:
    pred, if_false, if_true = eqn.invars
    f, t = _const(scope, if_false), _const(scope, if_true)
    _require(f is not None and t is not None, "a bias that is data")
    pred_roles = _operand_roles(pred.aval.shape, out_shape, roles)
    if not t.any() and _is_fill(f, dtype):
      fills.append(float(np.max(np.asarray(f, np.float64))))
      return _bool(scope, pred, pred_roles)
    if not f.any() and _is_fill(t, dtype):
      fills.append(float(np.max(np.asarray(t, np.float64))))
      return _bool(scope, pred, pred_roles, negate=True)
  body = _call_body(eqn)
  if body is not None and len(eqn.outvars) == 1:
    inner = scope.inner(eqn, body)
    return _bias(inner, inner.jaxpr.outvars[0], roles, dtype, fills)
  raise _NoMatch(f"a bias built by {name}")


@dataclasses.dataclass
class _Chain:
  """What the walk from the scores to the probabilities found."""

  roles: tuple
  scales: list = dataclasses.field(default_factory=list)  # ("mul" | "div", value, dtype)
  masks: list = dataclasses.field(default_factory=list)
  fills: list = dataclasses.field(default_factory=list)  # each mask's largest fill, scaled
  key_role: str | None = None  # the softmax axis's role: the keys
  end: object = None  # the probabilities, as the product with v takes them
  skip: list = dataclasses.field(default_factory=list)  # top-level equations consumed

  @property
  def softmax(self) -> bool:
    return self.key_role is not None


def _single(scope: _Scope, v):
  """The one equation that uses ``v``."""
  _require(scope.uses(v) == 1 and len(scope.consumers[v]) == 1, "a value used twice")
  return scope.consumers[v][0]


def _record(scope: _Scope, st: _Chain, eqn) -> None:
  if scope.outer is None:
    st.skip.append(scope.index[id(eqn)])


def _softmax(scope: _Scope, x, st: _Chain):
  """The output of jax.nn.softmax's inlined equations over one axis of ``x``, or None."""
  cons = scope.consumers[x]
  if len(cons) != 2 or scope.uses(x) != 2:
    return None
  by_name = {e.primitive.name: e for e in cons}
  red, sub = by_name.get("reduce_max"), by_name.get("sub")
  if red is None or sub is None or sub.invars[0] is not x:
    return None
  axes = tuple(red.params["axes"])
  if len(axes) != 1:
    return None
  axis = axes[0]
  shape = x.aval.shape
  keep = shape[:axis] + (1,) + shape[axis + 1:]
  eqns = [red, sub]
  v = red.outvars[0]
  while v is not sub.invars[1]:
    e = _single(scope, v)
    name = e.primitive.name
    if name == "max":
      other = e.invars[1] if e.invars[0] is v else e.invars[0]
      c = _const(scope, other)
      _require(c is not None and np.all(c == -np.inf), "max with a finite value")
    elif name in ("broadcast_in_dim", "reshape"):
      _require(e.outvars[0].aval.shape == keep, "a max broadcast to another shape")
    elif name != "stop_gradient":
      return None
    eqns.append(e)
    v = e.outvars[0]
  _require(scope.uses(v) == 1, "the max used twice")
  exp = _single(scope, sub.outvars[0])
  _require(exp.primitive.name == "exp", "no exp")
  e = exp.outvars[0]
  cons = scope.consumers[e]
  _require(len(cons) == 2 and scope.uses(e) == 2, "exp used elsewhere")
  by_name = {c.primitive.name: c for c in cons}
  total, div = by_name.get("reduce_sum"), by_name.get("div")
  _require(total is not None and div is not None and div.invars[0] is e
           and tuple(total.params["axes"]) == axes, "not a softmax")
  eqns += [exp, total, div]
  v = total.outvars[0]
  while v is not div.invars[1]:
    b = _single(scope, v)
    _require(b.primitive.name in ("broadcast_in_dim", "reshape")
             and b.outvars[0].aval.shape == keep, "a sum broadcast to another shape")
    eqns.append(b)
    v = b.outvars[0]
  _require(scope.uses(v) == 1, "the sum used twice")
  for eq in eqns:
    _record(scope, st, eq)
  st.key_role = st.roles[axis]
  return div.outvars[0]


def _follow(scope: _Scope, v, st: _Chain):
  """Walks from the scores ``v`` to the probabilities' product with v: the equation (at
  top level), or the output of a call's body."""
  while True:
    if scope.outer is not None and v in scope.outvars:
      _require(scope.uses(v) == 1 and len(scope.outvars) == 1, "a call's other output")
      return v
    if not st.softmax:
      out = _softmax(scope, v, st)
      if out is not None:
        v = out
        continue
    eqn = _single(scope, v)
    name = eqn.primitive.name
    if name == "dot_general":
      _require(st.softmax and scope.outer is None, "a product before the softmax")
      st.end = v
      return eqn
    out = eqn.outvars[0]
    if name == "convert_element_type":
      _require(jnp.issubdtype(out.aval.dtype, jnp.floating), "a cast to a non-float")
    elif name == "transpose":
      st.roles = tuple(st.roles[p] for p in eqn.params["permutation"])
    elif name in ("mul", "div") and not st.softmax:
      x, y = eqn.invars
      other = y if x is v else x
      _require(name == "mul" or x is v, "a division by the scores")
      c = _const(scope, other)
      _require(c is not None and c.size >= 1 and np.all(c == c.reshape(-1)[0]),
               "a scale that is not a static scalar")
      val = float(np.asarray(c.reshape(-1)[0], np.float64))
      _require(math.isfinite(val) and val > 0, "a scale that is not finite and positive")
      # A scale after the mask scales a finite fill too (where(m, s, -1e9) * 1e-9 is -1).
      st.fills = [f * val if name == "mul" else f / val for f in st.fills]
      _require(all(f <= FILL_BELOW for f in st.fills), "a scale that lifts the mask's fill")
      st.scales.append((name, val, c.dtype))
    elif name == "select_n" and not st.softmax and len(eqn.invars) == 3:
      pred, if_false, if_true = eqn.invars
      _require((if_false is v) != (if_true is v), "the scores on both sides")
      fill = _const(scope, if_true if if_false is v else if_false)
      _require(fill is not None and _is_fill(fill, v.aval.dtype), "a fill that is not -inf")
      st.fills.append(float(np.max(np.asarray(fill, np.float64))))
      st.masks += _bool(scope, pred, _operand_roles(pred.aval.shape, out.aval.shape, st.roles),
                        negate=if_false is v)
    elif name == "add" and not st.softmax:
      x, y = eqn.invars
      other = y if x is v else x
      _require(other is not v, "scores added to themselves")
      st.masks += _bias(scope, other,
                        _operand_roles(other.aval.shape, out.aval.shape, st.roles),
                        v.aval.dtype, st.fills)
    elif (name in _CALLS or (name == "custom_jvp_call" and not st.softmax and getattr(
        eqn.params["call_jaxpr"].jaxpr.debug_info, "func_name", "") == "_softmax")):
      _require(len(eqn.outvars) == 1 and eqn.invars.count(v) == 1, "a call's other output")
      body = eqn.params["jaxpr" if name in _CALLS else "call_jaxpr"]
      inner = scope.inner(eqn, body)
      had = st.softmax
      _follow(inner, inner.invars[list(eqn.invars).index(v)], st)
      _require(name in _CALLS or (st.softmax and not had), "a custom_jvp that is not softmax")
    else:
      raise _NoMatch(f"{name} on the scores")
    _record(scope, st, eqn)
    v = out


def _unrepeat(scope: _Scope, v, roles):
  """``(value, roles, G, head role, equations)``: the operand of ``jnp.repeat(x, G,
  axis=h)`` (a ``broadcast_in_dim`` adding an axis after ``h``, a ``reshape`` merging
  them) or ``v`` itself with G = 1."""
  eqn = scope.producer.get(v)
  if eqn is None or eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
    return v, roles, 1, None, []
  x = eqn.invars[0]
  bcast = scope.producer.get(x)
  if bcast is None or bcast.primitive.name != "broadcast_in_dim":
    return v, roles, 1, None, []
  src, big, out = bcast.invars[0].aval.shape, x.aval.shape, v.aval.shape
  n = len(out)
  for a in range(n):
    if (len(big) == n + 1 and big[:a] == out[:a] and big[a + 2:] == out[a + 1:]
        and big[a] * big[a + 1] == out[a] and src == big[:a + 1] + big[a + 2:]
        and tuple(bcast.params["broadcast_dimensions"])
        == tuple(range(a + 1)) + tuple(range(a + 2, n + 1))):
      # The repeat is dead once the product is replaced only if nothing else reads it.
      eqns = []
      if scope.uses(v) == 1:
        eqns.append(eqn)
        if scope.uses(x) == 1:
          eqns.append(bcast)
      return bcast.invars[0], roles, big[a + 1], roles[a], eqns
  return v, roles, 1, None, []


@dataclasses.dataclass(frozen=True)
class Plan:
  """One recognised attention: the equations it replaces and how to call the library."""

  index: int  # the probabilities' product with v, replaced by the call
  skip: frozenset  # the other equations it makes dead
  q: core.Var
  k: core.Var
  v: core.Var
  q_roles: tuple  # "b", "t", "h", "d" per axis
  k_roles: tuple  # "b", "s", "h", "d"
  v_roles: tuple
  out_roles: tuple
  out_dtype: object
  bounds: tuple  # _Affine upper bounds on the key index, roles "b" and "t"
  scale: float
  implementation: str | None


def _scale(scales: list, d: int) -> float:
  scale = 1.0
  for name, val, dtype in scales:
    if name == "div":
      scale /= math.sqrt(d) if np.asarray(math.sqrt(d), dtype) == val else val
    else:
      scale *= 1 / math.sqrt(d) if np.asarray(1 / math.sqrt(d), dtype) == val else val
  return scale


def _upper_bounds(masks: list, rename: dict) -> list[_Affine]:
  """The masks as ``key <= U`` bounds over the batch and query roles."""
  bounds = []
  for kind, a, b in masks:
    if kind == "prefix":
      roles = tuple(rename.get(r) for r in b)
      for ax, r in enumerate(roles):
        if r not in ("b", "t", "s"):  # a broadcast (or head) axis: constant along it
          _require(np.all(a == a.take([0], axis=ax)), "a mask that depends on the head")
      a = a[tuple(slice(None) if r in ("b", "t", "s") else slice(0, 1) for r in roles)]
      roles = tuple(r if r in ("b", "t", "s") else None for r in roles)
      if "s" not in roles:
        _require(a.all(), "a mask that drops query rows")
        continue
      s_ax = roles.index("s")
      seen = np.moveaxis(a, s_ax, -1)
      count = seen.sum(-1)
      _require(np.array_equal(seen, np.arange(seen.shape[-1]) < count[..., None]),
               "a concrete mask that is not a prefix of the keys")
      rest = roles[:s_ax] + roles[s_ax + 1:]
      bounds.append(_Affine(const=-1, data=[(1, ("value", count.astype(np.int32)), rest)]))
      continue
    diff, op = a, b
    if op in ("le", "lt"):
      diff, op = diff.scaled(-1), _CMP_FLIP[op]
    coef = {rename[r]: c for r, c in diff.coef.items()}
    _require(coef.pop("s", 0) == -1, "a bound that is not key <= U")
    _require(set(coef) <= {"b", "t"}, "a mask that depends on the head")
    data = []
    for sign, src, roles in diff.data:
      roles = tuple(rename.get(r) for r in roles)
      _require(not {"s", "h"} & set(roles), "a mask with data over the keys or heads")
      data.append((sign, src, roles))
    bounds.append(_Affine(coef, diff.const - (op == "gt"), data))
  return bounds


def _match(scope: _Scope, i: int, opts: Options) -> Plan:
  qk = scope.jaxpr.eqns[i]
  (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
  lhs, rhs = qk.invars
  _require(len(lc) == len(rc) == 1 and len(lb) <= 2, "not a q . k over one head axis")
  _require(lhs.aval.ndim == rhs.aval.ndim == len(lb) + 2, "more than one query or key axis")
  out = qk.outvars[0]
  _require(jnp.issubdtype(out.aval.dtype, jnp.floating), "not a float product")
  pairs = [f"p{j}" for j in range(len(lb))]
  lf = next(d for d in range(lhs.aval.ndim) if d not in lc and d not in lb)
  rf = next(d for d in range(rhs.aval.ndim) if d not in rc and d not in rb)
  st = _Chain(roles=(*pairs, "f0", "f1"), skip=[i])
  pv = _follow(scope, out, st)
  # The product with v: the probabilities' key axis contracted with v's, batch with batch.
  (plc, prc), (plb, prb) = pv.params["dimension_numbers"]
  _require(list(pv.invars).count(st.end) == 1, "p times itself")
  p_side = list(pv.invars).index(st.end)
  v_var = pv.invars[1 - p_side]
  p_c, v_c = (plc, prc) if p_side == 0 else (prc, plc)
  p_b, v_b = (plb, prb) if p_side == 0 else (prb, plb)
  key = st.key_role
  query = "f1" if key == "f0" else "f0"
  _require(key in ("f0", "f1"), "a softmax over a batch or head axis")
  _require([st.roles[d] for d in p_c] == [key], "p . v not over the keys")
  _require(sorted(st.roles[d] for d in p_b) == sorted(pairs), "p . v batch axes differ")
  _require(v_var.aval.ndim == len(pairs) + 2 and len(v_c) == 1, "v is not [batch, keys, D]")
  v_roles = [None] * v_var.aval.ndim
  for pd, vd in zip(p_b, v_b):
    v_roles[vd] = st.roles[pd]
  v_roles[v_c[0]] = "s"
  v_free = [d for d in range(v_var.aval.ndim) if v_roles[d] is None]
  v_roles[v_free[0]] = "d"
  p_free = [d for d in range(len(st.roles)) if d not in p_c and d not in p_b]
  batch_roles = [st.roles[d] for d in p_b]
  side_free = ([st.roles[p_free[0]]], ["d"]) if p_side == 0 else (["d"], [st.roles[p_free[0]]])
  out_roles = tuple(batch_roles + side_free[0] + side_free[1])
  # q is the operand whose free axis is the queries.
  q_var, k_var = (lhs, rhs) if query == "f0" else (rhs, lhs)
  qc, kc, qb, kb, qf, kf = ((lc, rc, lb, rb, lf, rf) if query == "f0"
                            else (rc, lc, rb, lb, rf, lf))
  q_roles, k_roles = [None] * q_var.aval.ndim, [None] * k_var.aval.ndim
  for j, (qd, kd) in enumerate(zip(qb, kb)):
    q_roles[qd] = k_roles[kd] = pairs[j]
  q_roles[qc[0]], k_roles[kc[0]] = "d", "d"
  q_roles[qf], k_roles[kf] = query, "s"
  k0, k_roles, gk, hk, k_eqns = _unrepeat(scope, k_var, tuple(k_roles))
  v0, v_roles, gv, hv, v_eqns = _unrepeat(scope, v_var, tuple(v_roles))
  _require(gk == gv and (gk == 1 or hk == hv), "k and v repeated differently")
  _require(gk == 1 or hk in pairs, "a repeat that is not over heads")
  # The head role: the repeated axis; else not the one the mask depends on.
  used = set()
  for kind, a, b in st.masks:
    if kind == "prefix":
      used.update(r for ax, r in enumerate(b) if not np.all(a == a.take([0], axis=ax)))
    else:
      used.update(a.coef)
      for _, _, roles in a.data:
        used.update(roles)
  used &= set(pairs)
  if gk > 1:
    head = hk
  elif len(pairs) == 2 and len(used) == 1:
    head = next(p for p in pairs if p not in used)
  elif len(pairs) == 2:
    _require(not used, "a mask that depends on the head")
    head = max(pairs, key=lambda p: q_roles.index(p))
  else:
    head = None  # one batch axis: the batch (one head), or none
  rename = {p: ("h" if p == head else "b") for p in pairs}
  rename.update({query: "t", key: "s", "s": "s", "d": "d", None: None})
  bounds = _upper_bounds(st.masks, rename)
  q_roles = tuple(rename[r] for r in q_roles)
  k_roles = tuple(rename[r] for r in k_roles)
  v_roles = tuple(rename[r] for r in v_roles)
  out_roles = tuple(rename[r] for r in out_roles)
  q_av = _layout_aval(q_var.aval, q_roles, "bthd")
  k_av = _layout_aval(k0.aval, k_roles, "bshd")
  v_av = _layout_aval(v0.aval, v_roles, "bshd")
  fits, impl = attention.fitting_implementation(opts, q_av, k_av, v_av)
  _require(fits, "causal_attention does not take these shapes or dtypes")
  skip = set(st.skip) | {scope.index[id(e)] for e in k_eqns + v_eqns}
  skip.discard(scope.index[id(pv)])
  return Plan(scope.index[id(pv)], frozenset(skip), q_var, k0, v0, q_roles, k_roles, v_roles,
              out_roles, pv.outvars[0].aval.dtype, tuple(bounds),
              _scale(st.scales, q_av.shape[3]), impl)


def _layout_aval(aval, roles, order: str):
  shape = dict(zip(roles, aval.shape))
  return core.ShapedArray(tuple(shape.get(r, 1) for r in order), aval.dtype)


def _to_layout(x, roles, order: str):
  present = [r for r in order if r in roles]
  x = jnp.transpose(x, [roles.index(r) for r in present])
  return jnp.reshape(x, [x.shape[present.index(r)] if r in present else 1 for r in order])


def find(jaxpr: core.Jaxpr, consts, opts: Options) -> dict[int, Plan]:
  """The hand-written attentions of ``jaxpr`` (its own equations, not inner jaxprs'), by
  the index of the equation each replaces; none overlap."""
  if sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) < 2:
    return {}
  scope = _Scope(jaxpr, dict(zip(jaxpr.constvars, consts)))
  plans: dict[int, Plan] = {}
  taken: set[int] = set()
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "dot_general" or i in taken:
      continue
    try:
      plan = _match(scope, i, opts)
    except (_NoMatch, StopIteration, ValueError, KeyError, IndexError, TypeError):
      continue
    if plan.index in taken or plan.skip & taken:
      continue
    plans[plan.index] = plan
    taken |= plan.skip | {plan.index}
  return plans


def _bound_value(bound: _Affine, read: Callable, b: int, t: int):
  """``U[b, t]`` (int32) of one bound."""
  idx = {"b": jnp.arange(b, dtype=jnp.int32)[:, None], "t": jnp.arange(t, dtype=jnp.int32)}
  u = jnp.full((b, t), bound.const, jnp.int32)
  for r, c in bound.coef.items():
    u = u + c * idx[r]
  for sign, (kind, src), roles in bound.data:
    x = jnp.asarray(read(src) if kind == "var" else src).astype(jnp.int32)
    keep = [ax for ax, r in enumerate(roles) if r is not None]
    x = jnp.reshape(x, [x.shape[ax] for ax in keep])  # the others are broadcast (size 1)
    named = [roles[ax] for ax in keep]
    x = jnp.transpose(x, [named.index(r) for r in "bt" if r in named])
    x = jnp.reshape(x, [n if r in named else 1 for r, n in (("b", b), ("t", t))])
    u = u + sign * jnp.broadcast_to(x, (b, t))
  return u


def apply(plan: Plan, read: Callable):
  """The replaced product's output: ``causal_attention`` on the un-repeated q, k, v with
  ``q_positions`` from the mask's bounds."""
  q = _to_layout(read(plan.q), plan.q_roles, "bthd")
  k = _to_layout(read(plan.k), plan.k_roles, "bshd")
  v = _to_layout(read(plan.v), plan.v_roles, "bshd")
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  if plan.bounds:
    pos = _bound_value(plan.bounds[0], read, b, t)
    for bound in plan.bounds[1:]:
      pos = jnp.minimum(pos, _bound_value(bound, read, b, t))
    pos = jnp.clip(pos, -1, s - 1)
  else:
    pos = jnp.full((b, t), s - 1, jnp.int32)
  out = attention_api.causal_attention(q, k, v, q_positions=pos, scale=plan.scale,
                                       implementation=plan.implementation)
  # [B, T, H, D] -> the product's own layout (its missing batch or head axis is 1).
  kept = [r for r in "bthd" if r in plan.out_roles]
  out = jnp.reshape(out, [out.shape["bthd".index(r)] for r in kept])
  out = jnp.transpose(out, [kept.index(r) for r in plan.out_roles])
  return out.astype(plan.out_dtype)
