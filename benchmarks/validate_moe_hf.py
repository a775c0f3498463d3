"""Validation of the mixture-of-experts models (``qwen3_moe``, ``mixtral``) against
``transformers`` (needs torch + transformers: the GPU image).

For each architecture, a tiny random-weight ``Qwen3MoeForCausalLM`` (one dense layer via
``mlp_only_layers``) and ``MixtralForCausalLM`` in torch float32 (routers and norms
perturbed so that they matter) is saved with ``save_pretrained`` and loaded with
``jaxrl_kernels.models.from_pretrained(dtype="float32")``. Checked, failing loudly:

* logits on random tokens: ``max |ours - hf| / max |hf| <= 3e-6`` (HF eager attention,
  TF32 off);
* greedy continuation of 16 tokens (ours: ``nn.sample`` with ``top_k=1``; HF:
  ``generate(do_sample=False)``): identical (a differing token is reported, and fails
  unless HF's top-2 logit margin at that step is below 10x the measured logit error);
* round trip: our ``save_pretrained`` -> ``transformers`` ``from_pretrained`` -> the same
  logits bits as the original HF model.

    python benchmarks/validate_moe_hf.py --out benchmarks/results/moe_hf_h200.md
    python benchmarks/validate_moe_hf.py --self-check   # the JAX half only, no torch
    python benchmarks/validate_moe_hf.py --shape real --layers 2   # real widths

``--shape real`` builds the same checks at the released models' widths (Qwen3-30B-A3B:
hidden 2048, 128 experts, top-8, expert FFN 768, vocabulary 151936; Mixtral-8x7B: hidden
4096, 8 experts, top-2, FFN 14336, vocabulary 32000) with ``--layers`` layers, the torch
model initialised on the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_kernels import models  # noqa: E402
from jaxrl_kernels.nn.sampler import sample  # noqa: E402

COMMON = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
              tie_word_embeddings=False, max_position_embeddings=4096, bos_token_id=0,
              eos_token_id=1, hidden_act="silu", num_experts_per_tok=2,
              router_aux_loss_coef=0.001)
ARCH = {
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                      rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False),
    "mixtral": dict(intermediate_size=64, num_local_experts=8, rms_norm_eps=1e-5,
                    sliding_window=None, router_jitter_noise=0.0),
}
# The released models' widths (config.json of Qwen/Qwen3-30B-A3B and
# mistralai/Mixtral-8x7B-v0.1), for ``--shape real``.
REAL_COMMON = dict(num_attention_heads=32, head_dim=128, rope_theta=1000000.0,
                   tie_word_embeddings=False, hidden_act="silu")
REAL = {
    "qwen3_moe": dict(REAL_COMMON, vocab_size=151936, hidden_size=2048,
                      intermediate_size=6144, num_key_value_heads=4,
                      max_position_embeddings=40960, bos_token_id=151643,
                      eos_token_id=151645, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], rms_norm_eps=1e-6, attention_bias=False,
                      use_sliding_window=False, router_aux_loss_coef=0.001),
    "mixtral": dict(REAL_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_key_value_heads=8, max_position_embeddings=32768, bos_token_id=1,
                    eos_token_id=2, num_local_experts=8, num_experts_per_tok=2,
                    rms_norm_eps=1e-5, sliding_window=None, router_jitter_noise=0.0,
                    router_aux_loss_coef=0.02),
}
PROMPT_LEN, BATCH, GREEDY = 32, 2, 16
LOGIT_TOL = 3e-6  # max |ours - hf| / max |hf|
TORCH_DEVICE = "cuda"


def hf_kwargs(arch: str, shape: str, layers: int | None) -> dict:
  """The ``transformers`` config fields of ``arch`` at ``shape`` (``"tiny"`` or ``"real"``)."""
  kw = dict(COMMON, **ARCH[arch]) if shape == "tiny" else dict(REAL[arch])
  if layers is not None:
    kw["num_hidden_layers"] = layers
  return kw


def _hf_model(arch: str, path: str, seed: int, kw: dict):
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM

  cfg = AutoConfig.for_model(arch, **kw)
  torch.manual_seed(seed)
  with torch.device(TORCH_DEVICE):  # real widths: initialise where the model runs
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32)
  with torch.no_grad():  # norms at 1 and a 0.02 router would hide mistakes: perturb them
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.1 * torch.randn_like(p))
      elif name.endswith("gate.weight"):
        p.normal_(0.0, 0.2)
  model.save_pretrained(path, safe_serialization=True)
  return model.eval()


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model.to(TORCH_DEVICE)(torch.as_tensor(tokens, device=TORCH_DEVICE)
                                  ).logits.float().cpu().numpy()


def _hf_greedy(model, tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
  """HF ``generate`` greedy continuation and each step's top-2 logit margin."""
  import torch

  m = model.to(TORCH_DEVICE)
  ids = torch.as_tensor(tokens, device=TORCH_DEVICE)
  with torch.no_grad():
    out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                     max_new_tokens=n, min_new_tokens=n, output_scores=True,
                     return_dict_in_generate=True, pad_token_id=0)
  margins = [(torch.topk(s.float(), 2, dim=-1).values.diff(dim=-1).abs()[:, 0]).cpu().numpy()
             for s in out.scores]
  return out.sequences[:, tokens.shape[1]:].cpu().numpy(), np.stack(margins, 1)


