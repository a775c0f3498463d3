"""The command line end to end on this device: ``parity`` (default), ``kernels``, ``grpo-demo``."""

import sys
import types

import numpy as np

import jaxrl_kernels.nn.sampler
from jaxrl_kernels.__main__ import main

SMALL = ["--model", "test", "--batch", "3", "--prompt-len", "4", "--new-tokens", "5",
         "--dtype", "float32"]


def test_parity_is_the_default_and_exits_zero(capsys):
  assert main(SMALL) == 0
  out = capsys.readouterr().out
  assert "jax " in out and "device" in out
  assert "== kernels" in out and "det_matmul" in out and "jnp.dot (XLA)" in out
  assert "-- stock XLA" in out and "-- jaxrl_kernels" in out
  assert out.count("logprob drift") == 2 and "approx_kl0" in out and "worst token" in out
  # jaxrl_kernels' table says bitwise (the stock one may or may not on CPU).
  ours = out.split("-- jaxrl_kernels")[1]
  assert "bitwise equal  yes" in ours and "bitwise NO" not in ours
  assert "jaxrl_kernels is bitwise on-policy" in out


def test_parity_with_tensor_parallel_head(capsys):
  assert main(["parity", *SMALL, "--vocab-size", "256", "--tp", "2"]) == 0
  out = capsys.readouterr().out
  assert "vocab-parallel head, TP=2" in out and "jaxrl_kernels is bitwise on-policy" in out


def test_parity_exits_nonzero_when_the_trainer_drifts(capsys, monkeypatch):
  score = jaxrl_kernels.nn.sampler.score

  def one_ulp_off(*a, **kw):
    out = score(*a, **kw)
    return np.where(out != 0, np.nextafter(out, np.float32(0)), out)

  monkeypatch.setattr(jaxrl_kernels.nn.sampler, "score", one_ulp_off)
  assert main(["parity", *SMALL]) == 1
  assert "NOT bitwise on-policy" in capsys.readouterr().out


def test_kernels_command(capsys):
  assert main(["kernels", "--dtype", "float32"]) == 0
  out = capsys.readouterr().out
  assert "bitwise batch-invariant on this device" in out and "on-policy" not in out


def test_grpo_demo_gets_its_arguments(monkeypatch):
  seen = []
  demo = types.ModuleType("jaxrl_kernels.demos.grpo_demo")
  demo.main = lambda argv: seen.append(argv) or 0
  pkg = types.ModuleType("jaxrl_kernels.demos")
  pkg.grpo_demo = demo
  monkeypatch.setitem(sys.modules, "jaxrl_kernels.demos", pkg)
  monkeypatch.setitem(sys.modules, "jaxrl_kernels.demos.grpo_demo", demo)
  assert main(["grpo-demo", "--steps", "2"]) == 0
  assert seen == [["--steps", "2"]]


def test_progress_falls_back_to_prints_without_rich(capsys, monkeypatch):
  from jaxrl_kernels.parity import _Progress
  monkeypatch.setitem(sys.modules, "rich.progress", None)  # `import rich.progress` fails
  with _Progress(2) as bar:
    bar.stage("sample")
    bar.stage("score")
    bar.finish()
  assert capsys.readouterr().out == "[1/2] sample\n[2/2] score\n"
