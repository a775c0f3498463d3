"""Cost of the canonical row-parallel order (``row_parallel_matmul``), one GPU and several.

  PYTHONPATH=$PWD python benchmarks/tp_model.py [--quick] \\
      [--out benchmarks/results/tp_model_<device>.md]

(a) One device: the canonical layer (unsharded, C = ``contract.ROW_PARALLEL_CHUNKS``)
against one ``det_matmul`` and ``jnp.dot`` at the ``o_proj`` ([q_dim -> hidden]) and
``down_proj`` ([intermediate -> hidden]) shapes of qwen2.5-0.5b, llama-3.2-1b and
llama-3.1-8b, M = 64 (decode) and M = 16384 (training), forward and forward+backward
(``jax.vjp``: y, dx, dw), bf16. Times are pipelined (``--iters`` calls enqueued, one block;
operands rotated through copies so that repeats do not hit the L2) and the kernels' own
time (CUPTI, ``_timing.device_ms``). The floor of each shape: FLOPs, HBM bytes (operands
and result once), and their time at the device's peak where known; "partials MB" is the
float32 traffic the canonical order adds (C partials of [M, N] written and read).

(b) Several devices (``jax.device_count() > 1``): the same layers under ``shard_map`` at
each TP that divides the device count, canonical against ``merge="psum"``, with a bitwise
check against the unsharded canonical layer; then, when ``jaxrl_kernels.models.parallel``
exists, the whole model's decode step and training step (forward + backward of the
mean log-prob) at each TP, canonical against psum.

``--quick``: tiny shapes, few iterations, TP 2 and 8 for the layers, degree 2 for a
one-layer model (decode from an empty cache, no scoring rows): a CPU smoke run; with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` it exercises (b) and (c) too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels import contract, det_matmul, models, row_parallel_matmul
from jaxrl_kernels._compat import shard_map

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import copies_for, device_ms, pipelined_ms  # noqa: E402

PRESETS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (B/s), by device kind.
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


_START = time.perf_counter()


def log(msg: str) -> None:
  """A time-stamped progress line on stderr."""
  print(f"[{time.perf_counter() - _START:7.1f} s] {msg}", file=sys.stderr, flush=True)


def layer_shapes(args) -> list[tuple[str, int, int]]:
  """``(name, K, N)`` of the row-parallel layers: o_proj [q_dim -> hidden] and down_proj
  [intermediate -> hidden] of each preset of ``--presets``."""
  if args.quick:
    return [("tiny", 256, 128)]
  out = []
  for name in args.presets.split(","):
    cfg = models.config(name)
    out.append((f"{name} o_proj", cfg.q_dim, cfg.hidden_size))
    out.append((f"{name} down_proj", cfg.intermediate_size, cfg.hidden_size))
  return out


def floor(m: int, k: int, n: int, *, backward: bool, peaks) -> tuple[float, float, str]:
  """``(GFLOP, MB, floor ms or '-')``: ``2MKN`` (``6MKN`` with dx and dw); bf16 bytes of
  x, w, y (and dy, dx, dw, with x and w read again) moved once."""
  flops = (6 if backward else 2) * m * k * n
  elems = m * k + k * n + m * n + (m * n + 2 * k * n + 2 * m * k if backward else 0)
  nbytes = 2 * elems
  ms = "-" if peaks is None else f"{1e3 * max(flops / peaks[0], nbytes / peaks[1]):.4f}"
  return flops / 1e9, nbytes / 1e6, ms


def _operands(m, k, n, copies, dtype=jnp.bfloat16):
  out = []
  for i in range(copies):
    kx, kw, kg = jax.random.split(jax.random.key(i), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    dy = jax.random.normal(kg, (m, n), jnp.float32).astype(dtype)
    out.append((x, w, dy))
  return out


def _fwd_bwd(f):
  def run(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))
  return jax.jit(run)


VARIANTS = {
    f"canonical C={contract.ROW_PARALLEL_CHUNKS}": lambda x, w: row_parallel_matmul(x, w),
    "det_matmul": lambda x, w: det_matmul(x, w),
    "jnp.dot": lambda x, w: jnp.dot(x, w),
}


def single_device(args, peaks) -> list[str]:
  ms_list = (16,) if args.quick else tuple(int(v) for v in args.rows.split(","))
  lines = [
      "| layer | K | N | M | pass | variant | pipelined ms | kernel ms | vs det_matmul "
      "| GFLOP | MB | floor ms | partials MB |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, k, n in layer_shapes(args):
    for m in ms_list:
      copies = copies_for(2 * (m * k + k * n))
      ops = _operands(m, k, n, copies)
      partial_mb = 2 * 4 * contract.ROW_PARALLEL_CHUNKS * m * n / 1e6
      for backward in (False, True):
        fl, mb, fms = floor(m, k, n, backward=backward, peaks=peaks)
        times = {}
        for vname, f in VARIANTS.items():
          if backward:
            fn, sets = _fwd_bwd(f), ops
          else:
            fn, sets = jax.jit(f), [o[:2] for o in ops]
          t_pipe = pipelined_ms(fn, sets, args.iters)
          t_kern = device_ms(fn, *sets[0], iterations=args.iters)
          times[vname] = (t_pipe, t_kern)
          log(f"{name} M={m} {'fwd+bwd' if backward else 'fwd'} {vname}: {t_pipe:.3f} ms")
        base = times["det_matmul"][0]
        for vname, (t_pipe, t_kern) in times.items():
          extra = f"{partial_mb:.1f}" if vname.startswith("canonical") else "-"
          lines.append(f"| {name} | {k} | {n} | {m} | {'fwd+bwd' if backward else 'fwd'} | "
                       f"{vname} | {t_pipe:.3f} | {t_kern:.3f} | {t_pipe / base:.2f} | "
                       f"{fl:.2f} | {mb:.1f} | {fms} | {extra} |")
  return lines


def tp_degrees(ndev: int) -> list[int]:
  return [t for t in (2, 4, 8) if t <= ndev and ndev % t == 0
          and contract.ROW_PARALLEL_CHUNKS % t == 0]


def multi_device_layers(args) -> list[str]:
  ndev = jax.device_count()
  ms_list = (16,) if args.quick else tuple(int(v) for v in args.rows.split(","))
  lines = [
      "| layer | K | N | M | TP | merge | fwd ms | fwd+bwd ms | fwd / unsharded "
      "| bitwise = unsharded |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, k, n in layer_shapes(args):
    for m in ms_list:
      x, w, dy = _operands(m, k, n, 1)[0]
      ref_f = jax.jit(VARIANTS[f"canonical C={contract.ROW_PARALLEL_CHUNKS}"])
      ref = np.asarray(ref_f(x, w))
      t_ref = pipelined_ms(ref_f, [(x, w)], args.iters)
      degrees = tp_degrees(ndev)
      for tp in degrees[::max(len(degrees) - 1, 1)] if args.quick else degrees:
        mesh = Mesh(np.asarray(jax.devices()[:tp]), ("tp",))
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
        ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
        dys = jax.device_put(dy, NamedSharding(mesh, P()))
        for merge in ("canonical", "psum"):
          body = lambda a, b, merge=merge: row_parallel_matmul(a, b, axis_name="tp",  # noqa: E731
                                                               merge=merge)
          f = shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                        out_specs=P(), check_vma=False)
          fwd = jax.jit(f)
          same = np.array_equal(np.asarray(fwd(xs, ws)).view(np.uint16), ref.view(np.uint16))
          t_f = pipelined_ms(fwd, [(xs, ws)], args.iters)
          t_fb = pipelined_ms(_fwd_bwd(f), [(xs, ws, dys)], args.iters)
          log(f"{name} M={m} TP={tp} {merge}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms")
          lines.append(f"| {name} | {k} | {n} | {m} | {tp} | {merge} | {t_f:.3f} | "
                       f"{t_fb:.3f} | {t_f / t_ref:.2f} | {'yes' if same else 'no'} |")
  return lines


def _model(args):
  if args.quick:
    over = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    return models.preset("llama-3.2-1b", jax.random.key(0), "bfloat16", **over)
  over = {} if args.layers is None else dict(num_hidden_layers=args.layers)
  return models.preset(args.model, jax.random.key(0), "bfloat16", **over)


def whole_model(args) -> list[str]:
  """The sharded model at each degree d: decode step and forward scoring (``logp``) under
  TP = d (canonical and psum), and the training step (forward + backward of the mean
  log-prob) under FSDP = d: the rollout/trainer pairing. A TP-sharded model is
  forward-only."""
  try:
    from jaxrl_kernels.models import parallel
  except ImportError as e:
    msg = (f"(whole-model section skipped: jaxrl_kernels.models.parallel is not importable "
           f"({e}); it provides shard() and Parallelism)")
    log(msg)
    return [msg]
  from flax import nnx

  model = _model(args)
  cfg = model.config
  b, prompt, ctx = (8, 8, 32) if args.quick else (args.batch, args.prompt_len, args.cache_len)
  t_train = 32 if args.quick else args.train_tokens // args.batch
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, prompt)), jnp.int32)
  lengths = jnp.full((b,), prompt, jnp.int32)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t_train)), jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1)
  iters = max(2, args.iters // 4)

  @nnx.jit
  def prefill(m, toks, lens, cache):
    return m.prefill(toks, lens, cache)

  @nnx.jit
  def decode(m, tok, cache):
    return m.decode_step(tok, cache)

  @nnx.jit
  def score(m, toks, tgts):
    return m.logp(toks, tgts)

  @nnx.jit
  def train(m, toks, tgts):
    return nnx.value_and_grad(lambda mm: -jnp.mean(mm.logp(toks, tgts)))(m)

  def decode_ms(m) -> float:
    cache = m.init_cache(b, ctx)
    if not args.quick:  # quick: decode from an empty cache (one compile less)
      _, cache = prefill(m, prompts, lengths, cache)
    tok = prompts[:, -1]
    jax.block_until_ready(decode(m, tok, cache))
    t0 = time.perf_counter()
    outs = []
    for _ in range(args.iters):  # each step consumes the last cache: enqueued in order
      h, cache = decode(m, tok, cache)
      outs.append(h)
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) * 1e3 / args.iters

  def row(what: str, degree, merge: str, fn) -> str:
    try:
      ms = fn()
      line = f"| {what} | {degree} | {merge} | {ms:.3f} |"
    except Exception as e:  # noqa: BLE001 - one failed row must not hide the others
      traceback.print_exc()
      line = f"| {what} | {degree} | {merge} | failed: {type(e).__name__}: {str(e)[:120]} |"
    log(line)
    return line

  lines = [
      f"Model: {'tiny llama' if args.quick else args.model} ({cfg.num_hidden_layers} layer(s), "
      f"hidden {cfg.hidden_size}), bf16. Decode: batch {b}, cache {ctx}, ms per step "
      f"(pipelined over {args.iters} steps). Score: forward logp of {b} x {t_train} tokens. "
      f"Train: forward + backward of the mean log-prob of {b} x {t_train} tokens.",
      "",
      "| step | degree | merge | ms |",
      "|---|---|---|---|",
      row("decode", "unsharded", "canonical", lambda: decode_ms(model)),
  ]
  if not args.quick:
    lines.append(row("score", "unsharded", "canonical",
                     lambda: pipelined_ms(lambda: score(model, tokens, targets), [()], iters)))
  lines += [
      row("train", "unsharded", "canonical",
          lambda: pipelined_ms(lambda: train(model, tokens, targets), [()], iters)),
  ]
  devices = np.asarray(jax.devices())

  @functools.cache
  def tp_model(d: int, merge: str):
    mesh = Mesh(devices[:d], ("tp",))
    return parallel.shard(model, parallel.Parallelism(mesh, tp="tp"), merge=merge)

  @functools.cache
  def fsdp_model(d: int):
    return parallel.shard(model, parallel.Parallelism(Mesh(devices[:d], ("fsdp",)),
                                                      fsdp="fsdp"))

  for d in tp_degrees(jax.device_count())[:1 if args.quick else None]:
    for merge in ("canonical", "psum"):
      if cfg.num_key_value_heads % d:
        lines.append(f"| decode, score | TP={d} | {merge} | skipped: TP must divide "
                     f"num_key_value_heads ({cfg.num_key_value_heads}) |")
        continue
      lines.append(row("decode", f"TP={d}", merge,
                       lambda d=d, merge=merge: decode_ms(tp_model(d, merge))))
      if not args.quick:
        lines.append(row("score", f"TP={d}", merge, lambda d=d, merge=merge: pipelined_ms(
            lambda: score(tp_model(d, merge), tokens, targets), [()], iters)))
    if b % d:
      lines.append(f"| train | FSDP={d} | - | skipped: batch {b} not divisible by {d} |")
      continue
    lines.append(row("train", f"FSDP={d}", "canonical", lambda d=d: pipelined_ms(
        lambda: train(fsdp_model(d), tokens, targets), [()], iters)))
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes, a few iterations")
  p.add_argument("--iters", type=int, default=50, help="calls per pipelined timing")
  p.add_argument("--presets", default=",".join(PRESETS),
                 help="comma-separated presets whose o_proj/down_proj shapes are measured")
  p.add_argument("--rows", default="64,16384", help="comma-separated M (tokens per call)")
  p.add_argument("--out", default=None, help="write the markdown tables to this file (overwritten)")
  p.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.PRESETS),
                 help="the whole-model section's preset (several devices only)")
  p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
  p.add_argument("--batch", type=int, default=64, help="decode batch (whole model)")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--cache-len", type=int, default=2048)
  p.add_argument("--train-tokens", type=int, default=16384)
  p.add_argument("--skip-single", action="store_true", help="only the multi-device sections")
  args = p.parse_args(argv)
  if args.quick:
    args.iters = min(args.iters, 4)
  dev = jax.devices()[0]
  peaks = next((v for k, v in PEAKS.items() if k in dev.device_kind), None)
  out = [f"\n### Row-parallel layers: canonical order vs det_matmul vs jnp.dot, "
         f"{jax.device_count()} x {dev.device_kind}, jax {jax.__version__}, "
         f"{datetime.date.today()}", ""]
  if not args.skip_single:
    out += [
        f"(a) One device, bf16, C = {contract.ROW_PARALLEL_CHUNKS}. pipelined: ms per call "
        f"with {args.iters} calls in flight; kernel: CUPTI kernel time (wall clock where "
        "CUPTI is missing); vs det_matmul: pipelined ratio. floor: max(FLOPs / peak, bytes / "
        f"HBM bandwidth){'' if peaks is None else f' at {peaks[0] / 1e12:.0f} TFLOP/s, '}"
        f"{'' if peaks is None else f'{peaks[1] / 1e12:.2f} TB/s'}.", ""]
    out += single_device(args, peaks)
  if jax.device_count() > 1:
    out += ["", "(b) The same layers under shard_map (x split over K, w over rows), "
            "canonical vs psum; fwd+bwd: jax.vjp around the shard_map.", ""]
    out += multi_device_layers(args)
    out += ["", "(c) Whole model: decode and scoring under TP (canonical vs psum), the "
            "training step under FSDP.", ""]
    out += whole_model(args)
  else:
    out += ["", "(b), (c): one device here; the multi-device sections need "
            "jax.device_count() > 1."]
  table = "\n".join(out)
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