@nnx.jit
def _our_logits(model, tokens):
  return model.logits(tokens)


def check_ours(path: str, tokens: np.ndarray, ref: np.ndarray, ref_greedy: np.ndarray,
               margins: np.ndarray) -> dict:
  """The JAX half: load ``path``, compare logits with ``ref`` and the greedy continuation
  with ``ref_greedy`` (``margins``: the reference's top-2 logit margin per step)."""
  ours = models.from_pretrained(path, dtype="float32")
  z = np.asarray(_our_logits(ours, jnp.asarray(tokens, jnp.int32)))
  row: dict = {"model_type": ours.config.model_type}
  row["max_rel"] = float(np.max(np.abs(z - ref)) / np.max(np.abs(ref)))
  row["maxabs"] = float(np.max(np.abs(z - ref)))
  res = sample(ours, tokens.astype(np.int32), np.full((tokens.shape[0],), tokens.shape[1],
                                                      np.int32),
               max_new_tokens=GREEDY, key=jax.random.key(0), top_k=1)
  our_tok = np.asarray(res.tokens)[:, tokens.shape[1]:tokens.shape[1] + GREEDY]
  diff = np.argwhere(our_tok != ref_greedy)
  tie_limit = 10 * row["maxabs"]
  if diff.size == 0:
    row["greedy"], row["greedy_ok"] = f"identical ({tokens.shape[0]}x{GREEDY})", True
  else:
    firsts = [(r, int(diff[diff[:, 0] == r][:, 1].min())) for r in np.unique(diff[:, 0])]
    worst = max(float(margins[r, c]) for r, c in firsts)
    row["greedy_ok"] = worst < tie_limit
    row["greedy"] = (f"differs at (row, step) {firsts}; HF top-2 margin there {worst:.2e} "
                     f"vs tie limit {tie_limit:.2e}")
  row["logits_ok"] = row["max_rel"] <= LOGIT_TOL
  row["model"] = ours
  return row


def run_one(arch: str, seed: int, kw: dict) -> dict:
  import torch
  from transformers import AutoModelForCausalLM

  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  tokens = np.random.default_rng(seed).integers(2, kw["vocab_size"],
                                                (BATCH, PROMPT_LEN)).astype(np.int64)
  with tempfile.TemporaryDirectory() as hf_dir, tempfile.TemporaryDirectory() as our_dir:
    t0 = time.perf_counter()
    hf = _hf_model(arch, hf_dir, seed, kw)
    ref = _hf_logits(hf, tokens)
    hf_tok, margins = _hf_greedy(hf, tokens, GREEDY)
    row = check_ours(hf_dir, tokens, ref, hf_tok, margins)
    row["arch"] = arch
    models.save_pretrained(row.pop("model"), our_dir)
    back = AutoModelForCausalLM.from_pretrained(our_dir, attn_implementation="eager",
                                                dtype=torch.float32).eval()
    del hf
    rt = _hf_logits(back, tokens)
    row["roundtrip_bitwise"] = bool(np.array_equal(rt.view(np.uint32), ref.view(np.uint32)))
    row["roundtrip_maxabs"] = float(np.max(np.abs(rt - ref)))
    row["seconds"] = time.perf_counter() - t0
  row["ok"] = row["logits_ok"] and row["greedy_ok"] and row["roundtrip_bitwise"]
  return row


