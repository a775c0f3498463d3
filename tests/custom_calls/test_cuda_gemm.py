"""The SM90 CUDA custom call behind ``det_matmul(..., implementation="cuda")``.

CPU (CI): the library compiles with nvcc and exports its FFI handler; bad
inputs and missing toolchain/GPU raise clear errors. GPU (``-m gpu``, Hopper):
accuracy, bitwise row invariance, layouts, gradients, jit and CUDA graphs, and
a bit comparison with the Mosaic kernel.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels import _backend
from jaxrl_kernels._backend import num_sms
from jaxrl_kernels.custom_calls import build, gemm_ffi

LAYOUTS = [(False, False), (False, True), (True, False)]  # NN, NT, TN
# (lhs_transposed, rhs_transposed, float32 output): TN (dB) writes the input dtype only.
LAYOUTS_OUT = [(lt, rt, f32) for lt, rt in LAYOUTS for f32 in (False, True) if not (lt and f32)]


def _on_hopper() -> bool:
  return _backend.platform() == "gpu" and _backend.is_hopper()


def _operands(key, m, n, k, dtype, lhs_t, rhs_t, *, wide=False):
  ka, kb = jax.random.split(key)
  a = wide_rows(ka, m, k, dtype) if wide else jax.random.normal(ka, (m, k)).astype(dtype)
  b = jax.random.normal(kb, (k, n)).astype(dtype)
  return (a.T if lhs_t else a), (b.T if rhs_t else b)


def _ref64(lhs, rhs, lhs_t, rhs_t):
  a = np.asarray(lhs, np.float64)
  b = np.asarray(rhs, np.float64)
  return (a.T if lhs_t else a) @ (b.T if rhs_t else b)


def _mm(lhs, rhs, lhs_t=False, rhs_t=False, out_dtype=None, config=None):
  return gemm_ffi.matmul_cuda(lhs, rhs, lhs_transposed=lhs_t, rhs_transposed=rhs_t,
                              out_dtype=out_dtype or lhs.dtype, config=config)


# ----------------------------------------------------------------------------- CPU: build


def _nvcc_or_skip() -> str:
  try:
    return build.find_nvcc()
  except RuntimeError as e:
    pytest.skip(f"nvcc is not installed here: {e}")


# About 4 minutes of nvcc on a 2-core machine: kept out of CI's default run (`-m "not slow"`);
# the GPU run builds the same library before its tests.
@pytest.mark.slow
def test_library_compiles_and_exports_the_handler(tmp_path):
  """The real build (same command as first use) on this machine; no GPU needed."""
  _nvcc_or_skip()
  lib = build.build(tmp_path)
  assert lib == tmp_path / build.LIB_NAME and lib.stat().st_size > 0
  nm = shutil.which("nm")
  if nm is None:
    pytest.skip("the library built, but binutils' nm is not installed to list its symbols")
  out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                       check=True).stdout
  exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
  for sym in build.HANDLER_SYMBOLS:
    assert sym in exported, f"{sym} is not exported by {lib}"
  # -fvisibility=hidden: CUTLASS's templates stay internal.
  assert not any("cutlass" in s for s in exported), "CUTLASS symbols leak from the library"


def test_cache_is_keyed_by_jax_version_and_reused(tmp_path, monkeypatch):
  _nvcc_or_skip()
  monkeypatch.setenv("JAXRL_KERNELS_CACHE", str(tmp_path))
  cache = build.default_cache_dir()
  assert cache.parent == tmp_path
  assert cache.name.startswith(f"{jax.__version__}-sm90a-")
  cache.mkdir(parents=True)
  (cache / build.LIB_NAME).write_bytes(b"cached")

  def no_compile(*args, **kwargs):
    raise AssertionError("a cached library must not be rebuilt")

  monkeypatch.setattr(build.subprocess, "run", no_compile)
  monkeypatch.setattr(build, "cache_key", lambda: cache.name.rsplit("-", 1)[1])
  assert build.build() == cache / build.LIB_NAME


def test_missing_nvcc_is_a_clear_runtime_error(monkeypatch):
  monkeypatch.delenv("NVCC", raising=False)
  monkeypatch.delenv("CUDA_HOME", raising=False)
  monkeypatch.setenv("PATH", "/nonexistent")
  monkeypatch.setattr(build, "_FALLBACK_NVCC", "/nonexistent/nvcc")
  with pytest.raises(RuntimeError, match="nvcc"):
    build.find_nvcc()


def test_missing_cutlass_is_a_clear_runtime_error(monkeypatch):
  monkeypatch.setenv("CUTLASS_INCLUDE_DIR", "/nonexistent")
  monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match="CUTLASS headers were not found.*nvidia-cutlass"):
    build.cutlass_include_dir()


# ----------------------------------------------------------------------------- CPU: tile rule


@pytest.mark.parametrize("m,n,expected", [
    (64, 4096, "small"),      # 16 large tiles on 132 SMs
    (256, 4096, "small"),     # 64 large tiles: fewer than half of the SMs
    (256, 14336, "large"),    # 112 large tiles: one wave
    (1024, 4096, "large"),    # 128 large tiles: one wave; medium would need two
    (1024, 14336, "medium"),  # 448 large tiles = 3.4 waves; 896 medium = 6.8
    (2048, 14336, "large"),   # 896 large tiles = 6.8 waves
    (8192, 14336, "large"),
])
def test_tile_rule_on_132_sms(m, n, expected):
  assert gemm_ffi.tile_for(m, n, 132) == expected
  assert expected in gemm_ffi.TILES


def test_tile_rule_follows_the_sm_count():
  # 448 large tiles fill 4 full waves of 112 SMs: no reason for the smaller tile.
  assert gemm_ffi.tile_for(1024, 14336, 112) == "large"
  assert gemm_ffi.tile_for(1024, 14336, 132) == "medium"


# ----------------------------------------------------------------------------- CPU: errors


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_unsupported_input_dtype_is_a_type_error(dtype):
  x = jnp.ones((4, 8), dtype)
  with pytest.raises(TypeError, match=f"inputs must be one of .*got {dtype}"):
    _mm(x, jnp.ones((8, 16), dtype))


def test_bad_arguments_name_expected_and_actual():
  a = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(TypeError, match="same dtype"):
    _mm(a, jnp.ones((8, 16), jnp.float16))
  with pytest.raises(TypeError, match=r"out_dtype must be one of \('bfloat16', 'float32'\).*"
                                      "got float16"):
    _mm(a, jnp.ones((8, 16), jnp.bfloat16), out_dtype=jnp.float16)
  with pytest.raises(TypeError, match="with lhs_transposed=True, got float32"):
    _mm(a.T, jnp.ones((8, 16), jnp.bfloat16), lhs_t=True, out_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"K=8 \(shape \(4, 8\)\) but rhs \[K, N\] has K=9"):
    _mm(a, jnp.ones((9, 16), jnp.bfloat16))
  with pytest.raises(ValueError, match="not compiled in"):
    _mm(a.T, jnp.ones((16, 8), jnp.bfloat16), lhs_t=True, rhs_t=True)
  with pytest.raises(TypeError, match="must be a bool"):
    gemm_ffi.matmul_cuda(a, a.T, lhs_transposed=0, rhs_transposed=False, out_dtype=a.dtype)


@pytest.mark.skipif(_on_hopper(), reason="checks the error raised where there is no Hopper GPU")
def test_without_hopper_gpu_is_an_unavailable_error_naming_it():
  a = jnp.ones((4, 8), jnp.bfloat16)
  want = r"needs a CUDA GPU" if _backend.platform() != "gpu" else r"needs a Hopper GPU \(sm_90\)"
  with pytest.raises(_backend.ImplementationUnavailableError, match=want):
    _mm(a, jnp.ones((8, 16), jnp.bfloat16))


def test_config_checks_its_knobs():
  assert gemm_ffi.Config() == gemm_ffi.Config(None, 0, "heuristic")
  with pytest.raises(ValueError, match=r"tile must be one of .*got 'huge'"):
    gemm_ffi.Config(tile="huge")
  with pytest.raises(ValueError, match=r"swizzle must be one of \(0, 1, 2, 4, 8\), got 3"):
    gemm_ffi.Config(swizzle=3)
  with pytest.raises(ValueError, match=r"raster must be one of .*got 'h'"):
    gemm_ffi.Config(raster="h")


def test_cuda_sources_read_no_environment_variable():
  """The tile and the CTA walk reach the kernel only as FFI attributes (jit cache key)."""
  src = pathlib.Path(gemm_ffi.__file__).parent
  for name in (*build.SOURCES, *build.HEADERS):
    text = (src / name).read_text()
    assert "getenv" not in text, name
  handler = (src / "det_gemm_sm90.cu").read_text()
  for attr in ("tile", "swizzle", "raster"):
    assert f'.Attr<int32_t>("{attr}")' in handler


@pytest.mark.parametrize("lhs_t,rhs_t,out_f32", LAYOUTS_OUT)
def test_alignment_padding_never_depends_on_forward_rows(lhs_t, rhs_t, out_f32):
  """Only K, N (and dB's feature M) are padded; a zero-padded K tail stays inside the
  last 64-wide K tile, so it cannot change the K walk."""
  out_dtype = "float32" if out_f32 else "bfloat16"
  for m in (1, 3, 17, 130):
    for n, k in ((16, 64), (75, 100), (151936, 4096), (7, 3)):
      mp, np_, kp = gemm_ffi.aligned_shape(m, n, k, lhs_transposed=lhs_t, rhs_transposed=rhs_t,
                                           in_dtype="bfloat16", out_dtype=out_dtype)
      if not lhs_t:
        assert mp == m
      assert 0 <= kp - k < 8 and 0 <= np_ - n < 8 and 0 <= mp - m < 8
      assert -(-kp // gemm_ffi.TILE_K) == -(-k // gemm_ffi.TILE_K)
      assert (np_ * jnp.dtype(out_dtype).itemsize) % 16 == 0


# ----------------------------------------------------------------------------- GPU


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lhs_t,rhs_t,out_f32", LAYOUTS_OUT)
@pytest.mark.parametrize("shape", [(1000, 1032, 1000), (256, 384, 512), (3, 136, 192),
                                   (77, 75, 100)])  # (M, N, K); the last needs alignment pads
def test_accuracy_vs_float64(dtype, lhs_t, rhs_t, out_f32, shape):
  m, n, k = shape
  lhs, rhs = _operands(jax.random.key(m + n + k), m, n, k, dtype, lhs_t, rhs_t)
  out = _mm(lhs, rhs, lhs_t, rhs_t, jnp.float32 if out_f32 else dtype)
  assert out.shape == (m, n) and out.dtype == (jnp.float32 if out_f32 else dtype)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, _ref64(lhs, rhs, lhs_t, rhs_t)) <= TOL[dtype][0]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rhs_t", [False, True])  # forward / dA = dC B^T
@pytest.mark.parametrize("out_f32", [False, True])
def test_batch_invariance_sweep(dtype, rhs_t, out_f32):
  """Rows at the start, middle and end of batches of 1 ... 8192 rows equal the row alone."""
  k, n = 1000, 1544  # not tile multiples
  x = wide_rows(jax.random.key(0), 8192, k, dtype)
  w = jax.random.normal(jax.random.key(1), (n, k) if rhs_t else (k, n)).astype(dtype)
  f = jax.jit(lambda x: _mm(x, w, False, rhs_t, jnp.float32 if out_f32 else dtype))
  probe = [0, 1, 63, 64, 127, 128, 1000, 4095, 8191]
  singles = {r: bits(f(x[r:r + 1])) for r in probe}
  for m in (2, 7, 64, 65, 129, 200, 1000, 1024, 3000, 4096, 8192):
    out = np.asarray(f(x[:m]))
    for r in probe:
      if r < m:
        assert np.array_equal(bits(out[r:r + 1]), singles[r]), f"row {r} differs at M={m}"


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rhs_t", [False, True])
def test_position_padding_chunking(dtype, rhs_t):
  k, n = 776, 1032
  rows = wide_rows(jax.random.key(2), 512, k, dtype)
  w = jax.random.normal(jax.random.key(3), (n, k) if rhs_t else (k, n)).astype(dtype)
  f = lambda x: _mm(x, w, False, rhs_t)
  full = f(rows)
  row = rows[300:301]
  alone = f(row)
  for pos in (0, 137, 511):  # position
    batch = jnp.concatenate([rows[:pos], row, rows[pos + 1:]])
    assert_bitwise_equal(f(batch)[pos:pos + 1], alone, f"position {pos}")
  noise = jax.random.normal(jax.random.key(4), (37, k)).astype(dtype) * 1000
  padded = f(jnp.concatenate([noise, rows, noise[:5]]))  # padding, prepended and appended
  assert_bitwise_equal(padded[37:37 + 512], full, "padding rows")
  for split in (100, 1, 255, 511):  # chunking
    chunks = jnp.concatenate([f(rows[:split]), f(rows[split:])])
    assert_bitwise_equal(chunks, full, f"chunks {split}/{512 - split}")


@pytest.mark.hopper
@pytest.mark.parametrize("lhs_t,rhs_t", LAYOUTS)
def test_run_to_run(lhs_t, rhs_t):
  lhs, rhs = _operands(jax.random.key(5), 1024, 1536, 2048, "bfloat16", lhs_t, rhs_t, wide=True)
  f = jax.jit(lambda a, b: _mm(a, b, lhs_t, rhs_t))
  first = bits(f(lhs, rhs))
  for i in range(25):
    assert np.array_equal(bits(f(lhs, rhs)), first), f"run {i} differs"


@pytest.mark.hopper
def test_zero_padded_k_tail_changes_no_bit():
  """K=100 (padded to 104 for TMA) equals the same data zero-padded to K=128."""
  lhs, rhs = _operands(jax.random.key(6), 70, 264, 100, "bfloat16", False, False, wide=True)
  out = _mm(lhs, rhs)
  out128 = _mm(jnp.pad(lhs, ((0, 0), (0, 28))), jnp.pad(rhs, ((0, 28), (0, 0))))
  assert_bitwise_equal(out, out128, "K padded with zeros inside the last K tile")


@pytest.mark.hopper
def test_ffi_reports_unaligned_operands_as_an_error():
  """Called directly (no Python padding), a K that is not 16-byte aligned is refused
  with CUTLASS's status in the message, not run with a bad TMA descriptor."""
  target = gemm_ffi.register()
  a = jnp.ones((16, 12), jnp.bfloat16)  # K = 12 elements = 24 bytes
  b = jnp.ones((12, 16), jnp.bfloat16)
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((16, 16), jnp.bfloat16))
  with pytest.raises(Exception, match="contiguous dimension of every operand"):
    jax.block_until_ready(call(a, b, lhs_transposed=False, rhs_transposed=False,
                               tile=np.int32(0), swizzle=np.int32(0), raster=np.int32(0)))
  # A tile id outside det_gemm_sm90.h's TileId is refused by the handler too.
  ok = jnp.ones((16, 16), jnp.bfloat16)
  with pytest.raises(Exception, match=r"tile must be 0\.\.2, got 7"):
    jax.block_until_ready(call(ok, ok, lhs_transposed=False, rhs_transposed=False,
                               tile=np.int32(7), swizzle=np.int32(0), raster=np.int32(0)))


