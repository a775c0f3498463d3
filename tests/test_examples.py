"""examples/grpo_step.py end to end as a user runs it: no XLA flag, the CPU default
implementation, and the trainer's log-probs are the sampler's bits at every step."""

import os
import pathlib
import re
import subprocess
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_step.py"
_STEP = re.compile(r"^step (\d+): loss ([-+.\deE]+)  reward ([.\d]+)  max\|dlogp\| (\S+) "
                   r"\((\d+) of (\d+) log-probs differ\)")


def _user_env() -> dict[str, str]:
  """The environment of a user who sets no flag: the test suite's XLA_FLAGS (the host
  device count and the no-FMA ISA cap) are dropped, so XLA's CPU compiler may contract
  a*b+c into fused multiply-adds wherever the CPU has FMA."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_grpo_example_is_bitwise_on_policy_without_flags():
  r = subprocess.run(
      [sys.executable, str(_PATH), "--preset", "test", "--steps", "3", "--prompts", "2",
       "--samples", "2", "--prompt-len", "3", "--completion-len", "4"],
      env=_user_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  # A warning about FMA contraction, if any op still warns, points at the user's line.
  warned = [line for line in r.stderr.splitlines() if "FMAContractionWarning" in line]
  assert all(line.startswith(f"{_PATH}:") for line in warned), warned
  steps = [_STEP.match(line) for line in r.stdout.splitlines()]
  assert [int(m[1]) for m in steps if m] == [0, 1, 2], r.stdout
  for m in filter(None, steps):
    loss, reward, drift, differ, tokens = float(m[2]), float(m[3]), m[4], int(m[5]), int(m[6])
    assert abs(loss) < 1e3 and 0.0 <= reward <= 1.0
    # Every completion token of the 4 rows (4 tokens each) is compared on its raw bits.
    assert tokens == 16 and differ == 0 and drift == "0.0", m[0]


_HF = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_hf.py"


def test_grpo_hf_example_runs_on_a_tiny_folder_on_policy(tmp_path):
  """examples/grpo_hf.py end to end on a tiny random folder with a tokenizer, with the user's
  flags (FMA contraction where the CPU has it; LLVM at -O0 for the compile time only): every
  step's ratio exactly 1, the stock path's drift reported, the checkpoint reloaded with the
  same log-prob bits, history and plot written."""
  out = tmp_path / "out"
  env = {**_user_env(), "XLA_FLAGS": "--xla_backend_optimization_level=0"}
  r = subprocess.run(
      [sys.executable, str(_HF), "--tiny-folder", str(tmp_path / "tiny"), "--out", str(out),
       "--steps", "2", "--prompts", "2", "--group", "2", "--new-tokens", "4"],
      env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  steps = [line for line in r.stdout.splitlines() if " step " in line]
  assert len(steps) == 2 and all("ratio==1 yes" in line for line in steps), r.stdout
  assert "reloaded log-probs bitwise equal: yes" in r.stdout
  assert (out / "history.csv").read_text().count("\n") == 3
  assert (out / "checkpoint" / "config.json").exists()