def self_check(seed: int, shape: str = "tiny", layers: int | None = None) -> list[dict]:
  """The JAX half without torch: each architecture's config at ``shape`` as a random
  ``DecoderLM``, saved with our ``save_pretrained``; the reference is the model's own
  logits and greedy tokens (so every check must pass exactly)."""
  rows = []
  for arch in ARCH:
    cfg = models.from_hf_dict(dict(hf_kwargs(arch, shape, layers), model_type=arch))
    model = models.DecoderLM(cfg, rngs=nnx.Rngs(seed))
    tokens = np.random.default_rng(seed).integers(2, cfg.vocab_size, (BATCH, PROMPT_LEN))
    with tempfile.TemporaryDirectory() as d:
      models.save_pretrained(model, d)
      ref = np.asarray(_our_logits(model, jnp.asarray(tokens, jnp.int32)))
      greedy = np.asarray(sample(model, tokens.astype(np.int32),
                                 np.full((BATCH,), PROMPT_LEN, np.int32),
                                 max_new_tokens=GREEDY, key=jax.random.key(1), top_k=1
                                 ).tokens)[:, PROMPT_LEN:PROMPT_LEN + GREEDY]
      row = check_ours(d, tokens, ref, greedy, np.ones((BATCH, GREEDY)))
    row.pop("model")
    row.update(arch=arch, roundtrip_bitwise=True, roundtrip_maxabs=0.0, seconds=0.0)
    row["ok"] = row["logits_ok"] and row["greedy_ok"] and row["max_rel"] == 0.0
    rows.append(row)
  return rows


def _shape_text(shape: str, layers: int | None) -> str:
  if shape == "tiny":
    return ("tiny random models (hidden 128, 3 layers, 8 experts, top-2; qwen3_moe with one "
            "dense layer)")
  n = f"{layers} layers" if layers is not None else "all layers"
  return (f"real widths, {n}, random weights (Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, "
          "expert FFN 768, vocabulary 151936; Mixtral-8x7B: hidden 4096, 8 experts, top-2, FFN "
          "14336, vocabulary 32000)")


def _markdown(rows: list[dict], device: str, versions: str, shape_text: str) -> str:
  lines = [
      "# jaxrl_kernels.models MoE (qwen3_moe, mixtral) against transformers",
      "",
      f"device {device}; jax {jax.__version__}; {versions}; "
      f"{datetime.date.today().isoformat()}; {shape_text}.",
      f"Batch {BATCH} x {PROMPT_LEN} random tokens, float32, HF eager attention, TF32 off; "
      f"logit error is max |ours - HF| / max |HF| (target <= {LOGIT_TOL:g}).",
      "",
      f"| arch | logit max rel err | logit max abs | greedy {GREEDY} | round trip (ours -> HF) "
      "| ok |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    rt = "bitwise" if r["roundtrip_bitwise"] else f"max abs {r['roundtrip_maxabs']:.2e}"
    lines.append(f"| {r['arch']} | {r['max_rel']:.2e} | {r['maxabs']:.2e} | {r['greedy']} | "
                 f"{rt} | {'yes' if r['ok'] else 'NO'} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--archs", default="qwen3_moe,mixtral")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None, help="write the markdown table here")
  ap.add_argument("--torch-device", default="cuda")
  ap.add_argument("--shape", choices=("tiny", "real"), default="tiny",
                  help="tiny random models, or the released models' widths")
  ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
  ap.add_argument("--self-check", action="store_true",
                  help="run the JAX half on folders our save_pretrained wrote (no torch)")
  args = ap.parse_args(argv)
  global TORCH_DEVICE
  TORCH_DEVICE = args.torch_device
  if args.self_check:
    rows = self_check(args.seed, args.shape, args.layers)
    versions = "self-check (no transformers)"
  else:
    import torch
    import transformers

    versions = f"torch {torch.__version__}; transformers {transformers.__version__}"
    rows = []
    for arch in args.archs.split(","):
      row = run_one(arch, args.seed, hf_kwargs(arch, args.shape, args.layers))
      print(f"{arch:9s} logits {row['max_rel']:.2e} greedy: {row['greedy']} round trip "
            f"{row['roundtrip_bitwise']} [{row['seconds']:.0f} s] "
            f"{'ok' if row['ok'] else 'MISMATCH'}", flush=True)
      rows.append(row)
  table = _markdown(rows, jax.devices()[0].device_kind, versions,
                    _shape_text(args.shape, args.layers))
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)
  bad = [r["arch"] for r in rows if not r["ok"]]
  if bad:
    print(f"FAILED: {bad}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