@pytest.mark.hopper
@pytest.mark.parametrize("transpose_b", [False, True])
def test_det_matmul_cuda_gradients_and_mode(transpose_b):
  """Through det_matmul's custom_vjp: dA and dB vs float64; forward bits equal inside grad."""
  from jaxrl_kernels import det_matmul
  from jaxrl_kernels.gemm.reference import matmul_grads_reference

  dtype = "bfloat16"
  m, k, n = 300, 520, 392
  a = jax.random.normal(jax.random.key(7), (m, k)).astype(dtype)
  b = jax.random.normal(jax.random.key(8), (n, k) if transpose_b else (k, n)).astype(dtype)
  g = jax.random.normal(jax.random.key(9), (m, n)).astype(dtype)
  f = lambda a, b: det_matmul(a, b, transpose_b=transpose_b, implementation="cuda")
  out, vjp = jax.vjp(f, a, b)
  da, db = vjp(g)
  da_ref, db_ref = matmul_grads_reference(a, b, g, transpose_b=transpose_b)
  assert rel_err(da, da_ref) <= TOL[dtype][1]
  assert rel_err(db, db_ref) <= TOL[dtype][1]
  assert_bitwise_equal(out, jax.jit(f)(a, b), "forward-only vs forward under vjp")
  # dA rows are batch-invariant: the first 10 rows alone give the same dA rows.
  _, vjp10 = jax.vjp(f, a[:10], b)
  assert_bitwise_equal(vjp10(g[:10])[0], da[:10], "dA rows")


