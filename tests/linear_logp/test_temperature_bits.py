"""The "cpu" head under XLA's default CPU flags (FMA contraction on), bf16, temperature != 1.

``linear_logp`` without the entropy must give the log-probs of ``linear_logp`` with it (the
sampler's head computes the statistics with the entropy, the scorer without), and the
float32 / temperature 1 cases show that it does there. At bf16 and temperature 0.7 or 1.3 a
few rows differ in the last bit: the two programs compile the merge of the softmax
partials (its ``exp`` and ``log``) into different code. The suite's own flags hide it (no
FMA), so this runs in a process with the default flags. The known defect is marked
``xfail(strict=True)``: the test turns red when the bits agree, so the marker goes with it.
"""

from __future__ import annotations

import pytest
from helpers import run_without_fma

_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import jaxrl_kernels as jk
from jaxrl_kernels import _backend
rng = np.random.default_rng(0)
T, H, V = 64, 128, 640
out = {"fma": bool(_backend.cpu_contracts_fma())}
for dt in ("bfloat16", "float32"):
  h = jnp.asarray(rng.standard_normal((T, H)) * 2.0 ** rng.integers(-4, 5, (T, 1)), dt)
  w = jnp.asarray(rng.standard_normal((H, V)) * 0.1, dt)
  t = jnp.asarray(rng.integers(0, V, T), jnp.int32)
  for temp in (0.7, 1.0, 1.3):
    f = lambda h, w, e: jk.linear_logp(h, w, t, temperature=temp, implementation="cpu",
                                       return_entropy=e)
    with_ent = np.asarray(jax.jit(lambda h, w: f(h, w, True))(h, w)[0])  # entropy an output
    without = np.asarray(jax.jit(lambda h, w: f(h, w, False))(h, w))
    out[f"{dt}/{temp}"] = int((with_ent.view(np.uint32) != without.view(np.uint32)).sum())
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def differing_rows() -> dict:
  return run_without_fma(_SCRIPT)


@pytest.mark.parametrize("case", ["float32/0.7", "float32/1.3", "float32/1.0", "bfloat16/1.0"])
def test_logp_without_entropy_has_its_bits(differing_rows, case):
  assert differing_rows[case] == 0


@pytest.mark.xfail(strict=True, reason="known defect: at bf16 and temperature != 1 the 'cpu' "
                   "head's merge (exp, log) compiles to other code with and without the "
                   "entropy under XLA's default CPU flags, so a few log-probs differ in the "
                   "last bit")
@pytest.mark.parametrize("case", ["bfloat16/0.7", "bfloat16/1.3"])
def test_bf16_logp_without_entropy_has_its_bits(differing_rows, case):
  assert differing_rows[case] == 0
