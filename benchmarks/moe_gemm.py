"""The grouped expert GEMM against ``jax.lax.ragged_dot`` at Qwen3-30B-A3B's expert shapes.

  PYTHONPATH=$PWD python benchmarks/moe_gemm.py [--out benchmarks/results/moe_gemm.md]

128 experts, top-8, hidden 2048, expert FFN 768: the gate/up product ``[A, 2048] x
[E, 2048, 1536]`` and the down product ``[A, 768] x [E, 768, 2048]`` with ``A = 8 M``
assignments for M = 64, 256 (decode) and 16384 (training) tokens, routed uniformly at
random; bf16, float32 accumulation. Ours runs on the tile-aligned layout (each expert's
rows padded to GROUPED_GEMM_BLOCK_M, the padding counted as work we do); the stock
``ragged_dot`` on the unpadded sorted rows, as JAX MoE code calls it. Both the forward
and the forward + backward (dlhs, dw) are timed in one process, calls enqueued back to
back and one block at the end (``_timing.pipelined_ms``); each product's time includes its
layout (ours: ``group_layout``, the scatter and the gather; stock: the sort), which a MoE
layer computes once for both products (the "layout alone" rows). Floor: max(FLOPs at the dense
bf16 peak, bytes of weights + activations at HBM bandwidth) of the useful work.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import pipelined_ms  # noqa: E402

from jaxrl_kernels.grouped_gemm import group_layout, grouped_matmul  # noqa: E402
from jaxrl_kernels.pallas import gemm_mosaic  # noqa: E402

E, TOP_K, H, FFN = 128, 8, 2048, 768
PEAK_TFLOPS, HBM_TBS = 989.0, 4.8  # H200 dense bf16, HBM3e


def _floor_ms(a: int, k: int, n: int, backward: bool) -> float:
  flops = 2 * a * k * n * (3 if backward else 1)
  bytes_ = 2 * (E * k * n + a * (k + n)) * (3 if backward else 1)
  return max(flops / PEAK_TFLOPS / 1e9, bytes_ / HBM_TBS / 1e9)


def _cases(m: int, key):
  a = m * TOP_K
  k1, k2, k3, k4 = jax.random.split(key, 4)
  ids = jax.random.randint(k1, (a,), 0, E, jnp.int32)
  out = []
  for name, kd, nd in (("gate_up", H, 2 * FFN), ("down", FFN, H)):
    x = jax.random.normal(k2, (a, kd), jnp.bfloat16)
    w = (jax.random.normal(k3, (E, kd, nd), jnp.float32) * 0.02).astype(jnp.bfloat16)
    g = jax.random.normal(k4, (a, nd), jnp.bfloat16)
    out.append((name, x, w, g, ids))
  return out


def _ours(impl):
  def fwd(x, w, ids):
    lay = group_layout(ids, E)
    xp = jnp.zeros((lay.rows, x.shape[1]), x.dtype).at[lay.dest].set(x, unique_indices=True)
    return grouped_matmul(xp, w, lay, implementation=impl)[lay.dest]
  return fwd


def _mosaic_kernel(x, w, ids):
  """The forward through the Hopper kernel (``gemm_mosaic.ragged_matmul``), same layout."""
  lay = group_layout(ids, E)
  xp = jnp.zeros((lay.rows, x.shape[1]), x.dtype).at[lay.dest].set(x, unique_indices=True)
  return gemm_mosaic.ragged_matmul(xp, w, lay.tile_expert, rhs_transposed=False,
                                   out_dtype=x.dtype)[lay.dest]


def _stock_layout(ids):
  return jnp.argsort(ids, stable=True), jnp.zeros((E,), jnp.int32).at[ids].add(1)


def _stock(x, w, ids):
  order = jnp.argsort(ids, stable=True)
  sizes = jnp.zeros((E,), jnp.int32).at[ids].add(1)
  y = jax.lax.ragged_dot(x[order], w, sizes, preferred_element_type=jnp.float32)
  return jnp.zeros_like(y).at[order].set(y).astype(x.dtype)


def _train(fwd):
  def step(x, w, ids, g):
    y, vjp = jax.vjp(lambda x, w: fwd(x, w, ids), x, w)
    return vjp(g)
  return step


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 16384])
  ap.add_argument("--calls", type=int, default=30)
  ap.add_argument("--mosaic-kernel", action="store_true",
                  help="add a forward row through the Hopper kernel gemm_mosaic.ragged_matmul "
                       "(not yet the grouped_matmul default)")
  args = ap.parse_args(argv)
  device = jax.devices()[0].device_kind
  lines = [f"device: {device}; jax {jax.__version__}; {datetime.date.today()}; command: "
           f"`PYTHONPATH=$PWD python benchmarks/moe_gemm.py`", "",
           "| tokens | product | pass | ours ms | ragged_dot ms | ours / stock speed | "
           "floor ms | ours / floor | same rows |", "|---|---|---|---|---|---|---|---|---|"]
  ours = _ours(None)
  for m in args.tokens:
    ids = jax.random.randint(jax.random.key(m), (m * TOP_K,), 0, E, jnp.int32)
    t_lay = pipelined_ms(jax.jit(lambda ids: group_layout(ids, E)), [(ids,)], args.calls)
    t_sort = pipelined_ms(jax.jit(_stock_layout), [(ids,)], args.calls)
    lines.append(f"| {m} | layout alone (`group_layout` / argsort + sizes) | - | {t_lay:.3f} | "
                 f"{t_sort:.3f} | {t_sort / t_lay:.2f}x | - | - | |")
    print(lines[-1], flush=True)
    for name, x, w, g, ids in _cases(m, jax.random.key(m)):
      a, kd, nd = x.shape[0], x.shape[1], w.shape[2]
      f_ours, f_stock = jax.jit(ours), jax.jit(_stock)
      y1 = f_ours(x, w, ids)
      try:
        y2 = f_stock(x, w, ids)
        err = float(jnp.max(jnp.abs(y1.astype(jnp.float32) - y2.astype(jnp.float32))))
      except jax.errors.JaxRuntimeError:
        err = float("nan")
      # A row computed alone against the same row in the batch (the contract).
      r = a // 3
      solo = f_ours(x[r:r + 1], w, ids[r:r + 1])
      same = bool(np.array_equal(np.asarray(solo[0]).view(np.uint16),
                                 np.asarray(y1[r]).view(np.uint16)))
      for label, fo, fs, extra in (("fwd", f_ours, f_stock, ()),
                                   ("fwd+bwd", jax.jit(_train(ours)), jax.jit(_train(_stock)),
                                    (g,))):
        t_o = pipelined_ms(fo, [(x, w, ids, *extra)], args.calls)
        try:
          t_s = pipelined_ms(fs, [(x, w, ids, *extra)], args.calls)
          stock, ratio = f"{t_s:.3f}", f"{t_s / t_o:.2f}x"
        except jax.errors.JaxRuntimeError as e:  # ragged_dot's autotuner runs out of memory
          stock, ratio = f"fails ({str(e).split(':')[0]})", "-"
        fl = _floor_ms(a, kd, nd, label != "fwd")
        lines.append(f"| {m} | {name} [{a}, {kd}] x [{E}, {kd}, {nd}] | {label} | {t_o:.3f} | "
                     f"{stock} | {ratio} | {fl:.3f} | {t_o / fl:.2f} | "
                     f"{same if label == 'fwd' else ''} |")
        print(lines[-1], f"(max |ours - stock| {err:.3g})", flush=True)
      if args.mosaic_kernel:
        f_mk = jax.jit(_mosaic_kernel)
        t_m = pipelined_ms(f_mk, [(x, w, ids)], args.calls)
        solo = f_mk(x[r:r + 1], w, ids[r:r + 1])
        same = bool(np.array_equal(np.asarray(solo[0]).view(np.uint16),
                                   np.asarray(f_mk(x, w, ids)[r]).view(np.uint16)))
        fl = _floor_ms(a, kd, nd, False)
        lines.append(f"| {m} | {name} [{a}, {kd}] x [{E}, {kd}, {nd}] | fwd, Mosaic kernel | "
                     f"{t_m:.3f} | - | - | {fl:.3f} | {t_m / fl:.2f} | {same} |")
        print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  if args.out:
    with open(args.out, "w") as f:
      f.write("# Grouped expert GEMM vs ragged_dot (Qwen3-30B-A3B expert shapes)\n\n"
              + __doc__.split("\n\n", 2)[2] + "\n" + text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
