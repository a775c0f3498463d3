"""``moe_mlp``: a dropless mixture-of-experts SwiGLU layer on the grouped GEMM.

Per token ``t`` with router row ``l_t = x_t @ W_router``:
``y_t = sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over its top-k experts
``e = e_tj`` (:func:`~jaxrl_kernels.moe.routing.route`). Dropless: every assignment is
computed (no capacity factor; dropping tokens depends on the batch, see
docs/CONTRACT.md). The combine adds the k weighted expert outputs in float32 in rank
order, each product guarded against FMA contraction, with one rounding at the end.
So a token's output is bitwise independent of the batch, of padding and of its place,
for every implementation but ``"xla"`` (the stock path: XLA's router product,
``jax.nn.softmax``, ``lax.top_k`` and ``jax.lax.ragged_dot``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_kernels import _validation
from jaxrl_kernels._cpu import guard, opaque_zero, tree_sum
from jaxrl_kernels.gemm import det_matmul
from jaxrl_kernels.grouped_gemm import api as grouped_api
from jaxrl_kernels.grouped_gemm import group_layout, grouped_matmul
from jaxrl_kernels.grouped_gemm.layout import group_ranks
from jaxrl_kernels.moe.routing import check_k, route

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


class MoEOutput(NamedTuple):
  """``moe_mlp``'s result with what the router losses need.

  Attributes:
    y: ``[..., H]`` the layer's output.
    logits: ``[T, E]`` float32 router logits (``T`` the flattened tokens).
    probs: ``[T, E]`` float32 router probabilities.
    experts: ``[T, k]`` int32 chosen experts, in rank order.
  """

  y: jax.Array
  logits: jax.Array
  probs: jax.Array
  experts: jax.Array


def _stock_route(logits, k, normalize):
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = lax.top_k(probs, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32), probs


def _combine_terms(weights, yp, dest, guarded):
  zero = opaque_zero(weights)
  y = None
  for j in range(dest.shape[1]):
    term = weights[:, j:j + 1] * yp[dest[:, j]].astype(jnp.float32)
    term = guard(term, zero) if guarded else term
    y = term if y is None else y + term
  return y


@jax.custom_vjp
def _combine(weights, yp, dest):
  """``y[t] = sum_j weights[t, j] * yp[dest[t, j]]`` in float32, ranks in order, each
  product kept out of the sum's FMA."""
  return _combine_terms(weights, yp, dest, guarded=True)


def _combine_fwd(weights, yp, dest):
  return _combine(weights, yp, dest), (weights, yp, dest)


