"""Building blocks of the ``"cpu"`` implementation (``gemm/cpu.py``, ``linear_logp/cpu.py``).

Two rules make a row's bits a function of that row alone under XLA's CPU
compiler, with its default flags (FMA contraction on):

1. **One shape per product.** Every product whose rows must be invariant is an
   XLA dot of one fixed shape per weight: ``[CPU_ROW_BLOCK, K]`` blocks of
   zero-padded rows, walked by a ``lax.fori_loop``. XLA's CPU GEMM chooses its
   blocking (and so the order of each dot product's additions) from the
   operand shapes; with one shape it makes one choice for every batch size.
2. **No product meets the addition that consumes it.** LLVM fuses ``a * b + c``
   into one FMA (one rounding instead of two) when the multiply and the add
   land in the same compiled loop, and which ops share a loop depends on XLA's
   fusion decisions, which depend on the whole program. (``optimization_barrier``
   does not help here: XLA's CPU pipeline removes barriers before it fuses.)
   :func:`guard` passes a float32 value through an integer XOR with a zero
   that only the running program knows is zero (:func:`opaque_zero`), so the
   consumer of a guarded product is never a multiply in LLVM's eyes: the
   product is rounded on its own in every program and every fusion. Each
   product whose result is added (the dots, ``exp`` and ``log``, whose last
   step may be a multiply, and the element-wise products) is guarded.

All products run in float32: bf16/fp16 operands are upcast first (exact), and
the products of two upcast 16-bit values are exact in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels._backend import cdiv
from jaxrl_kernels.contract import CPU_ROW_BLOCK

__all__ = ["CPU_ROW_BLOCK", "cdiv", "dot_f32", "from_storage", "guard", "opaque_zero",
           "pad_rows", "storage_dtype", "sum_to_match", "to_storage", "tree_sum", "tree_sum_last",
           "varying_like"]


def _varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside a ``shard_map`` (empty outside one)."""
  aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
  mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; older: aval.vma
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def varying_like(init, *operands):
  """``init`` (a pytree of fresh arrays) made varying over every manual axis any of
  ``operands`` varies over.

  Inside a user's ``shard_map(..., check_vma=True)`` a loop body that mixes its
  carry with a sharded operand returns a varying carry; the loop's initial
  carry (``jnp.zeros``) must then be varying too, or the loop does not
  type-check. Values are unchanged (a type cast); outside ``shard_map`` this is
  the identity.
  """
  axes = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(operands)))
  if not axes:
    return init
  pcast = getattr(lax, "pcast", None)

  def cast(leaf):
    missing = tuple(sorted(axes - _varying_axes(leaf), key=str))
    if not missing:
      return leaf
    if pcast is not None:
      return pcast(leaf, missing, to="varying")
    return lax.pvary(leaf, missing)  # jax versions before pcast

  return jax.tree.map(cast, init)


def sum_to_match(ct: jax.Array | None, primal) -> jax.Array | None:
  """Cotangent ``ct`` summed (``psum``) over the manual axes it varies over and ``primal``
  does not: the transpose of the implicit broadcast of an unvarying ``primal``
  into per-device work, as JAX's own autodiff does it inside ``shard_map``
  (e.g. the gradient of a replicated weight used by a batch-sharded product).
  The identity outside ``shard_map`` and under ``check_vma=False``.
  """
  if ct is None or primal is None:
    return ct
  axes = tuple(sorted(_varying_axes(ct) - _varying_axes(primal), key=str))
  return lax.psum(ct, axes) if axes else ct


def opaque_zero(x: jax.Array) -> jax.Array:
  """A uint32 scalar that is always 0, computed from the data of ``x``.

  ``n (n + 1)`` is even for every integer ``n``, so its low bit is 0; neither
  XLA's simplifier nor LLVM's known-bits analysis derives that, so a value
  XORed with it (:func:`guard`) stays opaque to both.
  """
  if x.size == 0:  # nothing to guard (an empty batch): any zero will do
    return jnp.zeros((), jnp.uint32)
  n = lax.bitcast_convert_type(jnp.reshape(x, (-1,))[0].astype(jnp.float32), jnp.uint32)
  return (n * (n + jnp.uint32(1))) & jnp.uint32(1)


@jax.custom_jvp
def guard(x: jax.Array, zero: jax.Array) -> jax.Array:
  """``x`` (float32), unchanged, after an integer XOR with ``zero`` (:func:`opaque_zero`).

  Whatever fusion ``x`` and its consumer end up in, the consumer sees an
  integer-to-float bitcast, not a multiply: no FMA contraction across it.
  Differentiable: the value is ``x``'s, so the derivative is the identity (autodiff of
  the bitcasts alone would give zero: integers carry no tangent).
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) ^ zero
  return lax.bitcast_convert_type(bits, jnp.float32)


@guard.defjvp
def _guard_jvp(primals, tangents):
  x, zero = primals
  return guard(x, zero), tangents[0].astype(jnp.float32)


def storage_dtype(dtype) -> jnp.dtype:
  """The dtype a loop buffer of ``dtype`` is kept in: its bits as ``uint16`` for 16-bit floats.

  XLA's CPU compiler has no 16-bit float ``dynamic-update-slice``: it rewrites
  one into a float32 pass over the whole buffer (and a copy) per update. On
  the integer bits the update is in place.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 else dtype


def to_storage(x: jax.Array, dtype) -> jax.Array:
  """``x`` cast to ``dtype`` and held in :func:`storage_dtype` (a bitcast)."""
  x = x.astype(dtype)
  store = storage_dtype(dtype)
  return x if store == x.dtype else lax.bitcast_convert_type(x, store)


def from_storage(x: jax.Array, dtype) -> jax.Array:
  """The inverse of :func:`to_storage`."""
  dtype = jnp.dtype(dtype)
  return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def pad_rows(x: jax.Array, block: int) -> jax.Array:
  """``x`` with zero rows appended up to a multiple of ``block`` (at least one block)."""
  rows = x.shape[0]
  padded = max(cdiv(rows, block), 1) * block
  if padded == rows:
    return x
  return jnp.pad(x, [(0, padded - rows)] + [(0, 0)] * (x.ndim - 1))


def dot_f32(a: jax.Array, b: jax.Array, contract: tuple[tuple[int], tuple[int]],
            zero: jax.Array) -> jax.Array:
  """float32 ``dot_general`` (IEEE products, float32 accumulation), result guarded.

  The guard keeps the dot's consumers (a bias add, an accumulation) out of the
  GEMM's output stage, so the dot's rounding is its own in every program.
  """
  out = lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (contract, ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return guard(out, zero)


def tree_sum_last(x: jax.Array) -> jax.Array:
  """Sum over the last axis (a power of two) as a fixed pairwise tree of adds.

  ``x[..., :w] + x[..., w:]``, halving ``w`` until one column is left: the
  order of the additions is written out, not left to a reduction emitter.
  """
  width = x.shape[-1]
  if width & (width - 1):
    raise ValueError(f"tree_sum_last: the last axis must be a power of two, got {width}")
  while width > 1:
    width //= 2
    x = x[..., :width] + x[..., width:2 * width]
  return x[..., 0]


def tree_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis as a pairwise tree of elementwise adds (zero-padded to a power
  of two, then :func:`tree_sum_last`). XLA picks a reduction's summation order from the
  whole shape (batch and sequence length included); elementwise adds of fixed slices keep
  one order for every shape, so a row's sum is the same bits wherever the row is."""
  n = x.shape[-1]
  width = 1 << max(0, (n - 1).bit_length())
  if width != n:
    x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], width - n), x.dtype)], axis=-1)
  return tree_sum_last(x)
