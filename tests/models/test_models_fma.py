"""``DecoderLM`` is on-policy bitwise on the CPU with XLA's default flags (FMA contraction on).

The suite runs with ``--xla_cpu_max_isa=AVX`` (tests/conftest.py), which turns off
FMA contraction. A user's process does not. Here a subprocess starts JAX
without that flag and checks that the sampler's log-probs (``nn.sample``: prefill
and decode steps) equal the trainer's (``nn.score``, packed, another batch size)
bit for bit (Qwen3: RMSNorm on the residual stream and on q/k, rotary, SwiGLU), and
the control: the same model on the stock path (``implementation="xla"``) does not.
"""

from __future__ import annotations

import textwrap

from helpers import run_without_fma

_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxrl_kernels import _backend, nn
    from jaxrl_kernels.models import DecoderLM
    from jaxrl_kernels.models.config import DecoderConfig

    out = {"fma": bool(_backend.cpu_contracts_fma()), "checks": {}, "control": {}}
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 384, (4, 6)).astype(np.int32)
    lens = np.array([6, 3, 5, 1], np.int32)
    for arch in ("qwen3",):  # q/k RMSNorm, rotary, SwiGLU: every element-wise path
      cfg = DecoderConfig(model_type=arch, vocab_size=384, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, attention_bias=arch == "qwen2",
                          qk_norm=arch == "qwen3", tie_word_embeddings=arch != "llama")
      for impl, where in ((None, "checks"), ("xla", "control")):
        model = DecoderLM(cfg, dtype="float32", implementation=impl, rngs=nnx.Rngs(1))
        res = nn.sample(model, prompts, lens, max_new_tokens=8, key=jax.random.key(2))
        got = nn.score(model, res.tokens, res.completion_mask, pack=True, batch_size=3)
        m = np.asarray(res.completion_mask)
        a, b = np.asarray(got)[m], np.asarray(res.logp)[m]
        out[where][arch] = int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
    print("RESULT " + json.dumps(out))
""")


def test_decoder_sampler_equals_trainer_with_fma_contraction_on():
  out = run_without_fma(_SCRIPT)
  assert out["checks"] == {"qwen3": 0}, (
      f"sampled tokens whose log-prob differs from the trainer's: {out['checks']}")
  assert any(out["control"].values()), (
      f"control: the stock path kept every sampled token's bits: {out['control']}")
