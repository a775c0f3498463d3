"""Sweep the attention backward's free tiling knobs (``attention_triton.BackwardConfig``).

The backward's gradients are deterministic for every config (no atomics; a fixed order of
float32 partials) and are not part of the forward's bit contract, so its tiles are free to
tune. For each shape: the layout the library calls (``[B, T, Hq, D]``: from
``attention.api.UNFOLDED_MIN_QUERIES`` queries on, grouped heads reach the kernels
unfolded; ``--folded`` for the GQA-folded ``[B, T * G, Hkv, D]`` of shorter calls), the
backward kernels alone (CUPTI device time, median), each config's gradients checked against
the library default's (relative error), and cuDNN's fwd+bwd
(``jax.nn.dot_product_attention``) on the unfolded shape as the anchor.

    PYTHONPATH=$PWD python benchmarks/tune_attention_bwd.py --out tune.md
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import device_ms

from jaxrl_kernels.pallas import attention_mosaic
from jaxrl_kernels.pallas import attention_triton as at

# (B, T, Hq, Hkv, D): Qwen2.5-0.5B and Llama-3.2-1B training rows; the 32 x 128 MHA bench.
SHAPES = ((2, 4096, 14, 2, 64), (1, 4096, 32, 8, 64), (1, 4096, 32, 32, 128))


def configs(quick: bool, d: int):
  """The library's default for bf16 at head dim ``d`` first (the reference of the error
  column), then the sweep around the general default, each config once."""
  base = at.BackwardConfig()
  grid = itertools.product((32, 64), (64, 128), (4, 8), (2, 3), (512, 1024, 2048, 1 << 30))
  sweep = [base]
  for bq, bk, w, st, split in grid:
    if quick and (st != 2 or (w == 8 and bq * bk < 64 * 128)):
      continue
    split = max(split - split % bq, bq)
    sweep.append(dataclasses.replace(base, dkv_block_q=bq, dkv_block_k=bk, num_warps=w,
                                     num_stages=st, dkv_split_rows=split))
  for dq_bq, dq_bk in ((128, 32), (64, 64), (128, 64)):
    sweep.append(dataclasses.replace(base, dq_block_q=dq_bq, dq_block_k=dq_bk))
  yield from dict.fromkeys([at.default_backward_config(jnp.bfloat16, d), *sweep])


def fold(q, pos, group):
  b, t, hq, d = q.shape
  rows = q.reshape(b, t, hq // group, group, d).transpose(0, 1, 3, 2, 4)
  return rows.reshape(b, t * group, hq // group, d), jnp.repeat(pos, group, axis=1)


def sweep_shape(bsz: int, t: int, hq: int, hkv: int, d: int, *, quick: bool, top: int,
                folded: bool = False) -> list[str]:
  """The markdown section of one shape: the ``top`` fastest configs and the default."""
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (bsz, t, hq, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (bsz, t, hkv, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (bsz, t, hkv, d), jnp.bfloat16)
  dout = jax.random.normal(ks[3], (bsz, t, hq, d), jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bsz, t))
  kvl = jnp.full((bsz,), t, jnp.int32)
  scale = d ** -0.5
  if folded:
    rows, rpos = fold(q, pos, hq // hkv)
    drows, _ = fold(dout, pos, hq // hkv)
  else:
    rows, rpos, drows = q, pos, dout

  def forward(q, k, v):
    return attention_mosaic.forward(q, k, v, rpos, kvl, scale=scale)

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

  def cudnn_loss(q, k, v):
    return jnp.sum(cudnn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

  def backward(cfg):
    return jax.jit(lambda q, k, v, o, lse, do: at.backward(
        q, k, v, rpos, kvl, o, lse, do, scale=scale, interpret=False, config=cfg))

  out, lse = jax.jit(forward)(rows, k, v)
  flops = 4 * bsz * hq * d * t * (t + 1) / 2  # one causal QK^T + PV
  fwd_ms = device_ms(jax.jit(lambda q, k, v: forward(q, k, v)[0]), rows, k, v)
  cudnn_fwd = device_ms(jax.jit(cudnn), q, k, v)
  cudnn_all = device_ms(jax.jit(jax.grad(cudnn_loss, argnums=(0, 1, 2))), q, k, v)
  found = []
  ref = None
  for cfg in configs(quick, d):
    f = backward(cfg)
    try:
      g = jax.block_until_ready(f(rows, k, v, out, lse, drows))
      ms = device_ms(f, rows, k, v, out, lse, drows, iterations=5)
    except Exception as e:  # noqa: BLE001 - a config Triton cannot compile: listed
      print(f"{cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
      continue
    if ref is None:
      ref = [np.asarray(x, np.float64) for x in g]
    err = max(float(np.linalg.norm(np.asarray(x, np.float64) - r) / np.linalg.norm(r))
              for x, r in zip(g, ref, strict=True))
    found.append((ms, cfg, err))
    print(f"{bsz}x{t} {hq}/{hkv}x{d} {ms:8.3f} ms {cfg}", file=sys.stderr, flush=True)
  found.sort(key=lambda r: r[0])
  lines = [f"### B = {bsz}, T = {t}, heads {hq}/{hkv}, D = {d} (bf16, causal)", "",
           f"Forward (Mosaic) {fwd_ms:.3f} ms; cuDNN forward {cudnn_fwd:.3f} ms, forward + "
           f"backward {cudnn_all:.3f} ms; causal fwd FLOPs {flops / 1e9:.1f} G "
           f"(backward ~2.5x).", "",
           "| backward ms | fwd+bwd / cuDNN | dq bq/bk | dkv bq/bk | split rows | warps | "
           "stages | rel diff vs default |", "|---|---|---|---|---|---|---|---|"]
  library = at.default_backward_config(jnp.bfloat16, d)
  default = [r for r in found if r[1] == library]
  for ms, c, err in [*found[:top], *default]:
    mark = " (default)" if c == library else ""
    lines.append(f"| {ms:.3f}{mark} | {(fwd_ms + ms) / cudnn_all:.2f}x | {c.dq_block_q}/"
                 f"{c.dq_block_k} | {c.dkv_block_q}/{c.dkv_block_k} | {c.dkv_split_rows} | "
                 f"{c.num_warps} | {c.num_stages} | {err:.1e} |")
  return [*lines, ""]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="4 warps / 2 stages only")
  ap.add_argument("--top", type=int, default=8)
  ap.add_argument("--out", default=None)
  ap.add_argument("--folded", action="store_true",
                  help="the GQA-folded layout of calls below UNFOLDED_MIN_QUERIES queries")
  args = ap.parse_args()
  dev = jax.devices()[0]
  lines = [f"## attention backward tiles ({dev.device_kind}; jax {jax.__version__}; "
           f"{time.strftime('%Y-%m-%d')})", ""]
  for shape in SHAPES:
    lines += sweep_shape(*shape, quick=args.quick, top=args.top, folded=args.folded)
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
