"""One process of a multi-process run (tests/distributed/test_multiprocess.py launches them).

``python multiprocess_worker.py --process-id I --num-processes P --port PORT
--local-devices K --axes tp=2,dp=2 --cases kernels,model --out FILE`` (with
``JAX_PLATFORMS=cpu``; on GPUs ``JAX_PLATFORMS=cuda``, one GPU per process through
``CUDA_VISIBLE_DEVICES`` and no ``--local-devices``): joins the run through
``jaxrl_kernels.distributed.initialize`` (gloo collectives on CPU), builds the global
mesh over every process's devices, runs the case's sharded programs, gathers every output
to every process, and process 0 writes them (raw bits, ``np.savez``) to ``FILE``.

The cases are plain functions of a mesh (:data:`CASES`), so the test runs the very same
code in its own single process on a mesh of the same shape and compares the bits.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, HIDDEN, TOKENS = 300, 32, 16
ROWS, K, N = 8, 64, 16


def _wide(rng, shape):
  """Normal values scaled by 2**e per row and per column, e in [-10, 10] (a term's weight
  in a row's sum varies by 2**20): a reordered sum rounds differently."""
  scale = (2.0 ** rng.integers(-10, 11, (shape[0], 1))) * (2.0 ** rng.integers(-10, 11,
                                                                              (1, shape[1])))
  return (rng.normal(size=shape) * scale).astype(np.float32)


def gather(x) -> np.ndarray:
  """The global value of ``x`` on this process, wherever its shards live."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def kernels_case(mesh) -> dict[str, np.ndarray]:
  """The vocab-parallel LM head (tokens over ``dp``) and the row-parallel GEMM (rows over
  ``dp``), split over ``tp``, each with our merge and the psum control, and the unsharded
  ops computed on one device of this process."""
  import jax.numpy as jnp

  from jaxrl_kernels import _compat, linear_logp, row_parallel_matmul
  from jaxrl_kernels.linear_logp import pad_vocab, vocab_parallel_logp

  rng = np.random.default_rng(0)
  h = _wide(rng, (TOKENS, HIDDEN)) * np.float32(2.0**-10)  # logits of a few units to 1e3
  w = rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32)
  t = rng.integers(0, VOCAB, TOKENS).astype(np.int32)
  tp = mesh.shape["tp"]
  wp = np.asarray(pad_vocab(jnp.asarray(w), tp, weight_layout="vh"))
  out = {}
  # Every op jitted, as a trainer runs it: one program each (op-by-op dispatch of the same
  # code compiles every primitive on its own and takes several times longer).
  for merge in ("all_gather", "psum"):
    fn = jax.jit(functools.partial(
        vocab_parallel_logp, mesh=mesh, weight_spec=P("tp", None), vocab_size=VOCAB,
        token_spec=P("dp"), weight_layout="vh", merge=merge))
    out[f"logp_{merge}"] = gather(fn(h, wp, t))
  # Computed on one device of this process: what every process must agree with.
  out["logp_unsharded"] = np.asarray(jax.jit(functools.partial(linear_logp, weight_layout="vh"))(
      jnp.asarray(h), jnp.asarray(w), jnp.asarray(t)))

  # The row-parallel GEMM: K split over tp, rows over dp.
  x = _wide(rng, (ROWS, K))
  wk = rng.normal(size=(K, N)).astype(np.float32)
  for merge in ("canonical", "psum"):
    fn = _compat.shard_map(
        lambda a, b, merge=merge: row_parallel_matmul(a, b, axis_name="tp", merge=merge),
        mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None),
        check_vma=False)
    out[f"matmul_{merge}"] = gather(jax.jit(fn)(_placed(x, mesh, P("dp", "tp")),
                                                _placed(wk, mesh, P("tp", None))))
  out["matmul_unsharded"] = np.asarray(jax.jit(row_parallel_matmul)(jnp.asarray(x),
                                                                     jnp.asarray(wk)))
  return out


def _placed(x: np.ndarray, mesh, spec) -> jax.Array:
  """A global array laid out as ``spec`` from the same host value on every process."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def model_case(mesh) -> dict[str, np.ndarray]:
  """A two-layer Llama-style ``DecoderLM`` sharded TP = tp x DP = dp: per-token log-probs,
  and the unsharded model's on one device of this process."""
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl_kernels import models

  # GQA (2 query heads per key/value head), 2 key/value heads of 16 per rank at tp = 2 (the GPU
  # kernels take head dims that are multiples of 16), and a
  # vocabulary whose last shard holds a partial tile.
  cfg = models.DecoderConfig(model_type="llama", vocab_size=VOCAB, hidden_size=2 * HIDDEN,
                             intermediate_size=4 * HIDDEN, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=16)
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(0))  # the same weights on every process
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, VOCAB, (4, 12)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  sharded = models.shard(model, models.Parallelism(mesh, tp="tp", dp="dp"))
  batch = P("dp", None)
  # Both jitted, as a sampler and a trainer run them: op-by-op dispatch is not one program,
  # and XLA's CPU code for an elementwise op may depend on what it is fused with.
  logp = _logp(sharded, _placed(tokens, mesh, batch), _placed(targets, mesh, batch))
  return {"logp": gather(logp),
          "logp_unsharded": np.asarray(_logp(model, jnp.asarray(tokens), jnp.asarray(targets)))}