_GRAPH_SCRIPT = textwrap.dedent("""
    import glob, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl_kernels.custom_calls import gemm_ffi
    # bf16 travels as its raw uint16 bits (np.save has no bfloat16).
    lhs = jnp.asarray(np.load(sys.argv[1]).view(jnp.bfloat16))
    rhs = jnp.asarray(np.load(sys.argv[2]).view(jnp.bfloat16))

    def step(x):
      # Several custom calls and fusions in one jitted program: a command buffer.
      for _ in range(3):
        y = gemm_ffi.matmul_cuda(x, rhs, lhs_transposed=False, rhs_transposed=True,
                                 out_dtype=x.dtype)
        x = (y * 0.5).astype(x.dtype)
      return x

    f = jax.jit(step)
    text = f.lower(lhs).compile().as_text()
    assert "jaxrl_det_gemm_sm90" in text, "custom call missing from the compiled module"
    # XLA forms command buffers in its thunk passes, after HLO: look at the dump.
    outs = [np.asarray(f(lhs)).view(np.uint16) for _ in range(5)]
    seqs = glob.glob(os.path.join(sys.argv[4], "*jit_step*thunk_sequence_after_thunk_passes.txt"))
    assert seqs, "XLA dumped no thunk sequence for the step"
    thunks = open(seqs[0]).read()
    assert "CommandBuffer" in thunks, "XLA put no command buffer in the step: " + thunks[:2000]
    np.save(sys.argv[3], np.stack(outs))
""")


