"""``jaxrl_kernels.cli.model_fn``: loading a user's ``module:function`` model and the
sampler/trainer parity report on it (the ``jaxrl-kernels parity --model-fn`` command)."""

import dataclasses
import os

import jax.numpy as jnp
import pytest

from jaxrl_kernels.cli import model_fn


@dataclasses.dataclass(frozen=True)
class Bigram:
  """Logits of the next token from the current one; ``skew`` makes decode disagree."""

  skew: float = 0.0

  def forward(self, params, tokens):
    return params[tokens]

  def init_cache(self, params, batch, max_len):
    return jnp.zeros((batch,), jnp.int32)

  def decode(self, params, cache, token, position):
    return params[token] * (1.0 + self.skew), cache + 1


def build_bigram(seed):
  table = jnp.linspace(-3.0, 3.0, 11 * 11).reshape(11, 11) * (1 + seed)
  return table, Bigram()


def build_skewed(seed):
  return build_bigram(seed)[0], Bigram(skew=1e-6)


def build_one(seed):
  return (None,)


def build_no_decode(seed):
  return None, object()


not_callable = 3


def test_load_returns_params_and_model():
  params, model = model_fn.load("test_model_fn:build_bigram", seed=1)
  assert params.shape == (11, 11) and isinstance(model, Bigram)


@pytest.mark.parametrize("spec,error,match", [
    ("no_colon", ValueError, "module:function"),
    ("a:b:c", ValueError, "module:function"),
    (":build", ValueError, "module:function"),
    ("no_such_module_xyz:build", ImportError, "no_such_module_xyz"),
    ("test_model_fn:missing", AttributeError, "has no attribute 'missing'"),
    ("test_model_fn:not_callable", TypeError, "must be a function"),
    ("test_model_fn:build_one", TypeError, r"must return \(params, model\), got a tuple of 1"),
    ("test_model_fn:build_no_decode", TypeError, "missing forward, init_cache, decode"),
])
def test_load_errors_name_the_problem(spec, error, match):
  with pytest.raises(error, match=match):
    model_fn.load(spec)


def test_parity_report_bitwise_on_a_llama_written_in_jnp(capsys, monkeypatch):
  # The repository's test model, tests/transform/llama_jnp.py.
  monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "transform"))
  ok = model_fn.parity_report("llama_jnp:build", batch=2, prompt_len=3, new_tokens=3)
  out = capsys.readouterr().out
  assert ok, out
  assert "-- as written" in out and "-- batch_invariant" in out
  assert "6 sampled tokens" in out and "bitwise on-policy" in out


def test_parity_report_fails_when_decode_and_forward_disagree(capsys):
  assert model_fn.parity_report("test_model_fn:build_bigram", batch=2, prompt_len=2,
                                new_tokens=2)
  assert not model_fn.parity_report("test_model_fn:build_skewed", batch=2, prompt_len=2,
                                    new_tokens=2)
  assert "NOT bitwise" in capsys.readouterr().out
  with pytest.raises(ValueError, match="batch must be a positive int"):
    model_fn.parity_report("test_model_fn:build_bigram", batch=0)
