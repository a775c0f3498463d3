"""``row_parallel_matmul``: ``x @ w + bias`` in one K-reduction order for every TP degree.

Contract: ``K`` is cut into ``C`` equal chunks, each reduced by ``det_matmul`` in float32;
the ``C`` partials meet in the fixed pairwise tree ``((P0+P1)+(P2+P3))+((P4+P5)+(P6+P7))``,
then ``+ bias`` (float32) and one rounding. Unsharded and TP = 1, 2, 4, ... give the same bits.

Why the bits hold. With ``p`` ranks along ``axis_name`` (``C % p == 0``), rank ``r`` holds
the contiguous K rows of chunks ``[r C/p, (r+1) C/p)``. Each chunk partial is the same
product (same operands, same ``[K/C, N]`` weight shape, so the same kernel and K walk) on
every rank and in the unsharded call. Because ``p`` divides the power of two ``C``, those
``C/p`` adjacent chunks are exactly the leaves of one complete subtree of the tree above:
the rank's local tree computes that subtree's value, term for term. The ``p`` subtree values
are exchanged and combined by the tree's top ``log2 p`` levels, in the same pairing. Every
floating-point addition of the unsharded tree is thus performed with the same two operands,
and float addition is commutative, so the result is bitwise the same for every ``p``. The
exchange moves float32 values without arithmetic, and the bias add and the final cast are
element-wise. The backward runs per chunk too (``dx`` and ``dw`` of chunk ``c`` are one
fixed-shape product each) on the output cotangent, which the ranks' shares rebuild through
the same tree exchange: gradients are the same bits at every TP degree as well.

``merge="psum"`` is the Megatron layer kept as the control: one ``det_matmul`` over the
rank's ``K/p`` rows, then ``lax.psum``; its bits change with ``p``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels import _validation, contract
from jaxrl_kernels.gemm.api import backend, matmul2d, resolve_implementation

_OP = "row_parallel_matmul"
MERGES = ("canonical", "psum")

# How the C chunk products run is the backend's record (gemm/base.py: vmaps_chunks,
# grouped_matmul, shape_free, pads_k, training_of_padded, chunk_tree_matmul, takes_whole):
# every choice runs the contract's chunk products, so the bits are the same either way.
# XLA's CPU dot may pick another blocking for a batched dot: "cpu" runs one call per chunk,
# as does the "xla" baseline; the "cpu" dots' blocking follows their shapes, and CUTLASS
# picks its tile by shape: those run the backward as one product per chunk too (the same
# shapes at every TP degree).


@dataclasses.dataclass(frozen=True)
class _Static:
  """What fixes the computation (a ``custom_vjp`` static argument: part of the jit key)."""
  axis_name: object
  tp: int
  local_chunks: int  # chunks of this rank's K rows: C / tp (canonical), 1 (psum)
  merge: str
  implementation: str
  out_dtype: jnp.dtype
  k_pad: int = 0  # zero rows appended to each K chunk (``_chunk_plan``)


def _axis_size(axis_name) -> int:
  if hasattr(lax, "axis_size"):
    return int(lax.axis_size(axis_name))
  return int(lax.psum(1, axis_name))  # pragma: no cover - older jax


def _varying_axes(x) -> frozenset:
  """The mesh axes ``x`` is typed as varying over (empty unless ``check_vma=True``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; other versions: aval.vma
  return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def pairwise_tree(parts) -> jax.Array:
  """The sum of ``parts`` (a sequence of equal-shape arrays, a power of two of them) by
  adjacent pairs: ``((p0+p1)+(p2+p3))+...``, each addition written out (never a reduction
  emitter's choice); a contiguous run of leaves is always a complete subtree.
  """
  parts = list(parts)
  if len(parts) & (len(parts) - 1) or not parts:
    raise ValueError(f"pairwise_tree: needs a power of two of parts, got {len(parts)}")
  while len(parts) > 1:
    parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
  return parts[0]


def _chunk_products(st: _Static, lhs, rhs, *, lhs_transposed: bool, rhs_transposed: bool,
                    out_dtype, lhs_stacked: bool, rhs_stacked: bool) -> list[jax.Array]:
  """Product ``c`` of chunk ``c`` of the stacked (``[L, ...]``) operand(s), for each of the
  L local chunks: each bitwise ``matmul2d`` on that chunk alone (one launch where the
  backend batches, else L calls)."""
  return list(_stacked_products(st, lhs, rhs, lhs_transposed=lhs_transposed,
                                rhs_transposed=rhs_transposed, out_dtype=out_dtype,
                                lhs_stacked=lhs_stacked, rhs_stacked=rhs_stacked))


def _stacked_products(st: _Static, lhs, rhs, *, lhs_transposed: bool, rhs_transposed: bool,
                      out_dtype, lhs_stacked: bool, rhs_stacked: bool) -> jax.Array:
  """:func:`_chunk_products` as one ``[L, ...]`` array (the batched launches' own output,
  no copy)."""
  fn = functools.partial(matmul2d, lhs_transposed=lhs_transposed,
                         rhs_transposed=rhs_transposed, out_dtype=out_dtype,
                         implementation=st.implementation)
  be = backend(st.implementation)
  if be.vmaps_chunks:
    return jax.vmap(fn, in_axes=(0 if lhs_stacked else None,
                                 0 if rhs_stacked else None))(lhs, rhs)
  if (be.grouped_matmul is not None and lhs_stacked and rhs_stacked and not lhs_transposed
      and not rhs_transposed and st.local_chunks > 1):
    # A decode step's chunk products are a few microseconds each: one launch for all.
    return be.grouped_matmul(lhs, rhs, out_dtype=jnp.dtype(out_dtype))
  return jnp.stack([fn(lhs[c] if lhs_stacked else lhs, rhs[c] if rhs_stacked else rhs)
                    for c in range(st.local_chunks)])


def _split_k(x2, n: int, k_pad: int = 0) -> jax.Array:
  """``[M, K]`` -> ``[n, M, K/n + k_pad]``: the ``n`` contiguous K chunks, chunk-major, each
  followed by ``k_pad`` zero columns (one copy either way)."""
  m, k = x2.shape
  x3 = x2.reshape(m, n, k // n)
  if k_pad:
    x3 = jnp.pad(x3, ((0, 0), (0, 0), (0, k_pad)))
  return x3.transpose(1, 0, 2)


def _chunk_weights(w, n: int, k_pad: int = 0) -> jax.Array:
  """``[K, N]`` -> ``[n, K/n + k_pad, N]``: the weight rows of each K chunk, then ``k_pad``
  zero rows."""
  k, cols = w.shape
  w3 = w.reshape(n, k // n, cols)
  return jnp.pad(w3, ((0, 0), (0, k_pad), (0, 0))) if k_pad else w3


# A differentiated call (training) runs a padded plan's forward chunks unpadded on the
# backend's ``training_of_padded`` kernel (one launch for the C chunks; its pad copies are
# what a training step's forward would pay per layer); the primal (rollout: prefill and
# decode) keeps the padded plan. The bits are the same either way (every kernel runs the
# contract's products). The backward of a padded plan stays on its kernel as two whole
# products of the padded layout (``_whole_products``), not one narrow [K/C + pad]-wide
# product per chunk (benchmarks/results/row_parallel_padded_h100.md).


def _training_static(st: _Static) -> _Static:
  """The products a differentiated call runs: its forward, and the backward of a kernel
  that is not ``shape_free`` (see above)."""
  if not st.k_pad:
    return st
  return dataclasses.replace(
      st, implementation=backend(st.implementation).training_of_padded or st.implementation,
      k_pad=0)


def _chunk_plan(implementation: str | None, dtype, n: int, k_chunk: int) -> tuple[str, int]:
  """``(implementation, k_pad)`` of the chunk products of a ``[k_chunk, N]`` chunk weight.

  A chunk whose K is not a multiple of the contract's K tile (Qwen2.5-0.5B: 896 / 8 = 112
  and 4864 / 8 = 608) runs on the Mosaic kernel with its K zero-padded to the next whole
  tile, where Mosaic takes the padded weight: the contract's walk is whole K tiles in
  ascending order, and the last tile's zero terms add exactly 0 (an accumulation from +0
  never holds -0), so this is the chunk's product by the Mosaic kernel. Decided by the
  weight's shape and dtype only: every batch size and every TP degree (the same chunk
  shape) run the same plan (a differentiated call: ``_training_static``).
  """
  tile = contract.GEMM_TILE_K
  padded = -(-k_chunk // tile) * tile
  if padded != k_chunk and (implementation is None or backend(implementation).pads_k):
    try:
      impl = resolve_implementation(implementation, dtype, n, padded)
    except ValueError:
      impl = None
    if impl is not None and backend(impl).pads_k:
      return impl, padded - k_chunk
  return resolve_implementation(implementation, dtype, n, k_chunk), 0


def _tree_all_reduce(st: _Static, local: jax.Array, finish) -> jax.Array:
  """``finish(tree_r(local_r))`` over the ``tp`` ranks, replicated: the top ``log2 tp`` levels
  of the canonical tree, then ``finish(y, col0, width)`` on columns ``[col0, col0 + width)``.

  When ``tp`` divides N, rank ``r`` receives every rank's value of its ``N/tp`` columns
  (all-to-all), sums and finishes them, and the finished columns are gathered (the traffic
  of a reduce-scatter + all-gather); otherwise every rank gathers all ``[tp, M, N]`` values.
  Either way each element is the same tree of the same operands.
  """
  m, n = local.shape
  if n % st.tp == 0:
    nb = n // st.tp
    blocks = local.reshape(m, st.tp, nb).transpose(1, 0, 2)
    mine = lax.all_to_all(blocks, st.axis_name, 0, 0, tiled=True)  # [tp (source rank), M, nb]
    y = finish(pairwise_tree(list(mine)), lax.axis_index(st.axis_name) * nb, nb)
    return lax.all_gather(y, st.axis_name, axis=1, tiled=True)
  return finish(pairwise_tree(list(lax.all_gather(local, st.axis_name))), 0, n)


# Rows from which the unsharded forward runs the backend's chunk tree in one launch
# (``chunk_tree_matmul``: no float32 partials in memory, faster than the grouped launch +
# XLA's tree at training sizes). Fewer rows (a decode step) keep the grouped launch, whose
# C-fold more CTAs fill the GPU. The bits are the contract's either way.
CHUNK_TREE_MIN_ROWS = 1024


# Padded-plan chunks whose width is a multiple of this many columns run the chunk tree on
# chunk views (K steps of 32 columns) instead of a padded copy of x: Qwen2.5-0.5B's down_proj
# (4864 / 8 = 608 columns per chunk).
CHUNK_VIEW_STEP = 32


def _chunk_tree_applies(st: _Static, m: int) -> bool:
  return (st.tp == 1 and backend(st.implementation).chunk_tree_matmul is not None
          and m >= CHUNK_TREE_MIN_ROWS)


def _chunk_tree(st: _Static, x2, w, bias):
  """The unsharded forward as one chunk-tree launch: a padded plan's chunks read in place
  when their width is a multiple of ``CHUNK_VIEW_STEP`` (the kernel's chunk views: the
  padded chunks' bits without the copies), else from a padded copy."""
  m, k = x2.shape
  c, pad = st.local_chunks, st.k_pad
  if pad and (k // c) % CHUNK_VIEW_STEP == 0:
    pad = 0
  x_c = x2 if not pad else jnp.pad(x2.reshape(m, c, k // c),
                                   ((0, 0), (0, 0), (0, pad))).reshape(m, -1)
  w_c = _chunk_weights(w, c, pad).reshape(-1, w.shape[1])
  return backend(st.implementation).chunk_tree_matmul(
      x_c, w_c, None if bias is None else bias.astype(jnp.float32), chunks=c,
      out_dtype=st.out_dtype)


def _forward(st: _Static, x2, w, bias):
  n = w.shape[1]
  if _chunk_tree_applies(st, x2.shape[0]):
    return _chunk_tree(st, x2, w, bias)
  parts = _chunk_products(st, _split_k(x2, st.local_chunks, st.k_pad),
                          _chunk_weights(w, st.local_chunks, st.k_pad), lhs_transposed=False,
                          rhs_transposed=False, out_dtype=jnp.float32, lhs_stacked=True,
                          rhs_stacked=True)
  local = pairwise_tree(parts)  # this rank's complete subtree, [M, N] float32
  b32 = None if bias is None else bias.astype(jnp.float32)

  def finish(y, col0, width):
    if b32 is not None:
      y = y + (b32 if width == n else lax.dynamic_slice_in_dim(b32, col0, width))
    return y.astype(st.out_dtype)

  if st.tp == 1:
    return finish(local, 0, n)
  if st.merge == "psum":
    return finish(lax.psum(local, st.axis_name), 0, n)
  return _tree_all_reduce(st, local, finish)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_parallel(st: _Static, x2, w, bias):
  return _forward(st, x2, w, bias)


def _fwd(st: _Static, x2, w, bias):
  # The training plan: the primal's bits (rollout and training give the same bits). The
  # chunk tree takes a padded plan's chunks too, so it stays on Mosaic.
  if _chunk_tree_applies(st, x2.shape[0]):
    return _chunk_tree(st, x2, w, bias), (x2, w, bias)
  return _forward(_training_static(st), x2, w, bias), (x2, w, bias)


def _full_cotangent(st: _Static, g: jax.Array) -> jax.Array:
  """The cotangent of the replicated output, whole on every rank.

  ``shard_map(check_vma=False)`` hands each rank a share of a replicated value's cotangent
  (``1/tp`` of it from ``jax.grad`` around the ``shard_map``; per-rank parts from a
  vocab-parallel head), the shares summing to the cotangent: the transpose of the forward's
  gather is their sum. The canonical merge sums them by the same tree as the forward (``tp``
  equal shares ``g/tp`` sum to ``g`` exactly); ``psum`` is the Megatron transpose.
  """
  if st.tp == 1:
    return g
  if st.merge == "psum":
    return lax.psum(g.astype(jnp.float32), st.axis_name).astype(g.dtype)
  return _tree_all_reduce(st, g.astype(jnp.float32), lambda y, col0, width: y.astype(g.dtype))


def _whole_products(st: _Static, x2, w, g):
  """``(dx, dw)`` as one product each over all local chunks on a ``shape_free`` kernel:
  ``dx = dy @ w^T`` (a reduction over N) and ``dw = x^T @ dy`` (over tokens), each element
  with the bits of its chunk's product. A padded plan multiplies the padded layout (each
  chunk's K rows followed by ``k_pad`` zero rows: whole products of full width, where one
  narrow product per chunk would underfill the GPU) and drops the padding's zero columns and
  rows."""
  m, k = x2.shape
  n_loc, pad = st.local_chunks, st.k_pad
  kw = dict(implementation=st.implementation)
  takes_whole = backend(st.implementation).takes_whole
  if pad and takes_whole is not None and takes_whole(m, k, w.shape[1]):
    pad = 0  # the same elements without the padded copies (see gemm/mosaic.takes_whole)
  if not pad:
    return (matmul2d(g, w, lhs_transposed=False, rhs_transposed=True, out_dtype=x2.dtype, **kw),
            matmul2d(x2, g, lhs_transposed=True, rhs_transposed=False, out_dtype=w.dtype, **kw))
  kc = k // n_loc
  w_pad = _chunk_weights(w, n_loc, pad).reshape(n_loc * (kc + pad), w.shape[1])
  x_pad = jnp.pad(x2.reshape(m, n_loc, kc), ((0, 0), (0, 0), (0, pad))).reshape(m, -1)
  dx = matmul2d(g, w_pad, lhs_transposed=False, rhs_transposed=True, out_dtype=x2.dtype, **kw)
  dw = matmul2d(x_pad, g, lhs_transposed=True, rhs_transposed=False, out_dtype=w.dtype, **kw)
  return (dx.reshape(m, n_loc, kc + pad)[:, :, :kc].reshape(m, k),
          dw.reshape(n_loc, kc + pad, -1)[:, :kc].reshape(k, -1))


def _bwd(st: _Static, res, g):
  x2, w, bias = res
  g = _full_cotangent(st, g.astype(x2.dtype))
  if not backend(st.implementation).shape_free:
    st = _training_static(st)
  n_loc = st.local_chunks
  if backend(st.implementation).shape_free:
    dx, dw = _whole_products(st, x2, w, g)
  else:
    kc = w.shape[0] // n_loc
    w3 = _chunk_weights(w, n_loc, st.k_pad)
    # Per chunk, like the forward: every TP degree runs the same products of the same
    # shapes. dx_c = dy @ w_c^T: [M, N] x [N, K/C] (w_c [K/C, N] read as transposed; a
    # padded chunk's zero rows give zero columns, dropped).
    dx = _chunk_products(st, g, w3, lhs_transposed=False, rhs_transposed=True,
                         out_dtype=x2.dtype, lhs_stacked=False, rhs_stacked=True)
    dx = jnp.concatenate([d[:, :kc] for d in dx], axis=1)
    # dw_c = x_c^T @ dy: a reduction over tokens, deterministic run to run.
    dw = _chunk_products(st, _split_k(x2, n_loc, st.k_pad), g, lhs_transposed=True,
                         rhs_transposed=False, out_dtype=w.dtype, lhs_stacked=True,
                         rhs_stacked=False)
    dw = jnp.concatenate([d[:kc] for d in dw], axis=0)
  db = None
  if bias is not None:
    # The sum of dy over tokens as a det_matmul product (ones^T @ dy): a fixed order,
    # float32 accumulation, rounded to the input dtype like dw (all that "cuda" returns).
    ones = jnp.ones((g.shape[0], 1), g.dtype)
    db = matmul2d(ones, g, lhs_transposed=True, rhs_transposed=False, out_dtype=g.dtype,
                  implementation=st.implementation)[0].astype(bias.dtype)
    if st.tp > 1:
      # shard_map sums a replicated input's cotangent over the ranks: rank 0 alone returns
      # it, so that sum is exact in any order (the others add zeros).
      db = jnp.where(lax.axis_index(st.axis_name) == 0, db, jnp.zeros_like(db))
  return dx, dw, db


_row_parallel.defvjp(_fwd, _bwd)


def _check_power_of_two(name: str, value: int) -> None:
  if value & (value - 1):
    raise ValueError(f"{_OP}: {name} must be a power of two, got {value}")


def row_parallel_matmul(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *,
                        axis_name: str | None = None,
                        chunks: int = contract.ROW_PARALLEL_CHUNKS, merge: str = "canonical",
                        implementation: str | None = None) -> jax.Array:
  """``x @ w + bias`` in the canonical row-parallel K order (bitwise the same at every TP).

  ``y[..., n] = round( tree_c( sum_{k in chunk c} x[..., k] w[k, n] ) + bias[n] )``: K is
  cut into ``chunks`` (``C``) equal contiguous chunks; chunk ``c``'s partial is
  ``det_matmul(x[..., c K/C:(c+1) K/C], w[c K/C:(c+1) K/C], out_dtype=float32)`` (ascending
  K in the contract's K tile, from zero); the partials are summed in float32 by the fixed
  adjacent-pair tree ``((P0+P1)+(P2+P3))+((P4+P5)+(P6+P7))``; the bias is added in float32;
  one rounding to ``x.dtype``.

  Inside ``shard_map`` with ``axis_name`` of size ``p`` (``C % p == 0``), ``x [..., K/p]``
  and ``w [K/p, N]`` are rank ``r``'s contiguous K slice (chunks ``r C/p ... (r+1) C/p - 1``):
  the rank sums its chunks' partials (a complete subtree), the ``p`` subtree values are
  exchanged (all-to-all over ``N/p`` column blocks, finished there, then an all-gather of
  the rounded columns; an all-gather of the float32 partials when ``p`` does not divide
  ``N``) and combined by the top ``log2 p`` levels of the same tree. The result is
  replicated and equals the unsharded call's bits. Runs under ``shard_map(...,
  check_vma=False)`` (a typed ``check_vma=True`` map is refused with a ValueError: the
  gathered result is replicated by construction, which its types cannot express).

  Args:
    x: ``[..., K]`` (``[..., K/p]`` per rank), bfloat16, float16 or float32.
    w: ``[K, N]`` (``[K/p, N]`` per rank; the ``DetLinear`` kernel layout), dtype of ``x``.
    bias: optional ``[N]``, added in float32 before the rounding (replicated over ranks).
    axis_name: the tensor-parallel mesh axis, or None for the unsharded call.
    chunks: ``C``, a power of two and a multiple of ``p`` dividing ``K``. Part of the
      numerical contract (``contract.ROW_PARALLEL_CHUNKS``): another value, other bits.
      Unused by ``merge="psum"``.
    merge: ``"canonical"`` (the order above) or ``"psum"`` (the Megatron control: one
      float32 ``det_matmul`` over the rank's ``K/p`` rows, ``lax.psum``, bias, rounding; its
      bits depend on ``p``).
    implementation: the ``det_matmul`` implementation of every chunk product (None: by
      device, decided by the chunk's ``[K/C, N]`` weight shape and dtype). On Hopper a
      chunk K off the 64-wide K tile runs the Mosaic kernel zero-padded to whole tiles
      (``None`` or ``"mosaic"``; the same bits as the unpadded chunk's walk).

  Returns:
    ``[..., N]`` in ``x.dtype``.

  Gradients (``jax.custom_vjp``): per chunk, ``dx_c = dy @ w_c^T`` and ``dw_c = x_c^T @ dy``
  (``det_matmul`` products), ``dbias = sum dy`` over tokens in a fixed order. Take them
  with ``jax.grad`` around the ``shard_map`` (as for ``vocab_parallel_linear_logp``): under
  ``check_vma=False`` each rank then holds a share of the replicated output's cotangent
  (``dy / p``, or a vocab-parallel head's per-rank part), and the backward rebuilds ``dy``
  with the forward's exchange and tree (``merge="psum"``: a ``psum``). Each rank's ``dx`` and
  ``dw`` are then its slices of the unsharded ones, bitwise; ``dbias`` comes from rank 0.

  >>> import jax.numpy as jnp
  >>> row_parallel_matmul(jnp.ones((2, 16)), jnp.ones((16, 3))).tolist()
  [[16.0, 16.0, 16.0], [16.0, 16.0, 16.0]]
  """
  x = jnp.asarray(x)
  w = jnp.asarray(w)
  merge = _validation.check_choice(_OP, "merge", merge, MERGES)
  chunks = _validation.check_int(_OP, "chunks", chunks, minimum=1)
  _check_power_of_two("chunks", chunks)
  if axis_name is not None and not isinstance(axis_name, str):
    raise TypeError(f"{_OP}: axis_name must be a str or None, got {axis_name!r}")
  _validation.check_float_array(_OP, "x", x)
  _validation.check_float_array(_OP, "w", w)
  if x.ndim < 1:
    raise ValueError(f"{_OP}: x must have at least 1 dimension [..., K], got shape {x.shape}")
  if w.ndim != 2:
    raise ValueError(f"{_OP}: w must be 2-D [K, N], got shape {w.shape}")
  if x.dtype != w.dtype:
    raise TypeError(f"{_OP}: x and w must have the same dtype, got x {x.dtype} and w "
                    f"{w.dtype}; cast one explicitly")
  k_loc, n = w.shape
  if x.shape[-1] != k_loc:
    raise ValueError(f"{_OP}: x has K={x.shape[-1]} (shape {x.shape}) but w [K, N] has "
                     f"K={k_loc} (shape {w.shape})")
  if bias is not None:
    bias = jnp.asarray(bias)
    _validation.check_float_array(_OP, "bias", bias)
    if bias.shape != (n,):
      raise ValueError(f"{_OP}: bias must have shape ({n},) (w's N), got {bias.shape}")
  tp = 1 if axis_name is None else _axis_size(axis_name)
  if axis_name is not None and axis_name in _varying_axes(x) | _varying_axes(w):
    raise ValueError(f"{_OP}: runs inside shard_map(..., check_vma=False) only; x or w is "
                     f"typed varying over {axis_name!r}, i.e. the shard_map has "
                     f"check_vma=True")
  local_chunks = 1  # psum: one det_matmul over the rank's K rows, whatever chunks says
  if merge == "canonical":
    if chunks % tp:
      raise ValueError(f"{_OP}: chunks={chunks} must be a multiple of the size {tp} of axis "
                       f"{axis_name!r}")
    k = k_loc * tp
    if k % chunks:
      where = "" if tp == 1 else f" ({tp} ranks x K/p={k_loc})"
      raise ValueError(f"{_OP}: K={k}{where} must be a multiple of chunks={chunks}")
    local_chunks = chunks // tp
  if merge == "canonical":
    impl, k_pad = _chunk_plan(implementation, x.dtype, n, k_loc // local_chunks)
  else:  # the control: one product over the rank's K rows, as det_matmul runs it
    impl, k_pad = resolve_implementation(implementation, x.dtype, n, k_loc), 0
  st = _Static(axis_name=axis_name, tp=tp, local_chunks=local_chunks, merge=merge,
               implementation=impl, out_dtype=jnp.dtype(x.dtype), k_pad=k_pad)
  lead = x.shape[:-1]
  x2 = x.reshape(math.prod(lead), k_loc)
  return _row_parallel(st, x2, w, bias).reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _partials(st: _Static, x2, w):
  return _stacked_products(st, _split_k(x2, st.local_chunks, st.k_pad),
                           _chunk_weights(w, st.local_chunks, st.k_pad), lhs_transposed=False,
                           rhs_transposed=False, out_dtype=jnp.float32, lhs_stacked=True,
                           rhs_stacked=True)


def _partials_fwd(st: _Static, x2, w):
  return _partials(_training_static(st), x2, w), (x2, w)


def _partials_bwd(st: _Static, res, g):
  x2, w = res
  st = _training_static(st)
  c = st.local_chunks
  kc = w.shape[0] // c
  g = g.astype(x2.dtype)
  # dx_c = dP_c @ w_c^T and dw_c = x_c^T @ dP_c, one fixed-shape product per chunk (a
  # padded chunk's zero rows and columns dropped).
  dx = _chunk_products(st, g, _chunk_weights(w, c, st.k_pad), lhs_transposed=False,
                       rhs_transposed=True, out_dtype=x2.dtype, lhs_stacked=True,
                       rhs_stacked=True)
  dw = _chunk_products(st, _split_k(x2, c, st.k_pad), g, lhs_transposed=True,
                       rhs_transposed=False, out_dtype=w.dtype, lhs_stacked=True,
                       rhs_stacked=True)
  return (jnp.concatenate([d[:, :kc] for d in dx], axis=1),
          jnp.concatenate([d[:kc] for d in dw], axis=0))


_partials.defvjp(_partials_fwd, _partials_bwd)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ChunkedWeight:
  """A ``[K, N]`` weight in the layout :func:`row_parallel_partials` multiplies: its ``C``
  K chunks stacked, each followed by its plan's zero rows (:func:`chunk_weight`).

  Made once outside a decode loop, it keeps the per-step copy of a padded weight out of
  every step (XLA does not hoist a size-increasing ``pad`` out of a loop). A pytree:
  ``stacked [C, K/C + k_pad, N]`` is its leaf, the rest static.
  """
  stacked: jax.Array
  k: int
  k_pad: int
  implementation: str

  def tree_flatten(self):
    return (self.stacked,), (self.k, self.k_pad, self.implementation)

  @classmethod
  def tree_unflatten(cls, aux, leaves):
    return cls(leaves[0], *aux)


def _check_partials_args(op: str, x, w, chunks) -> int:
  """Checks ``x`` (None: no x), ``w`` (an array or its ShapeDtypeStruct) and ``chunks``."""
  if x is not None:
    _validation.check_float_array(op, "x", x)
  _validation.check_float_array(op, "w", w)
  chunks = _validation.check_int(op, "chunks", chunks, minimum=1)
  if chunks & (chunks - 1):
    raise ValueError(f"{op}: chunks must be a power of two, got {chunks}")
  if w.ndim != 2:
    raise ValueError(f"{op}: w must be 2-D [K, N], got shape {w.shape}")
  if w.shape[0] % chunks:
    raise ValueError(f"{op}: K={w.shape[0]} must be a multiple of chunks={chunks}")
  return chunks


def chunk_weight(w: jax.Array, *, chunks: int = contract.ROW_PARALLEL_CHUNKS,
                 implementation: str | None = None) -> ChunkedWeight:
  """``w [K, N]`` in :func:`row_parallel_partials`' layout for ``chunks`` and
  ``implementation`` (the same plan the call would pick), for a forward-only loop that
  multiplies by the same weight every step. A reshape where the chunks need no padding."""
  op = "chunk_weight"
  w = jnp.asarray(w)
  chunks = _check_partials_args(op, None, w, chunks)
  k, n = w.shape
  impl, k_pad = _chunk_plan(implementation, w.dtype, n, k // chunks)
  return ChunkedWeight(_chunk_weights(w, chunks, k_pad), k, k_pad, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prepared_partials(st: _Static, x2, stacked):
  grouped = backend(st.implementation).grouped_matmul
  if grouped is not None and st.local_chunks > 1 and not st.k_pad:
    # The K chunks side by side, as x2 holds them: the grouped kernel reads each chunk's
    # columns in place where TMA can (no chunk-major copy of x2 per step; the same bits).
    return grouped(x2, stacked, out_dtype=jnp.dtype(jnp.float32))
  return _stacked_products(st, _split_k(x2, st.local_chunks, st.k_pad), stacked,
                           lhs_transposed=False, rhs_transposed=False, out_dtype=jnp.float32,
                           lhs_stacked=True, rhs_stacked=True)


def _prepared_fwd(st, x2, stacked):
  return _prepared_partials(st, x2, stacked), None


def _prepared_bwd(st, res, g):
  raise TypeError("row_parallel_partials: a ChunkedWeight is for forward-only loops (a "
                  "decode step); differentiate through the [K, N] weight instead")


_prepared_partials.defvjp(_prepared_fwd, _prepared_bwd)


def row_parallel_partials(x: jax.Array, w: jax.Array, *,
                          chunks: int = contract.ROW_PARALLEL_CHUNKS,
                          implementation: str | None = None) -> jax.Array:
  """The ``C`` float32 chunk partials of :func:`row_parallel_matmul` (unsharded), stacked.

  ``out[c] = det_matmul(x[..., c K/C:(c+1) K/C], w[c K/C:(c+1) K/C], out_dtype=float32)``:
  the very products ``row_parallel_matmul(x, w, chunks=C)`` sums, before its tree, bias and
  rounding, for a consumer that finishes them itself (``nn.add_rms_norm``: the residual add
  and the next RMSNorm in one pass).

  Args:
    x: ``[..., K]`` bfloat16, float16 or float32.
    w: ``[K, N]``, x's dtype; or its :class:`ChunkedWeight` (:func:`chunk_weight` with the
      same ``chunks`` and ``implementation``): the same bits, forward only.
    chunks: ``C``, a power of two dividing ``K``.
    implementation: the ``det_matmul`` implementation of every chunk product.

  Returns:
    ``[C, ..., N]`` float32. Gradients (of a ``[K, N]`` weight): per chunk
    ``dx_c = dP_c w_c^T``, ``dw_c = x_c^T dP_c``.
  """
  op = "row_parallel_partials"
  x = jnp.asarray(x)
  prepared = w if isinstance(w, ChunkedWeight) else None
  if prepared is not None:
    stacked = prepared.stacked
    if stacked.ndim != 3:
      raise ValueError(f"{op}: w.stacked must be [C, K/C + pad, N], got {stacked.shape}")
    w = jax.ShapeDtypeStruct((prepared.k, stacked.shape[2]), stacked.dtype)  # for the checks
  else:
    w = jnp.asarray(w)
  chunks = _check_partials_args(op, x, w, chunks)
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"{op}: need x [..., K] and w [K, N], got {x.shape} and {w.shape}")
  if x.dtype != w.dtype:
    raise TypeError(f"{op}: x and w must have the same dtype, got {x.dtype} and {w.dtype}")
  k, n = w.shape
  impl, k_pad = _chunk_plan(implementation, x.dtype, n, k // chunks)
  st = _Static(axis_name=None, tp=1, local_chunks=chunks, merge="canonical",
               implementation=impl, out_dtype=jnp.dtype(jnp.float32), k_pad=k_pad)
  lead = x.shape[:-1]
  x2 = x.reshape(math.prod(lead), k)
  if prepared is None:
    return _partials(st, x2, w).reshape(chunks, *lead, n)
  want = (chunks, k // chunks + k_pad, n)
  if (prepared.k_pad, prepared.implementation) != (k_pad, impl) or stacked.shape != want:
    raise ValueError(f"{op}: w is a ChunkedWeight of another plan ({stacked.shape[0]} chunks "
                     f"of {stacked.shape[1]} rows, {prepared.implementation!r}) than this "
                     f"call's ({chunks} chunks of {want[1]} rows, {impl!r}); make it with "
                     f"chunk_weight(w, chunks={chunks}, implementation={implementation!r})")
  return _prepared_partials(st, x2, stacked).reshape(chunks, *lead, n)