@pytest.mark.hopper
def test_jit_with_cuda_graphs_gives_the_eager_bits(tmp_path):
  """The same jitted program run with XLA command buffers (CUDA graphs) that include the
  custom call, in a fresh process (XLA_FLAGS are read at start-up)."""
  dtype = "bfloat16"
  lhs = wide_rows(jax.random.key(10), 96, 512, dtype)
  rhs = (jax.random.normal(jax.random.key(11), (512, 512)) * 0.05).astype(dtype)
  x = lhs
  for _ in range(3):  # the same chain, one call at a time (no graph)
    x = (_mm(x, rhs, False, True) * 0.5).astype(dtype)
  for name, arr in (("lhs", lhs), ("rhs", rhs)):
    np.save(tmp_path / f"{name}.npy", np.asarray(arr).view(np.uint16))
  env = dict(os.environ)
  package = os.path.dirname(os.path.dirname(os.path.abspath(gemm_ffi.__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(package), env.get("PYTHONPATH"))
                                      if p)
  dump = tmp_path / "dump"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,"
                      f"CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 --xla_dump_to={dump}")
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process already holds the GPU memory
  script = tmp_path / "graph.py"
  script.write_text(_GRAPH_SCRIPT)
  proc = subprocess.run([sys.executable, str(script), str(tmp_path / "lhs.npy"),
                         str(tmp_path / "rhs.npy"), str(tmp_path / "out.npy"), str(dump)],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  outs = np.load(tmp_path / "out.npy")
  for i, out in enumerate(outs):
    assert_bitwise_equal(out.view(jnp.bfloat16), x, f"graph replay {i}")


@pytest.mark.hopper
@pytest.mark.parametrize("transpose_b", [False, True])
def test_same_bits_as_mosaic(transpose_b):
  """Same K tile (64), same ascending k16 wgmma steps, fp32 accumulators, one rounding:
  the two independent Hopper implementations should agree bit for bit."""
  try:
    from jaxrl_kernels.pallas import gemm_mosaic  # noqa: F401
  except ImportError as e:
    pytest.skip(f"the Mosaic GEMM is not available: {e}")
  from jaxrl_kernels import det_matmul

  for dtype, out_dtype in (("bfloat16", None), ("bfloat16", jnp.float32), ("float16", None)):
    a = wide_rows(jax.random.key(12), 1000, 1024, dtype)
    b = jax.random.normal(jax.random.key(13), (1536, 1024) if transpose_b else (1024, 1536))
    b = b.astype(dtype)
    kw = dict(transpose_b=transpose_b, out_dtype=out_dtype)
    assert_bitwise_equal(det_matmul(a, b, implementation="cuda", **kw),
                         det_matmul(a, b, implementation="mosaic", **kw),
                         f"cuda vs mosaic, {dtype} -> {out_dtype or dtype}")


@pytest.mark.hopper
@pytest.mark.parametrize("lhs_t,rhs_t", LAYOUTS)
def test_every_tile_gives_the_same_bits(lhs_t, rhs_t):
  """The three CUTLASS tiles (large 128x256 cooperative, medium 128x128 and small
  64x128 ping-pong) and every CTA walk give the same
  bits: the choice between them is free, M included."""
  a, b = _operands(jax.random.key(15), 704, 1536, 1024, "bfloat16", lhs_t, rhs_t, wide=True)
  outs = {}
  for tile, swizzle, raster in (("large", 1, "heuristic"), ("small", 1, "heuristic"),
                                ("medium", 1, "heuristic"), ("large", 8, "m"), ("small", 2, "n"),
                                ("medium", 2, "m"), ("medium", 8, "n")):
    cfg = gemm_ffi.Config(tile=tile, swizzle=swizzle, raster=raster)
    f = jax.jit(lambda a, b, cfg=cfg: _mm(a, b, lhs_t, rhs_t, config=cfg))
    outs[(tile, swizzle, raster)] = f(a, b)
  first = next(iter(outs.values()))
  for key, o in outs.items():
    assert_bitwise_equal(o, first, f"tile/swizzle/raster {key} vs large/1/heuristic")


@pytest.mark.hopper
def test_rows_are_invariant_across_the_tile_rule():
  """With the default config, tile_for picks small, medium and large tiles for M = 8,
  1024 and 2048 at N = 14336: rows shared by the three calls have the same bits."""
  sms = num_sms()
  k, n = 256, 14336
  picked = [gemm_ffi.tile_for(m, n, sms) for m in (8, 1024, 2048)]
  if sms == 132:
    assert picked == ["small", "medium", "large"], picked
  a = wide_rows(jax.random.key(16), 2048, k, "bfloat16")
  b = jax.random.normal(jax.random.key(17), (k, n)).astype("bfloat16")
  f = jax.jit(lambda a: _mm(a, b))
  full = f(a)
  for m in (8, 1024):
    assert_bitwise_equal(f(a[:m]), full[:m], f"rows 0..{m} ({gemm_ffi.tile_for(m, n, sms)} "
                         f"tile) vs M=2048 ({picked[-1]} tile)")


@pytest.mark.hopper
def test_control_xla_dot_changes_bits_with_batch():
  """Control: the inputs above do reveal reordering; cuBLAS (jnp.dot) picks other
  kernels (split-K, GEMV) by M and changes a row's bits."""
  k, n = 8192, 1024
  x = wide_rows(jax.random.key(14), 4096, k, "bfloat16")
  w = jax.random.normal(jax.random.key(15), (k, n)).astype("bfloat16")
  f = jax.jit(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32))
  full = bits(f(x))
  changed = any(not np.array_equal(bits(f(x[r:r + 1])), full[r:r + 1]) for r in (0, 1, 2, 3))
  assert changed, "jnp.dot gave batch-invariant rows here: the control shows nothing"
  g = jax.jit(lambda x: _mm(x, w, out_dtype=jnp.float32))
  full_cuda = bits(g(x))
  for r in (0, 1, 2, 3):
    assert np.array_equal(bits(g(x[r:r + 1])), full_cuda[r:r + 1])
