"""examples/grpo_step.py runs end to end with tiny sizes."""

import importlib.util
import math
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "grpo_step.py"


def test_grpo_example_runs(capsys):
  spec = importlib.util.spec_from_file_location("grpo_step", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  hist = mod.main(["--preset", "test", "--steps", "2", "--prompts", "2", "--samples", "2",
                   "--prompt-len", "3", "--completion-len", "4"])
  assert len(hist) == 2
  for m in hist:
    for k in ("loss", "reward", "clipfrac", "approx_kl", "max_abs_dlogp", "grad_norm"):
      assert math.isfinite(m[k]), (k, m[k])
  assert "step 1:" in capsys.readouterr().out
