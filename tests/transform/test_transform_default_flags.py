"""batch_invariant is bitwise on the CPU with XLA's default flags (FMA contraction on,
LLVM's default optimisation), where the suite's flags (tests/conftest.py) would hide
fusion-dependent bits. A subprocess starts JAX without them and checks, each with a
control showing the untransformed function change bits there:

* a product of two activations written with ``@`` (``jnp.matmul`` squeezes the batch
  dimension away at batch 1): row 0 at batch 1 equals row 0 at batch 8;
* ``jax.nn.softmax`` and ``exp(x - max)`` on ``[8, 16, 32]`` and ``[8, 4, 128]``: the same;
* the plain-jnp Llama of ``llama_jnp.py`` at its default sizes: row 0 at batch 1
  and 8, decode one token at a time == the full forward.
"""

from __future__ import annotations

import textwrap

from helpers import run_without_fma

_SCRIPT = textwrap.dedent("""
    import functools, json, sys
    sys.path.insert(0, "tests/transform")
    import jax, jax.numpy as jnp, numpy as np
    import llama_jnp as L
    from jaxrl_kernels import _backend
    from jaxrl_kernels.transform import batch_invariant

    out = {"fma": bool(_backend.cpu_contracts_fma()), "checks": {}, "control": {}}

    def same(a, b):
      a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
      return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))

    def wide(seed, shape):
      k = jax.random.key(seed)
      x = jax.random.normal(k, shape, jnp.float32)
      e = jax.random.randint(jax.random.fold_in(k, 1), shape, -6, 7).astype(jnp.float32)
      return x * 2.0 ** e

    def rows_invariant(fn, *args):
      f = jax.jit(fn)
      full = f(*args)
      return same(f(*(a[:1] for a in args))[0], full[0])

    def record(name, fn, *args):
      out["checks"][name] = rows_invariant(batch_invariant(fn), *args)
      out["control"][name] = rows_invariant(fn, *args)

    w = wide(10, (2, 32, 32))
    record("6a activation @ activation",
           lambda x: (x @ w[0]) @ jnp.swapaxes(x @ w[1], -1, -2),
           wide(11, (8, 16, 32)))
    for shape in ((8, 16, 32), (8, 4, 128)):
      x = wide(12, shape)
      record(f"6b softmax {shape}", lambda x: jax.nn.softmax(x, -1), x)
      record(f"6b exp(x - max) {shape}", lambda x: jnp.exp(x - jnp.max(x, -1, keepdims=True)), x)

    cfg = L.LlamaConfig()
    params = L.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab)
    for label, wrap in (("checks", batch_invariant), ("control", lambda f: f)):
      fwd = jax.jit(wrap(functools.partial(L.forward, cfg=cfg)))
      dec = jax.jit(wrap(functools.partial(L.decode_logits, cfg=cfg)))
      full = fwd(params, tokens)
      out[label]["6c llama rows"] = same(fwd(params, tokens[:1])[0], full[0])
      out[label]["6c llama decode == prefill"] = same(dec(params, tokens[:3]), full[:3])
    print("RESULT " + json.dumps(out))
""")


def test_batch_invariant_is_bitwise_with_default_xla_flags():
  out = run_without_fma(_SCRIPT)
  failed = [name for name, ok in out["checks"].items() if not ok]
  assert not failed, f"batch_invariant changed bits with XLA's default CPU flags: {failed}"
  # Controls: the untransformed functions change bits on the same machine and flags
  # (the activation product and the Llama always; softmax's exp on this XLA).
  held = [name for name, ok in out["control"].items() if ok]
  assert len(held) < len(out["control"]), f"no control changed bits: {out['control']}"
  for name in ("6a activation @ activation", "6c llama rows", "6c llama decode == prefill"):
    assert not out["control"][name], f"control {name!r} kept its bits"
