"""row_parallel_matmul: one K order (C chunks, a fixed pairwise tree) at every TP degree.

CPU, 8 host devices. Inputs reveal any reordering: wide-dynamic-range rows, and rows whose
products cancel exactly (the result is a pure rounding residue, so any other order of the
additions shows in the bits, even after rounding to bfloat16).
"""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels import contract, det_matmul, row_parallel_matmul
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.gemm import row_parallel as row_parallel_module
from jaxrl_kernels.gemm.api import matmul2d
from jaxrl_kernels.gemm.mosaic import BACKEND as gemm_mosaic_backend
from jaxrl_kernels.gemm.reference import matmul_reference

M, K, N = 12, 256, 44  # N = 44: TP 2 and 4 exchange column blocks, TP 8 gathers partials
TPS = (1, 2, 4, 8)


@functools.cache
def _inputs(dtype, *, m=M, k=K, n=N, seed=0):
  """``x`` [m, k]: wide-range rows, then rows whose second half cancels the first against
  ``w`` (``w``'s second half mirrors its first); ``w`` [k, n]; ``bias`` [n]."""
  ks = jax.random.split(jax.random.key(seed), 3)
  half = wide_rows(ks[0], m, k // 2, jnp.float32)
  cancel = jnp.concatenate([half, -half[:, ::-1]], -1)
  x = jnp.concatenate([wide_rows(ks[1], m - m // 2, k, jnp.float32), cancel[m - m // 2:]])
  v = jax.random.normal(ks[2], (k // 2, n))
  w = jnp.concatenate([v, v[::-1]], 0)
  bias = jnp.linspace(-1.0, 1.0, n)
  return x.astype(dtype), w.astype(dtype), bias.astype(dtype)


_op = jax.jit(row_parallel_matmul, static_argnames=("chunks", "merge", "implementation"))


def _padded(a, axis, k_pad):
  """``a`` with ``k_pad`` zeros appended along ``axis``."""
  if not k_pad:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, k_pad)
  return jnp.pad(a, widths)


@functools.partial(jax.jit, static_argnames=("chunks", "implementation", "k_pad"))
def _canonical_by_definition(x, w, bias, chunks=contract.ROW_PARALLEL_CHUNKS,
                             implementation=None, k_pad=0):
  """The contract written out: det_matmul per K chunk in float32 (each chunk and its weight
  rows followed by ``k_pad`` zeros), adjacent-pair tree, float32 bias, one rounding."""
  kc = x.shape[-1] // chunks
  parts = [det_matmul(_padded(x[..., c * kc:(c + 1) * kc], -1, k_pad),
                      _padded(w[c * kc:(c + 1) * kc], 0, k_pad),
                      out_dtype=jnp.float32, implementation=implementation)
           for c in range(chunks)]
  while len(parts) > 1:
    parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
  y = parts[0] if bias is None else parts[0] + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def _mesh(tp):
  return Mesh(np.asarray(jax.devices()[:tp]), ("tp",))


def _sharded(tp, merge="canonical", *, with_bias=True, **kw):
  """The op on a ``tp``-rank mesh: x split over K, w over its rows, bias replicated."""
  def body(x, w, b=None):
    return row_parallel_matmul(x, w, b, axis_name="tp", merge=merge, **kw)
  specs = (P(None, "tp"), P("tp", None)) + ((P(),) if with_bias else ())
  return shard_map(body, mesh=_mesh(tp), in_specs=specs, out_specs=P(), check_vma=False)


def test_exported_and_docstring_example():
  assert jk.row_parallel_matmul is row_parallel_matmul
  assert jk.gemm.row_parallel_matmul is row_parallel_matmul
  res = doctest.testmod(row_parallel_module, verbose=False)
  assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unsharded_is_the_contract_written_out(dtype):
  x, w, b = _inputs(dtype)
  assert_bitwise_equal(_op(x, w, b), _canonical_by_definition(x, w, b), f"unsharded {dtype}")
  # Leading dims are rows; chunks=2 is a different (coarser) tree of the same kind.
  x3 = x.reshape(3, 4, K)
  assert_bitwise_equal(_op(x3, w, None, chunks=2),
                       _canonical_by_definition(x, w, None, chunks=2).reshape(3, 4, N),
                       "chunks=2, no bias")


def test_stacked_chunk_products_are_the_per_chunk_calls():
  """"interpret" runs the C chunk products as one vmapped Pallas call (a grid axis) and the
  backward's as one product over all chunks for each of dx and dw (no chunk copies, no
  concatenation): each chunk's bits are still those of det_matmul on that chunk alone,
  forward, dx and dw, unsharded and at TP = 2."""
  x, w, b = _inputs("float32", m=5, k=64, n=16)
  out = _op(x, w, b, implementation="interpret")
  assert_bitwise_equal(out, _canonical_by_definition(x, w, b, implementation="interpret"),
                       "interpret")
  cot = jax.random.normal(jax.random.key(9), out.shape)
  dx, dw, db = jax.jit(jax.grad(
      lambda *a: jnp.sum(row_parallel_matmul(*a, implementation="interpret") * cot),
      argnums=(0, 1, 2)))(x, w, b)
  kc = 64 // contract.ROW_PARALLEL_CHUNKS
  dx_ref = jax.jit(lambda: jnp.concatenate(
      [det_matmul(cot, w[c * kc:(c + 1) * kc], transpose_b=True, implementation="interpret")
       for c in range(contract.ROW_PARALLEL_CHUNKS)], -1))()
  assert_bitwise_equal(dx, dx_ref, "interpret dx")
  # dw_c = x_c^T @ dy: the product det_matmul's own backward runs (x_c read transposed)
  dw_ref = jax.jit(lambda: jnp.concatenate(
      [matmul2d(x[:, c * kc:(c + 1) * kc], cot, lhs_transposed=True, rhs_transposed=False,
                out_dtype=w.dtype, implementation="interpret")
       for c in range(contract.ROW_PARALLEL_CHUNKS)], 0))()
  assert_bitwise_equal(dw, dw_ref, "interpret dw")
  grads2 = _grads(_sharded(2, implementation="interpret"), x, w, b, cot)
  for name, g, r in zip(("dx", "dw", "dbias"), grads2, (dx, dw, db)):
    assert_bitwise_equal(g, r, f"interpret TP=2 {name}")
  backward = str(jax.make_jaxpr(jax.grad(
      lambda x: jnp.sum(row_parallel_matmul(x, w, b, implementation="interpret") * cot)))(x))
  assert "concatenate" not in backward  # the whole dx product, not the chunks' columns
  c64, x64 = np.asarray(cot, np.float64), np.asarray(x, np.float64)
  assert rel_err(dw, x64.T @ c64) <= TOL["float32"][1]
  assert rel_err(db, c64.sum(0)) <= TOL["float32"][1]


def test_mosaic_whole_backward_drops_the_padding_where_the_whole_weight_fits():
  """A padded Mosaic plan's backward multiplies the unpadded whole weight where Mosaic takes
  its K (a multiple of the 64-wide tile: Qwen2.5-0.5B's 896 and 4864, and their halves at
  TP = 2), the padded layout where it does not (the chunks' 112 and 608 at TP = 8): the
  same elements either way (tests/gemm/test_row_parallel.py::test_gpu_kernels_follow_the_
  contract checks the bits on a GPU)."""
  takes = gemm_mosaic_backend.takes_whole
  for k in (4864, 896, 2432, 448):
    assert takes(8192, k, 896) and takes(1000, k, 896), k
  for k in (608, 112, 900):
    assert not takes(8192, k, 896), k


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_zero_padded_chunks_give_the_same_bits(impl, monkeypatch):
  """The layout a chunk K off the K tile runs on Mosaic (``_chunk_plan``): each chunk and its
  weight rows followed by zeros. Forced here for every chunk (16 zeros) on the CPU kernels:
  the forward, the stacked partials, dx, dw and dbias are the unpadded op's bits, unsharded
  and at TP = 2; the padded chunks' products are really run (the jit key holds the pad)."""
  x, w, b = _inputs("bfloat16", m=6, k=128, n=16)
  cot = jax.random.normal(jax.random.key(3), (6, 16)).astype(jnp.bfloat16)

  def everything():
    out = jax.jit(functools.partial(row_parallel_matmul, implementation=impl))(x, w, b)
    parts = jax.jit(functools.partial(jk.gemm.row_parallel_partials,
                                      implementation=impl))(x, w)
    grads = jax.jit(jax.grad(
        lambda *a: jnp.sum(row_parallel_matmul(*a, implementation=impl).astype(jnp.float32)
                           * cot.astype(jnp.float32)), argnums=(0, 1, 2)))(x, w, b)
    pgrads = jax.jit(jax.grad(
        lambda x, w: jnp.sum(jk.gemm.row_parallel_partials(x, w, implementation=impl)[3]
                             * cot.astype(jnp.float32)), argnums=(0, 1)))(x, w)
    tp2 = jax.jit(_sharded(2, implementation=impl))(x, w, b)
    cw = jk.gemm.chunk_weight(w, implementation=impl)
    prepared = jax.jit(functools.partial(jk.gemm.row_parallel_partials,
                                         implementation=impl))(x, cw)
    return (out, parts, *grads, *pgrads, tp2, prepared)

  plain = everything()
  plan = row_parallel_module._chunk_plan
  seen = []

  def padded_plan(implementation, dtype, n, k_chunk):
    seen.append(k_chunk)
    return plan(implementation, dtype, n, k_chunk)[0], 16

  monkeypatch.setattr(row_parallel_module, "_chunk_plan", padded_plan)
  padded = everything()
  assert seen, "the padded plan was not used"
  names = ("out", "partials", "dx", "dw", "dbias", "partials dx", "partials dw", "TP=2",
           "ChunkedWeight partials")
  for name, got, ref in zip(names, padded, plain, strict=True):
    assert got.shape == ref.shape, name
    assert_bitwise_equal(got, ref, f"{impl} padded {name}")
  # Not vacuous: the padded forward's chunk products are different calls of the kernel.
  assert_bitwise_equal(padded[0], _canonical_by_definition(x, w, b, implementation=impl,
                                                           k_pad=16), "written out")


def test_chunked_weight_is_checked_and_forward_only():
  x, w, _ = _inputs("float32", m=4, k=128, n=16)
  cw = jk.gemm.chunk_weight(w)
  assert cw.stacked.shape == (contract.ROW_PARALLEL_CHUNKS, 128 // contract.ROW_PARALLEL_CHUNKS,
                              16)
  assert_bitwise_equal(jk.gemm.row_parallel_partials(x, cw),
                       jk.gemm.row_parallel_partials(x, w), "ChunkedWeight")
  with pytest.raises(ValueError, match="another plan"):
    jk.gemm.row_parallel_partials(x, cw, chunks=4)
  with pytest.raises(ValueError, match=r"got \(4, 64\) and \(128, 16\)"):
    jk.gemm.row_parallel_partials(x[:, :64], cw)
  with pytest.raises(TypeError, match="forward-only"):
    jax.grad(lambda w: jnp.sum(jk.gemm.row_parallel_partials(x, jk.gemm.chunk_weight(w))))(w)
  with pytest.raises(ValueError, match="chunks=8"):
    jk.gemm.chunk_weight(w[:100])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tp_degree_gives_the_unsharded_bits(dtype):
  x, w, b = _inputs(dtype)
  ref = _op(x, w, b)
  for tp in TPS:
    assert_bitwise_equal(jax.jit(_sharded(tp))(x, w, b), ref, f"TP={tp} {dtype}")
  assert_bitwise_equal(jax.jit(_sharded(8, with_bias=False))(x, w), _op(x, w, None),
                       f"TP=8 {dtype} no bias")


def test_psum_control_changes_bits_where_canonical_does_not():
  """The Megatron psum layer's bits depend on TP, and plain det_matmul's single K walk is
  yet another order: on the cancelling rows the stock paths disagree with the canonical."""
  for dtype in ("float32", "bfloat16"):
    x, w, _ = _inputs(dtype)
    ref = bits(_op(x, w, None))
    differs = [tp for tp in TPS
               if not np.array_equal(bits(jax.jit(_sharded(tp, "psum", with_bias=False))(x, w)),
                                     ref)]
    assert len(differs) >= 2, f"psum matched the canonical bits at TP {differs} ({dtype})"
    assert not np.array_equal(bits(jax.jit(det_matmul)(x, w)), ref), dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_batch_invariant(dtype):
  x, w, b = _inputs(dtype)
  full = np.asarray(_op(x, w, b))
  for r in (0, 5, 11):
    assert_bitwise_equal(_op(x[r:r + 1], w, b), full[r:r + 1], f"row {r} alone")
  assert_bitwise_equal(_op(x[3:10], w, b), full[3:10], "rows 3:10")
  # Under TP too: a row alone on a 4-rank mesh equals the row inside the unsharded batch.
  assert_bitwise_equal(jax.jit(_sharded(4))(x[7:8], w, b), full[7:8], "TP=4 row alone")
  assert_bitwise_equal(_op(x[3], w, b), full[3], "1-D x")
  assert _op(x[:0], w, b).shape == (0, N)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accuracy_vs_float64(dtype):
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (M, K)).astype(dtype)
  w = (jax.random.normal(ks[1], (K, N)) / 16).astype(dtype)
  b = jax.random.normal(ks[2], (N,)).astype(dtype)
  ref = matmul_reference(x, w) + np.asarray(b, np.float64)
  assert rel_err(_op(x, w, b), ref) <= TOL[dtype][0]


def _grads(fn, x, w, b, cot):
  return jax.jit(jax.grad(lambda x, w, b: jnp.sum(fn(x, w, b).astype(jnp.float32) * cot),
                          argnums=(0, 1, 2)))(x, w, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_through_shard_map_equal_the_unsharded(dtype):
  """jax.grad around shard_map(check_vma=False): dx, dw, dbias at TP = 1 ... 8 are the
  unsharded gradients bit for bit, and those match float64 within the contract's tolerance."""
  x, w, b = _inputs(dtype)
  cot = jax.random.normal(jax.random.key(4), (M, N))
  ref = _grads(row_parallel_matmul, x, w, b, cot)
  for tp in TPS:
    for name, g, r in zip(("dx", "dw", "dbias"), _grads(_sharded(tp), x, w, b, cot), ref):
      assert_bitwise_equal(g, r, f"TP={tp} {name} {dtype}")
  c64 = np.asarray(cot, np.float64)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for name, g, r in zip(("dx", "dw", "dbias"), ref, (c64 @ w64.T, x64.T @ c64, c64.sum(0))):
    assert rel_err(g, r) <= TOL[dtype][1], name
  # The forward inside the training step has the forward-only bits (mode invariance).
  y, _ = jax.vjp(jax.jit(_sharded(2)), x, w, b)
  assert_bitwise_equal(y, _op(x, w, b), "forward under vjp")


def test_psum_control_gradients_are_correct():
  x, w, b = _inputs("float32")
  cot = jax.random.normal(jax.random.key(5), (M, N))
  ref = _grads(row_parallel_matmul, x, w, b, cot)
  for name, g, r in zip(("dx", "dw", "dbias"), _grads(_sharded(4, "psum"), x, w, b, cot), ref):
    assert rel_err(g, r) <= TOL["float32"][1], name


def test_bad_arguments_are_named():
  x, w, b = _inputs("float32")
  cases = [
      (dict(chunks=6), ValueError, r"chunks must be a power of two, got 6"),
      (dict(chunks=0), ValueError, r"chunks must be >= 1, got 0"),
      (dict(chunks=2.0), TypeError, r"chunks must be an integer, got 2.0"),
      (dict(merge="mean"), ValueError, r"merge must be one of \('canonical', 'psum'\), "
                                       r"got 'mean'"),
      (dict(axis_name=3), TypeError, r"axis_name must be a str or None, got 3"),
  ]
  for kw, err, msg in cases:
    with pytest.raises(err, match=msg):
      row_parallel_matmul(x, w, b, **kw)
  with pytest.raises(ValueError, match=r"K=20 must be a multiple of chunks=8"):
    row_parallel_matmul(x[:, :20], w[:20], b)
  with pytest.raises(TypeError, match=r"x and w must have the same dtype, got x float32 and "
                                      r"w bfloat16"):
    row_parallel_matmul(x, w.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match=r"x must have dtype in .*, got int32"):
    row_parallel_matmul(x.astype(jnp.int32), w)
  with pytest.raises(ValueError, match=r"x has K=128 \(shape \(12, 128\)\) but w \[K, N\] has "
                                       r"K=256"):
    row_parallel_matmul(x[:, :128], w)
  with pytest.raises(ValueError, match=r"w must be 2-D \[K, N\], got shape \(256,\)"):
    row_parallel_matmul(x, w[:, 0])
  with pytest.raises(ValueError, match=r"bias must have shape \(44,\) \(w's N\), got \(43,\)"):
    row_parallel_matmul(x, w, b[:43])


def test_bad_meshes_are_named():
  x, w, b = _inputs("float32")
  with pytest.raises(ValueError, match=r"chunks=2 must be a multiple of the size 4 of axis "
                                       r"'tp'"):
    _sharded(4, chunks=2)(x, w, b)
  # The psum control has no chunks: one det_matmul per rank, at any TP degree.
  assert rel_err(_sharded(4, "psum", chunks=2)(x, w, b), _op(x, w, b)) <= TOL["float32"][0]
  # K = 8 ranks x 4 rows: 32 is not a multiple of 64 chunks (a power of two, 64 % 8 == 0).
  with pytest.raises(ValueError, match=r"K=32 \(8 ranks x K/p=4\) must be a multiple of "
                                       r"chunks=64"):
    _sharded(8, chunks=64)(x[:, :32], w[:32], b)
  typed = shard_map(lambda x, w: row_parallel_matmul(x, w, axis_name="tp"), mesh=_mesh(2),
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(), check_vma=True)
  with pytest.raises(ValueError, match=r"check_vma=False\) only; x or w is typed varying over "
                                       r"'tp'"):
    typed(x, w)


def _gpu_impls():
  if jax.default_backend() != "gpu":
    return [None]
  from jaxrl_kernels._backend import is_hopper
  return [None, "triton"] + (["mosaic", "cuda"] if is_hopper() else [])


# (896, 896) and (4864, 896): qwen2.5-0.5b's o_proj and down_proj, K/C = 112 and 608 off
# the K tile: on Hopper None and "mosaic" run Mosaic on chunks zero-padded to 128 and 640.
_GPU_CASES = [(impl, k, n) for impl in _gpu_impls()
              for k, n in ((4096, 2048), (14336, 4096), (896, 896), (4864, 896))
              if impl != "cuda" or k % (64 * contract.ROW_PARALLEL_CHUNKS) == 0]


def _expected_plan(impl, k):
  """``(implementation, k_pad)`` the chunk products of ``_GPU_CASES`` must run."""
  from jaxrl_kernels._backend import is_hopper
  kc = k // contract.ROW_PARALLEL_CHUNKS
  pad = -kc % 64
  if impl in (None, "mosaic") and is_hopper():
    return "mosaic", pad
  return impl or "triton", 0


@pytest.mark.gpu
@pytest.mark.parametrize("impl,k,n", _GPU_CASES)
def test_gpu_kernels_follow_the_contract(impl, k, n):
  """Each GPU implementation (one vmapped launch for Triton and CUTLASS, one grouped launch
  for the Mosaic forward; the backward's dx and dw as one product each over all chunks on
  Triton and Mosaic, per chunk on CUTLASS) gives each chunk the bits of det_matmul on that
  chunk alone: the forward (primal and differentiated), dx, dw, and rows at M = 1, 64,
  1000."""
  kc = k // contract.ROW_PARALLEL_CHUNKS
  run, pad = _expected_plan(impl, k)
  assert row_parallel_module._chunk_plan(impl, jnp.bfloat16, n, kc) == (run, pad)
  x, w, b = _inputs("bfloat16", m=1000, k=k, n=n)
  full = np.asarray(_op(x, w, b, implementation=impl))
  assert_bitwise_equal(full, _canonical_by_definition(x, w, b, implementation=run, k_pad=pad),
                       f"{impl}")
  for m in (1, 64):
    assert_bitwise_equal(_op(x[:m], w, b, implementation=impl), full[:m], f"{impl} M={m}")
  cot = jax.random.normal(jax.random.key(1), (1000, n)).astype(jnp.bfloat16)
  trained, vjp = jax.vjp(lambda x: row_parallel_matmul(x, w, b, implementation=impl), x)
  # A differentiated call runs a padded plan's forward chunks unpadded on Triton: its
  # forward is the primal's bits.
  assert_bitwise_equal(trained, full, f"{impl} forward under differentiation")
  # The backward: each chunk's dx columns and dw rows are the chunk's products on the plan's
  # kernel (a padded plan: of the padded chunk, its zero columns / rows dropped).
  c_ = contract.ROW_PARALLEL_CHUNKS
  w3 = row_parallel_module._chunk_weights(w, c_, pad)
  x3 = row_parallel_module._split_k(x, c_, pad)
  kw = dict(out_dtype=jnp.bfloat16, implementation=run)
  dx_ref = jax.jit(lambda: jnp.concatenate(
      [matmul2d(cot, w3[c], lhs_transposed=False, rhs_transposed=True, **kw)[:, :kc]
       for c in range(c_)], -1))()
  assert_bitwise_equal(vjp(cot)[0], dx_ref, f"{impl} dx")
  _, vjp_w = jax.vjp(lambda w: row_parallel_matmul(x, w, b, implementation=impl), w)
  dw_ref = jax.jit(lambda: jnp.concatenate(
      [matmul2d(x3[c], cot, lhs_transposed=True, rhs_transposed=False, **kw)[:kc]
       for c in range(c_)], 0))()
  assert_bitwise_equal(vjp_w(cot)[0], dw_ref, f"{impl} dw")
  assert rel_err(full, matmul_reference(x, w) + np.asarray(b, np.float64)) <= TOL["bfloat16"][0]
  # From CHUNK_TREE_MIN_ROWS rows the Mosaic forward (primal and differentiated) is one
  # chunk-tree launch: still the contract's bits.
  xb, _, _ = _inputs("bfloat16", m=1100, k=k, n=n, seed=3)
  st = row_parallel_module._Static(None, 1, c_, "canonical", run, jnp.dtype(jnp.bfloat16), pad)
  assert row_parallel_module._chunk_tree_applies(st, 1100) == (run == "mosaic")
  big = _op(xb, w, b, implementation=impl)
  assert_bitwise_equal(big, _canonical_by_definition(xb, w, b, implementation=run, k_pad=pad),
                       f"{impl} at 1100 rows")
  big_trained, big_vjp = jax.vjp(
      lambda x, w: row_parallel_matmul(x, w, b, implementation=impl), xb, w)
  assert_bitwise_equal(big_trained, big, f"{impl} differentiated, 1100 rows")
  # Its backward (from the chunk tree's residual, the padded layout for a padded plan) is
  # the chunks' products as above.
  cot_b = jax.random.normal(jax.random.key(2), (1100, n)).astype(jnp.bfloat16)
  xb3 = row_parallel_module._split_k(xb, c_, pad)
  dxb, dwb = big_vjp(cot_b)
  assert_bitwise_equal(dxb, jax.jit(lambda: jnp.concatenate(
      [matmul2d(cot_b, w3[c], lhs_transposed=False, rhs_transposed=True, **kw)[:, :kc]
       for c in range(c_)], -1))(), f"{impl} dx, 1100 rows")
  assert_bitwise_equal(dwb, jax.jit(lambda: jnp.concatenate(
      [matmul2d(xb3[c], cot_b, lhs_transposed=True, rhs_transposed=False, **kw)[:kc]
       for c in range(c_)], 0))(), f"{impl} dw, 1100 rows")


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,chunks", [(896, 896, 2), (4864, 896, 4)])
def test_gpu_canonical_model_chunks_follow_the_contract(k, n, chunks):
  """Qwen2.5-0.5B's canonical chunks (``models.canonical_row_chunks``: o_proj 2 x 448,
  down_proj 4 x 1216, whole K tiles): decode rows (one grouped launch, the decode tile of
  one product), 1000 rows and the chunk tree's 2048 give the definition's bits."""
  x, w, b = _inputs("bfloat16", m=2048, k=k, n=n)
  want = np.asarray(_canonical_by_definition(x, w, b, chunks=chunks))
  for m in (1, 64, 1000, 2048):
    assert_bitwise_equal(_op(x[:m], w, b, chunks=chunks), want[:m], f"chunks={chunks} M={m}")
  assert rel_err(want, matmul_reference(x, w) + np.asarray(b, np.float64)) <= TOL["bfloat16"][0]


@pytest.mark.parametrize("m,side_by_side", [(1, True), (4, True), (64, True), (256, True),
                                             (20, False)])
def test_decode_partials_read_the_chunks_in_place(m, side_by_side):
  """A decode step's partials (a ``ChunkedWeight`` on the Mosaic kernel, chunks off no K
  tile) lower for CUDA as one grouped launch reading x's K chunks in place: no transposed
  (chunk-major) copy of x. Rows the 8-row tile cannot view in place (20) take the
  chunk-major copy. Bits: test_gpu_decode_partials_read_the_chunks_in_place."""
  st = row_parallel_module._Static(None, 1, 8, "canonical", "mosaic", jnp.dtype(jnp.float32))
  sd = jax.ShapeDtypeStruct
  fn = jax.jit(lambda x, w3: row_parallel_module._prepared_partials(st, x, w3))
  exported = jax.export.export(fn, platforms=["cuda"])(sd((m, 2048), jnp.bfloat16),
                                                       sd((8, 256, 2048), jnp.bfloat16))
  assert exported.out_avals[0].shape == (8, m, 2048)
  module = exported.mlir_module()
  assert "det_matmul_grouped" in module
  assert ("stablehlo.transpose" not in module) == side_by_side


@pytest.mark.hopper
@pytest.mark.parametrize("m", [1, 4, 8, 20, 40, 64, 72, 200, 256])
@pytest.mark.parametrize("k,n,chunks", [(2048, 2048, 8), (4864, 896, 4)])
def test_gpu_decode_partials_read_the_chunks_in_place(m, k, n, chunks):
  """The grouped product reading x's K chunks in place (``[M, C Kc]``, the decode step's
  layout) gives the chunk-major ``[C, M, Kc]`` launch's bits and each chunk's det_matmul
  alone, at row counts below, at and past one CTA tile; through ``row_parallel_partials``
  with a ``ChunkedWeight`` too."""
  from jaxrl_kernels.pallas import gemm_mosaic
  x, w, _ = _inputs("bfloat16", m=m, k=k, n=n)
  kc = k // chunks
  w3 = row_parallel_module._chunk_weights(w, chunks)
  stacked = gemm_mosaic.grouped_matmul(row_parallel_module._split_k(x, chunks), w3,
                                       out_dtype=jnp.float32)
  want = jnp.stack([matmul2d(x[:, c * kc:(c + 1) * kc], w3[c], lhs_transposed=False,
                             rhs_transposed=False, out_dtype=jnp.float32,
                             implementation="mosaic") for c in range(chunks)])
  assert_bitwise_equal(stacked, want, f"chunk-major, M={m}")
  # In place where the 8-row tile views M rows (a box past them reads zeros: M = 8, 40, 72
  # and 200 end inside a CTA tile, 72 and 200 in a product's second row tile), else the
  # stacked copy (M = 20).
  in_place = gemm_mosaic.grouped_matmul(x, w3, out_dtype=jnp.float32)
  assert_bitwise_equal(in_place, want, f"side by side, M={m}")
  cw = jk.gemm.chunk_weight(w, chunks=chunks, implementation="mosaic")
  prepared = jax.jit(functools.partial(jk.gemm.row_parallel_partials, chunks=chunks,
                                       implementation="mosaic"))(x, cw)
  assert_bitwise_equal(prepared, want, f"ChunkedWeight partials, M={m}")


@pytest.mark.hopper
@pytest.mark.parametrize("m,kc,n,with_bias", [(1000, 128, 896, True), (1, 128, 896, False),
                                              (64, 640, 896, False), (300, 64, 256, True),
                                              (1100, 608, 896, True), (2048, 112, 896, False),
                                              (200, 48, 256, True)])
def test_chunk_tree_kernel_is_the_chunk_products_and_the_tree(m, kc, n, with_bias):
  """gemm_mosaic.chunk_tree_matmul (the C chunk products and their pairwise tree in one
  Mosaic launch, the pending tiles in registers and shared memory) gives the bits of matmul
  on each chunk zero-padded to whole K tiles in float32, pairwise_tree, + bias, one rounding,
  on rows of wide range; a left-to-right sum of the same products is the control. Chunks off
  the K tile (608, 112, 48: K steps of 32 and 16 columns through chunk views, no padded
  copy) give the padded chunks' bits."""
  from jaxrl_kernels.pallas import gemm_mosaic as gm
  c_ = contract.ROW_PARALLEL_CHUNKS
  ks = jax.random.split(jax.random.key(m + kc), 3)
  x = wide_rows(ks[0], m, c_ * kc, jnp.bfloat16)
  w = (jax.random.normal(ks[1], (c_ * kc, n)) * 0.05).astype(jnp.bfloat16)
  b = jax.random.normal(ks[2], (n,)) if with_bias else None
  kw = dict(lhs_transposed=False, rhs_transposed=False, out_dtype=jnp.float32)
  pad = -kc % contract.GEMM_TILE_K
  parts = jax.jit(lambda x, w: [
      gm.matmul(x3, w3, **kw) for x3, w3 in zip(row_parallel_module._split_k(x, c_, pad),
                                                row_parallel_module._chunk_weights(w, c_, pad))
  ])(x, w)
  tree = row_parallel_module.pairwise_tree(parts)
  want = (tree if b is None else tree + b).astype(jnp.bfloat16)
  got = jax.jit(lambda x, w, b: gm.chunk_tree_matmul(x, w, b, chunks=c_,
                                                     out_dtype=jnp.bfloat16))(x, w, b)
  assert_bitwise_equal(got, want, "chunk tree kernel")
  seq = functools.reduce(lambda a, p: a + p, parts)
  seq = (seq if b is None else seq + b).astype(jnp.bfloat16)
  if m >= 64:
    assert not np.array_equal(bits(seq), bits(want)), "control: the order must show"
  assert rel_err(got, matmul_reference(x, w) + (0 if b is None else np.asarray(b, np.float64))
                 ) <= TOL["bfloat16"][0]


@pytest.mark.gpu
def test_gpu_ranks_subtrees_rebuild_the_unsharded_result():
  """TP emulated on one GPU in float32 (where the op's output is its float32 tree value):
  the subtrees that p ranks compute on their K slices, combined by the top of the tree,
  are the unsharded result's bits, for p = 2, 4, 8; and a one-device shard_map is too."""
  x, w, _ = _inputs("float32", m=300, k=2048, n=512)
  full = _op(x, w, None)
  for p in (2, 4, 8):
    kp = 2048 // p
    subs = jnp.stack([_op(x[:, r * kp:(r + 1) * kp], w[r * kp:(r + 1) * kp], None,
                          chunks=contract.ROW_PARALLEL_CHUNKS // p) for r in range(p)])
    while subs.shape[0] > 1:
      subs = subs[0::2] + subs[1::2]
    assert_bitwise_equal(subs[0], full, f"emulated TP={p}")
  assert_bitwise_equal(jax.jit(_sharded(1, with_bias=False))(x, w), full, "shard_map TP=1")
