"""The GPU kernels' programs, pinned from the CPU: cases, digests and their update.

A Mosaic GPU or Triton kernel's bits are fixed by its program (its instructions and their
order), which Pallas builds in Python when the kernel is lowered. Lowering for CUDA needs no
GPU, so the CPU suite can pin every GPU kernel the way tests/golden_digests.json pins every
op's output: each case lowers one kernel entry point at fixed shapes for ``cuda``, takes the
Mosaic GPU and Triton modules of its custom calls, prints them without debug information
(source locations change with every edit; the program does not) and hashes the text with
each call's launch settings (a Triton kernel's grid, warps and stages). An edit that
changes a kernel's program changes its digest; one that only moves code does not.

The programs depend on the jax version that builds them: the digests are those of
:data:`JAX_VERSION` (CI's), and the test runs under that version only.

    PYTHONPATH=. JAX_PLATFORMS=cpu python tests/kernel_ir.py   # rewrites kernel_ir_digests.json
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

PATH = pathlib.Path(__file__).parent / "kernel_ir_digests.json"
JAX_VERSION = "0.10.2"

bf16 = jnp.bfloat16
f32 = jnp.float32


def _s(shape, dtype=bf16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _cases():
  """``name -> (fn, abstract args)``; imports here so that collecting the tests is cheap."""
  from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M as BM
  from jaxrl_kernels.pallas import (
    attention_mosaic,
    attention_mosaic_bwd,
    attention_triton,
    gemm_mosaic,
    gemm_triton,
    grouped_gemm_triton,
    linear_logp_fwd,
    rmsnorm_triton,
  )
  from jaxrl_kernels.pallas import linear_logp_mosaic as head

  def mm(lt=False, rt=False, out=bf16, acc=False):
    if acc:
      return lambda a, b, c: gemm_mosaic.matmul(a, b, lhs_transposed=lt, rhs_transposed=rt,
                                                out_dtype=out, acc=c)
    return lambda a, b: gemm_mosaic.matmul(a, b, lhs_transposed=lt, rhs_transposed=rt,
                                           out_dtype=out)

  def ragged(rt):
    return lambda x, w, te: gemm_mosaic.ragged_matmul(x, w, te, rhs_transposed=rt,
                                                      out_dtype=bf16)

  kw = dict(temperature=0.7, compute_dtype=bf16)
  t, h, v = 64, 896, 5000
  q_pos = _s((2, 128), jnp.int32)
  kv_len = _s((2,), jnp.int32)
  return {
      "gemm decode 64x896x1152": (mm(), [_s((64, 896)), _s((896, 1152))]),
      "gemm mid 256x896x4864": (mm(), [_s((256, 896)), _s((896, 4864))]),
      "gemm large 2048x896x4864": (mm(), [_s((2048, 896)), _s((896, 4864))]),
      "gemm rhs transposed": (mm(rt=True), [_s((256, 896)), _s((1024, 896))]),
      "gemm weight gradient": (mm(lt=True, out=f32), [_s((2048, 896)), _s((2048, 4864))]),
      "gemm acc": (mm(out=f32, acc=True), [_s((256, 896)), _s((896, 1024)), _s((256, 1024), f32)]),
      "grouped (row-parallel chunks)": (
          lambda a, b: gemm_mosaic.grouped_matmul(a, b, out_dtype=f32),
          [_s((8, 64, 512)), _s((8, 512, 896))]),
      "chunk tree 8 chunks": (
          lambda a, b: gemm_mosaic.chunk_tree_matmul(a, b, None, chunks=8, out_dtype=bf16),
          [_s((256, 4096)), _s((4096, 896))]),
      "ragged (MoE)": (ragged(False), [_s((3 * BM, 2048)), _s((8, 2048, 1536)),
                                       _s((3,), jnp.int32)]),
      "ragged (MoE) rhs transposed": (ragged(True), [_s((3 * BM, 1536)), _s((8, 2048, 1536)),
                                                     _s((3,), jnp.int32)]),
      "head tile partials hv": (
          lambda x, w, tg: head.tile_partials(x, w, None, tg, layout="hv", **kw),
          [_s((t, h)), _s((h, v)), _s((t,), jnp.int32)]),
      "head logits + stats vh": (
          lambda x, w: head.logits(x, w, None, layout="vh", return_stats=True, **kw),
          [_s((t, h)), _s((v, h))]),
      "head draw vh": (
          lambda x, w, seed: head.logits_draw(x, w, None, seed, layout="vh", **kw),
          [_s((t, h)), _s((v, h)), _s((2,), jnp.int32)]),
      "attention forward": (
          lambda q, k, vv, p, n: attention_mosaic.forward(q, k, vv, p, n, scale=0.125),
          [_s((2, 128, 8, 64)), _s((2, 128, 2, 64)), _s((2, 128, 2, 64)), q_pos, kv_len]),
      "attention decode": (
          lambda q, k, vv, p, n: attention_mosaic.forward(q, k, vv, p, n, scale=0.088),
          [_s((4, 1, 8, 128)), _s((4, 256, 2, 128)), _s((4, 256, 2, 128)),
           _s((4, 1), jnp.int32), _s((4,), jnp.int32)]),
      "attention backward": (
          lambda q, k, vv, p, n, o, lse, do: attention_mosaic_bwd.backward(
              q, k, vv, p, n, o, lse, do, scale=0.125),
          [_s((2, 128, 8, 128)), _s((2, 128, 2, 128)), _s((2, 128, 2, 128)), q_pos, kv_len,
           _s((2, 128, 8, 128)), _s((2, 8, 128), f32), _s((2, 128, 8, 128))]),
      # Triton (any CUDA GPU; "mosaic" falls back to them where Mosaic takes no shape).
      "triton gemm bf16": (
          lambda a, b: gemm_triton.matmul(a, b, lhs_transposed=False, rhs_transposed=False,
                                          out_dtype=bf16, interpret=False),
          [_s((64, 896)), _s((896, 1152))]),
      "triton gemm f32 rhs transposed": (
          lambda a, b: gemm_triton.matmul(a, b, lhs_transposed=False, rhs_transposed=True,
                                          out_dtype=f32, interpret=False),
          [_s((64, 896), f32), _s((1152, 896), f32)]),
      "triton grouped (MoE) + dw": (
          lambda x, w, te, ts, tc, g: (
              grouped_gemm_triton.matmul(x, w, te, rhs_transposed=False, out_dtype=bf16,
                                         interpret=False),
              grouped_gemm_triton.weight_grad(x, g, ts, tc, num_experts=8, out_dtype=bf16,
                                              interpret=False)),
          [_s((3 * BM, 2048)), _s((8, 2048, 1536)), _s((3,), jnp.int32), _s((8,), jnp.int32),
           _s((8,), jnp.int32), _s((3 * BM, 1536))]),
      "triton head partials + merge": (
          lambda x, w, tg: linear_logp_fwd.merge_partials(
              *linear_logp_fwd.tile_partials(x, w, None, tg, layout="vh", interpret=False,
                                             **kw)[:3], interpret=False),
          [_s((t, h)), _s((v, h)), _s((t,), jnp.int32)]),
      "triton rms norm": (
          lambda x, w: rmsnorm_triton.rms_norm_rows(x, w, eps=1e-6, interpret=False),
          [_s((64, 896)), _s((896,))]),
      "triton attention forward + backward": (
          lambda q, k, vv, p, n, do: attention_triton.backward(
              q, k, vv, p, n, *attention_triton.forward(q, k, vv, p, n, scale=0.125,
                                                        interpret=False),
              do, scale=0.125, interpret=False),
          [_s((2, 128, 8, 64)), _s((2, 128, 2, 64)), _s((2, 128, 2, 64)), q_pos, kv_len,
           _s((2, 128, 8, 64))]),
  }


_PROGRAM_KEYS = ("module", "ir")  # the serialized kernel in each custom call's config
_SKIPPED_KEYS = ("kernel_hash",)  # a hash of the serialized module (with its locations)


def _kernels(lowered) -> list[tuple[bytes, str]]:
  """``(serialized module, its launch settings)`` of each Mosaic GPU and Triton custom call
  of ``lowered``, in program order. The settings are the config's other entries (a Triton
  kernel's grid, warps and stages: a warp count changes how a kernel's cross-warp reductions
  group), printed sorted."""
  from jax._src.lib.mlir import ir
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.name == "stablehlo.custom_call" and "mhlo.backend_config" in o.attributes:
            target = ir.StringAttr(o.attributes["call_target_name"]).value
            if target.startswith("mosaic_gpu") or target == "__gpu$xla.gpu.triton":
              cfg = ir.DictAttr(o.attributes["mhlo.backend_config"])
              entries = {cfg[i].name: cfg[i].attr for i in range(len(cfg))}
              program = next(k for k in _PROGRAM_KEYS if k in entries)
              settings = ";".join(f"{k}={entries[k]}" for k in sorted(entries)
                                  if k not in (program, *_SKIPPED_KEYS))
              found.append((bytes(ir.StringAttr(entries[program]).value_bytes), settings))
          walk(o)

  walk(lowered.compiler_ir().operation)
  return found


def digest(name: str) -> str:
  """sha256 of the case's kernel programs (debug information left out) and launch settings,
  in call order."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import mosaic_gpu_dialect, triton
  from jax._src.lib.mlir import ir
  fn, args = _cases()[name]
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  kernels = _kernels(lowered)
  if not kernels:
    raise AssertionError(f"{name}: no GPU kernel in the lowered program")
  ctx = jax_mlir.make_ir_context()
  mosaic_gpu_dialect.register_dialect(ctx)  # its types (barriers) in memrefs
  triton.dialect.register_dialect(ctx)  # its pointer types
  ctx.allow_unregistered_dialects = True  # the other kernel dialects print generically
  h = hashlib.sha256()
  with ctx:
    for module, settings in kernels:
      h.update(ir.Module.parse(module).operation.get_asm(enable_debug_info=False).encode())
      h.update(settings.encode())
  return h.hexdigest()[:32]


def names() -> list[str]:
  return sorted(_cases())


def main() -> int:
  if jax.__version__ != JAX_VERSION:
    print(f"kernel_ir: the digests are jax {JAX_VERSION}'s; this is {jax.__version__}")
    return 2
  old = json.loads(PATH.read_text()) if PATH.exists() else {}
  new = {}
  for name in names():
    new[name] = digest(name)
    state = "same" if old.get(name) == new[name] else "NEW" if name not in old else "CHANGED"
    print(f"{name}: {state}", flush=True)
  PATH.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