def _logp(model, tokens, targets):
  from flax import nnx
  return nnx.jit(lambda m, t, g: m.logp(t, g))(model, tokens, targets)


def moe_case(mesh) -> dict[str, np.ndarray]:
  """Mixture of experts across processes: the MoE layer with its experts split over ``tp``
  (expert parallelism: the tokens' all-to-all crosses processes), its output and gradients;
  a two-layer ``qwen3_moe`` ``DecoderLM`` sharded TP = tp x DP = dp (experts over tp), its
  per-token log-probs; and both unsharded on one device of this process."""
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl_kernels import _compat, models
  from jaxrl_kernels.moe import moe_mlp

  h, e, ffn, k, t = 32, 8, 16, 2, 16
  rng = np.random.default_rng(2)
  x = (rng.standard_normal((t, h)) * 2.0 ** rng.integers(-6, 7, (t, 1))).astype(np.float32)
  router = (rng.standard_normal((h, e)) * 0.3).astype(np.float32)
  gate_up = (rng.standard_normal((e, h, 2 * ffn)) * 0.1).astype(np.float32)
  down = (rng.standard_normal((e, ffn, h)) * 0.1).astype(np.float32)
  g = rng.standard_normal((t, h)).astype(np.float32)

  impl = "cpu" if jax.default_backend() == "cpu" else "triton"

  def layer(axis):
    return lambda x, r, gu, d: moe_mlp(x, r, gu, d, k=k, normalize=True, implementation=impl,
                                       expert_axis=axis).y

  def loss(f):
    return lambda *a: jnp.sum(f(*a) * g)

  specs = (P("tp"), P(), P("tp"), P("tp"))
  ep = _compat.shard_map(layer("tp"), mesh=mesh, in_specs=specs, out_specs=P("tp"),
                         check_vma=False)
  args = [_placed(a, mesh, s) for a, s in zip((x, router, gate_up, down), specs, strict=True)]
  out = {"layer_y": gather(jax.jit(ep)(*args))}
  grads = jax.jit(jax.grad(loss(ep), argnums=(0, 2, 3)))(*args)
  out |= {f"layer_d{n}": gather(v) for n, v in zip(("x", "gate_up", "down"), grads, strict=True)}
  one = layer(None)
  local = [jnp.asarray(a) for a in (x, router, gate_up, down)]
  out["layer_y_unsharded"] = np.asarray(jax.jit(one)(*local))
  grads = jax.jit(jax.grad(loss(one), argnums=(0, 2, 3)))(*local)
  out |= {f"layer_d{n}_unsharded": np.asarray(v)
          for n, v in zip(("x", "gate_up", "down"), grads, strict=True)}

  cfg = models.DecoderConfig(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=2 * HIDDEN,
                             intermediate_size=4 * HIDDEN, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                             num_experts=e, num_experts_per_tok=k, moe_intermediate_size=ffn)
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = rng.integers(0, VOCAB, (4, 12)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  sharded = models.shard(model, models.Parallelism(mesh, tp="tp", dp="dp"))
  batch = P("dp", None)
  out["model_logp"] = gather(_logp(sharded, _placed(tokens, mesh, batch),
                                   _placed(targets, mesh, batch)))
  out["model_logp_unsharded"] = np.asarray(_logp(model, jnp.asarray(tokens),
                                                 jnp.asarray(targets)))
  return out


CASES = {"kernels": kernels_case, "model": model_case, "moe": moe_case}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--local-devices", type=int, default=None,
                 help="CPU devices of this process (GPUs: those CUDA_VISIBLE_DEVICES shows)")
  p.add_argument("--axes", required=True, help="mesh axes, outermost first: tp=2,dp=2")
  p.add_argument("--cases", required=True, help=f"comma-separated, of {sorted(CASES)}")
  p.add_argument("--out", required=True)
  p.add_argument("--timeout", type=int, default=60)
  args = p.parse_args(argv)
  from jaxrl_kernels import distributed  # the platform comes from JAX_PLATFORMS

  distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                         local_device_count=args.local_devices, timeout_s=args.timeout)
  axes = [(name, int(size)) for name, size in (a.split("=") for a in args.axes.split(","))]
  mesh = distributed.mesh(axes)
  print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices, mesh {dict(mesh.shape)}", flush=True)
  out = {}
  for case in args.cases.split(","):
    out.update({f"{case}/{k}": v for k, v in CASES[case](mesh).items()})
  if jax.process_index() == 0:
    np.savez(args.out, **out)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
