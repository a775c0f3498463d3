"""The grpo-demo end to end on CPU (a few steps), and its reward."""

import csv

import numpy as np
import pytest

from jaxrl_kernels.__main__ import main
from jaxrl_kernels.demos import grpo_demo


def test_answers_and_rewards():
  prompts, answers = grpo_demo.make_prompts(np.random.default_rng(0), 50)
  for (a, _, b, _), ans in zip(prompts, answers):
    digits = [int(c) for c in str(int(a + b))] + [grpo_demo.EOS]
    assert list(ans[:len(digits)]) == digits and np.all(ans[len(digits):] == -1)
  ans = np.asarray([[1, 2, grpo_demo.EOS], [7, grpo_demo.EOS, -1]])
  comp = np.asarray([[1, 2, grpo_demo.EOS], [7, 3, 0]])
  reward, exact = grpo_demo.rewards_of(comp, ans)
  assert list(exact) == [True, False]
  assert reward[0] == 1.0 and reward[1] == 0.25  # half of the answer right, shaped by 0.5


def _run_demo(tmp_path, *extra):
  out = tmp_path / "demo"
  rc = main(["grpo-demo", "--steps", "3", "--model", "test", "--prompts-per-step", "4",
             "--group-size", "2", "--micro-batch-groups", "1", "--out", str(out), *extra])
  return rc, list(csv.DictReader(open(out / "grpo_demo.csv"))), out


def test_demo_runs_and_jaxrl_is_exactly_on_policy(tmp_path, capsys):
  rc, rows, out = _run_demo(tmp_path, "--new-tokens", "4")
  assert rc == 0
  assert len(rows) == 3
  for r in rows:
    # The trainer recomputed the first micro-batch (2 rows, not the sampler's 8): same bits.
    assert r["ratio_exact_jaxrl"] == "True" and float(r["max_dlogp_jaxrl"]) == 0.0
    assert float(r["kl_jaxrl"]) == 0.0
    assert 0.0 <= float(r["reward"]) <= 1.0
    assert np.isfinite(float(r["max_dlogp_xla"])) and np.isfinite(float(r["loss"]))
    # Inside jax.grad too (on CPU since the interpret-mode fix of docs/nn.md).
    assert r["ratio_exact_jaxrl_grad"] == "True" and float(r["max_dlogp_jaxrl_grad"]) == 0.0
  png = (out / "grpo_demo.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  assert "ratio was exactly 1" in capsys.readouterr().out


def test_too_few_new_tokens_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="--new-tokens must be >= 3"):
    _run_demo(tmp_path, "--new-tokens", "2")


@pytest.mark.gpu
def test_demo_is_exactly_on_policy_inside_grad_on_gpu(tmp_path):
  rc, rows, _ = _run_demo(tmp_path, "--no-plot")
  assert rc == 0
  for r in rows:
    assert r["ratio_exact_jaxrl_grad"] == "True" and float(r["max_dlogp_jaxrl_grad"]) == 0.0