def _combine_bwd(res, g):
  weights, yp, dest = res
  zero = opaque_zero(weights)
  g = g.astype(jnp.float32)
  # d weights[t, j] = <g[t], yp[dest[t, j]]>: a fixed tree over the features (autodiff
  # would leave it to XLA's row reduction, whose order follows the batch).
  dweights = jnp.stack([tree_sum(guard(g * yp[dest[:, j]].astype(jnp.float32), zero))
                        for j in range(dest.shape[1])], axis=-1)
  dyp = jnp.zeros(yp.shape, jnp.float32)
  for j in range(dest.shape[1]):
    dyp = dyp.at[dest[:, j]].set(guard(weights[:, j:j + 1] * g, zero), unique_indices=True)
  return dweights, dyp.astype(yp.dtype), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def moe_mlp(x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, *, k: int,
            normalize: bool, implementation: str | None = None,
            expert_axis: str | None = None, tokens_replicated: bool = False) -> MoEOutput:
  """A mixture-of-experts SwiGLU layer (module docstring).

  Args:
    x: ``[..., H]`` activations.
    router: ``[H, E]`` router weight.
    gate_up: ``[E, H, 2I]`` expert gate and up projections, columns interleaved
      (``gate_up[e][:, 0::2]`` gate, ``[:, 1::2]`` up).
    down: ``[E, I, H]`` expert down projections.
    k: experts per token.
    normalize: renormalize the top-k probabilities (``norm_topk_prob``; Mixtral: True).
    implementation: of the router GEMM and the grouped GEMM (``det_matmul`` and
      ``grouped_matmul`` names; ``"xla"`` is the stock path throughout).
    expert_axis: expert parallelism inside ``shard_map``: the mesh axis the experts are
      split over (``gate_up``/``down`` hold this device's ``E / ep`` experts, in order;
      ``router`` is whole; ``x`` is this device's tokens). Outputs are bitwise those of
      one device (docs/moe.md).
    tokens_replicated: with ``expert_axis``, every device holds the same tokens (a
      tensor-parallel axis): each computes the assignments of its experts, and a ``psum``
      in which every other device adds ``-0.0`` gives each assignment its owner's bits
      (no ``all_to_all``). Forward only (rollout); training shards experts with FSDP.

  Returns:
    :class:`MoEOutput`; ``y`` in ``x``'s dtype.
  """
  for name, a in (("x", x), ("router", router), ("gate_up", gate_up), ("down", down)):
    _validation.check_float_array("moe_mlp", name, a, _FLOAT_DTYPES)
    if a.dtype != x.dtype:
      raise TypeError(f"moe_mlp: {name} has dtype {a.dtype} but x {x.dtype}; the layer runs "
                      f"in x's dtype: cast the weights explicitly")
  if x.ndim < 1 or router.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
    raise ValueError(f"moe_mlp: expected x [..., H], router [H, E], gate_up [E, H, 2I] and "
                     f"down [E, I, H]; got x {x.shape}, router {router.shape}, gate_up "
                     f"{gate_up.shape}, down {down.shape}")
  if not isinstance(normalize, bool | np.bool_):
    raise TypeError(f"moe_mlp: normalize must be a bool, got {normalize!r}")
  h = x.shape[-1]
  num_experts = router.shape[-1]
  k = check_k("moe_mlp", k, num_experts)
  ep = 1 if expert_axis is None else lax.axis_size(expert_axis)
  local = gate_up.shape[0]
  if router.shape != (h, num_experts) or gate_up.shape[1] != h or local * ep != num_experts or (
      down.shape != (local, gate_up.shape[2] // 2, h)) or gate_up.shape[2] % 2:
    raise ValueError(f"moe_mlp: expected router [H, E], gate_up [E / ep, H, 2I], down "
                     f"[E / ep, I, H] with H={h} (x {x.shape}), ep={ep}; got router "
                     f"{router.shape}, gate_up {gate_up.shape}, down {down.shape}")
  impl = grouped_api.resolve_implementation(implementation, x.dtype)
  stock = not grouped_api.BACKENDS[impl].batch_invariant
  x2 = x.reshape(-1, h)
  t = x2.shape[0]
  if t == 0:  # an empty batch (the layout's gathers cannot index an empty buffer)
    return MoEOutput(jnp.zeros(x.shape, x.dtype), jnp.zeros((0, num_experts), jnp.float32),
                     jnp.zeros((0, num_experts), jnp.float32), jnp.zeros((0, k), jnp.int32))
  # transformers computes the router product in the activation dtype, then softmax in fp32.
  logits = det_matmul(x2, router, implementation=implementation).astype(jnp.float32)
  if stock:
    weights, experts, probs = _stock_route(logits, k, normalize)
  else:
    weights, experts, probs = route(logits, k, normalize=normalize)
  if expert_axis is None:
    layout = group_layout(experts.reshape(-1), num_experts)
    dest = layout.dest.reshape(t, k)
    yp = _experts(_dispatch(x2, dest, layout.rows), gate_up, down, layout, impl)
  elif tokens_replicated:
    dest, yp = _owned(x2, experts, gate_up, down, expert_axis, impl)
  else:
    dest, yp = _exchange(x2, experts, gate_up, down, expert_axis, ep, impl)
  y = _combine_terms(weights, yp, dest, guarded=False) if stock else _combine(weights, yp, dest)
  return MoEOutput(y.astype(x.dtype).reshape(x.shape), logits, probs, experts)


def _experts(xp, gate_up, down, layout, impl):
  """The expert SwiGLU on the layout's rows: two grouped GEMMs (``silu(g) * u`` in float32,
  one rounding, as the dense MLP)."""
  gu = grouped_matmul(xp, gate_up, layout, implementation=impl)
  g, u = gu[:, 0::2], gu[:, 1::2]
  act = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(xp.dtype)
  return grouped_matmul(act, down, layout, implementation=impl)


def _exchange(x2, experts, gate_up, down, axis, ep, impl):
  """Expert parallelism: assignments travel to their expert's device and back.

  Device ``d`` holds experts ``d * E_l ... (d + 1) * E_l - 1``. Each assignment takes the
  next slot of its owner's block of a ``[ep, A]`` send buffer (``A`` = this device's
  assignments: dropless, whatever the routing); one ``all_to_all`` delivers the rows,
  the owner runs its experts on them (the grouped GEMM's rows do not depend on the rows
  around them), a second ``all_to_all`` brings the outputs back to the same slots.
  Returns ``(dest [T, k], yp [ep * A, H])`` for the combine: the same bits as one device.
  """
  t, k = experts.shape
  a = t * k
  local = gate_up.shape[0]
  flat = experts.reshape(-1)
  owner = flat // local
  send_pos = owner * a + group_ranks(owner, ep)[1]
  send_x = _dispatch(x2, send_pos.reshape(t, k), ep * a).reshape(ep, a, -1)
  send_e = jnp.full((ep * a,), -1, jnp.int32).at[send_pos].set(flat % local).reshape(ep, a)
  recv_x = lax.all_to_all(send_x, axis, 0, 0).reshape(ep * a, -1)
  recv_e = lax.all_to_all(send_e, axis, 0, 0).reshape(ep * a)
  valid = recv_e >= 0
  layout = group_layout(jnp.where(valid, recv_e, 0), local, valid=valid)
  xp = jnp.zeros((layout.rows, x2.shape[1]), x2.dtype).at[layout.dest].set(
      recv_x, mode="drop", unique_indices=True)
  yp = _experts(xp, gate_up, down, layout, impl)
  back = yp.at[layout.dest].get(mode="fill", fill_value=0).reshape(ep, a, -1)
  back = lax.all_to_all(back, axis, 0, 0).reshape(ep * a, -1)
  return send_pos.reshape(t, k), back


def _owned(x2, experts, gate_up, down, axis, impl):
  """Expert parallelism over replicated tokens: this device's experts on their assignments;
  every assignment's output row is its owner's, summed with ``-0.0`` from the others
  (``x + -0.0 == x`` for every ``x``: the owner's bits exactly). Returns ``(dest [T, k],
  yp [A, H])`` for the combine."""
  t, k = experts.shape
  local = gate_up.shape[0]
  flat = experts.reshape(-1)
  mine = flat // local == lax.axis_index(axis)
  layout = group_layout(flat % local, local, valid=mine)
  yp = _experts(_dispatch(x2, layout.dest.reshape(t, k), layout.rows), gate_up, down, layout,
                impl)
  rows = yp.at[layout.dest].get(mode="fill", fill_value=-0.0)
  return jnp.arange(t * k, dtype=jnp.int32).reshape(t, k), lax.psum(rows, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch(x2, dest, rows):
  """``k`` copies of each token row into a ``[rows, H]`` buffer at ``dest [T, k]`` (unique
  rows, or ``rows`` itself for an assignment that takes no row; the others zero). Its
  backward adds a token's ``k`` row gradients in rank order in float32 (autodiff would
  leave the order to its accumulation)."""
  buf = jnp.zeros((rows, x2.shape[1]), x2.dtype)
  for j in range(dest.shape[1]):
    buf = buf.at[dest[:, j]].set(x2, mode="drop", unique_indices=True)
  return buf


def _dispatch_fwd(x2, dest, rows):
  return _dispatch(x2, dest, rows), dest


def _dispatch_bwd(rows, dest, g):
  def row(j):
    return g.at[dest[:, j]].get(mode="fill", fill_value=0).astype(jnp.float32)
  dx = row(0)
  for j in range(1, dest.shape[1]):
    dx = dx + row(j)
  return dx.astype(g.dtype), None  # the buffer's dtype is x's


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
