"""The grpo-demo end to end on CPU (a few steps), and its reward."""

import csv
import sys

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
  lines = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in lines if str(out) not in line) <= 100, max(lines, key=len)
  # It says that it compiles before the quiet first step.
  assert lines[0].startswith("grpo-demo: 3 steps") and "compiling" in lines[1]
  assert lines[2] == grpo_demo.HEADER and lines[3].startswith("   0  ")
  assert "ratio was exactly 1" in lines[-1] and "stock XLA: the ratio differed" in lines[-2]


def _fake_history(steps):
  row = {k: 0.0 for k in grpo_demo.FIELDS}
  row.update(ratio_exact_jaxrl=True, ratio_exact_xla=False, ratio_exact_jaxrl_grad=True)
  return [{**row, "step": i} for i in range(steps)]


def test_without_matplotlib_it_says_so_first_and_writes_the_csv(tmp_path, capsys, monkeypatch):
  ran = []
  monkeypatch.setattr(grpo_demo, "has_matplotlib", lambda: False)
  monkeypatch.setattr(grpo_demo, "run",
                      lambda args: ran.append(capsys.readouterr().out) or _fake_history(2))
  assert grpo_demo.main(["--out", str(tmp_path), "--steps", "2"]) == 0
  # The notice came before any training step, and the run went on without the plot.
  assert "matplotlib is not installed" in ran[0] and "jaxrl_kernels[demo]" in ran[0]
  assert len(list(csv.DictReader(open(tmp_path / "grpo_demo.csv")))) == 2
  assert not (tmp_path / "grpo_demo.png").exists()
  out = capsys.readouterr().out
  assert "grpo_demo.png" not in out and "differed from 1 at 2 of 2 steps" in out


def test_has_matplotlib_sees_a_missing_package(monkeypatch):
  assert grpo_demo.has_matplotlib()  # the test extra installs it
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
  assert not grpo_demo.has_matplotlib()


def test_step_line_fits_100_columns():
  row = {**_fake_history(1)[0], "step": 999, "reward": 0.123456, "exact": 1.0,
         "max_dlogp_jaxrl": 1.234e-7, "max_dlogp_jaxrl_grad": 4.56e-7, "max_dlogp_xla": 9.99e-1,
         "ratio_exact_jaxrl": False, "seconds": 1234.5}
  line = grpo_demo.step_line(row)
  assert len(line) <= 100 and len(grpo_demo.HEADER) <= 100
  assert line.split() == ["999", "0.123", "1.00", "1.2e-07", "4.6e-07", "NO", "1.0e+00",
                          "1234.5s"]
  assert grpo_demo.step_line(_fake_history(1)[0]).split()[3:6] == ["0", "0", "yes"]


def test_too_few_new_tokens_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="--new-tokens must be >= 3"):
    _run_demo(tmp_path, "--new-tokens", "2")


@pytest.mark.gpu
def test_demo_is_exactly_on_policy_inside_grad_on_gpu(tmp_path):
  rc, rows, _ = _run_demo(tmp_path, "--no-plot")
  assert rc == 0
  for r in rows:
    assert r["ratio_exact_jaxrl_grad"] == "True" and float(r["max_dlogp_jaxrl_grad"]) == 0.0
