"""The grpo-demo end to end on CPU (a few steps) with a TinyCausalLM preset and with a
DecoderLM from a Hugging Face folder, its reward, and its argument errors."""

import csv
import json
import re
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_kernels import models
from jaxrl_kernels.cli import grpo_demo, main

# A one-layer Qwen2 (q/k/v biases, tied head) small enough for the CPU, with a few ids past
# the task's 16 (the model may sample them; the reward ignores them).
TINY_DECODER = dict(num_hidden_layers=1, vocab_size=20, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("grpo_hf") / "qwen2-tiny"
  models.save_pretrained(models.preset("qwen2.5-0.5b", 3, "float32", **TINY_DECODER), path)
  return path


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


def _run_demo(tmp_path, *extra, model="test", steps=3):
  out = tmp_path / "demo"
  rc = main(["grpo-demo", "--steps", str(steps), "--model", model, "--prompts-per-step", "4",
             "--group-size", "2", "--micro-batch-groups", "1", "--out", str(out), *extra])
  return rc, list(csv.DictReader(open(out / "grpo_demo.csv"))), out


def _assert_exactly_on_policy(rows):
  for r in rows:
    # The trainer recomputed the first micro-batch (2 rows, not the sampler's 8): same bits,
    # forward-only and inside jax.grad.
    assert r["ratio_exact_jaxrl"] == "True" and float(r["max_dlogp_jaxrl"]) == 0.0
    assert float(r["kl_jaxrl"]) == 0.0
    assert r["ratio_exact_jaxrl_grad"] == "True" and float(r["max_dlogp_jaxrl_grad"]) == 0.0
    assert 0.0 <= float(r["reward"]) <= 1.0
    assert np.isfinite(float(r["max_dlogp_xla"])) and np.isfinite(float(r["loss"]))


def test_demo_runs_and_jaxrl_is_exactly_on_policy(tmp_path, capsys):
  rc, rows, out = _run_demo(tmp_path, "--new-tokens", "4")
  assert rc == 0
  assert len(rows) == 3
  _assert_exactly_on_policy(rows)
  png = (out / "grpo_demo.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  lines = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in lines if str(out) not in line) <= 100, max(lines, key=len)
  # It names the model, then says what step 0 compiles before each program compiles.
  assert lines[0].startswith("grpo-demo: 3 steps")
  assert lines[1] == "model test: TinyCausalLM, 1 layer, hidden 32, 16 ids, float32 ..."
  assert lines[2].startswith("compiling during step 0")
  assert lines[3:6] == ["  jaxrl_kernels: sampler, trainer forward ...",
                        "  stock XLA: sampler, trainer forward ...",
                        "  training step (jax.grad, Adam) ..."]
  assert lines[6] == grpo_demo.HEADER and lines[7].startswith("   0  ")
  assert lines[8].startswith("   1  ") and lines[9].startswith("   2  ")
  assert "ratio was exactly 1" in lines[-1] and "stock XLA: the ratio differed" in lines[-2]


@pytest.mark.slow  # the demo's loop runs in CI on the tiny model (test above)
def test_decoder_lm_from_a_hf_folder_is_exactly_on_policy(hf_folder, tmp_path, capsys):
  """A DecoderLM loaded from a Hugging Face folder, in bfloat16 (the dtype of the real
  shapes), through the whole demo: sampler, trainer forward, jax.grad, Adam, CSV."""
  rc, rows, out = _run_demo(tmp_path, "--no-plot", "--model-dtype", "bfloat16",
                            model=f"hf:{hf_folder}", steps=2)
  assert rc == 0
  assert [r["step"] for r in rows] == ["0", "1"]
  _assert_exactly_on_policy(rows)
  assert not (out / "grpo_demo.png").exists()
  lines = capsys.readouterr().out.splitlines()
  assert lines[1] == (f"model hf:{hf_folder}: DecoderLM qwen2, 1 layer, 10.0K parameters, "
                      f"bfloat16, weights from the folder ...")
  assert lines[6] == grpo_demo.HEADER
  assert "ratio was exactly 1" in lines[-1]


@pytest.mark.slow  # the demo's loop runs in CI on the tiny model; MoE on-policy: tests/models
def test_a_moe_folder_is_exactly_on_policy(tmp_path, capsys):
  """A qwen3_moe DecoderLM from a folder through the whole demo (routing, grouped GEMMs,
  expert gradients under jax.grad): the ratio is exactly 1, the stock path's is not."""
  cfg = models.DecoderConfig(model_type="qwen3_moe", vocab_size=300, hidden_size=64,
                             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32)
  folder = str(tmp_path / "moe")
  models.save_pretrained(models.DecoderLM(cfg, rngs=nnx.Rngs(0)), folder)
  rc, rows, _ = _run_demo(tmp_path, "--no-plot", model=f"hf:{folder}", steps=2)
  assert rc == 0
  _assert_exactly_on_policy(rows)
  lines = capsys.readouterr().out.splitlines()
  assert "DecoderLM qwen3_moe, 2 layers" in lines[1]
  assert "ratio was exactly 1" in lines[-1]


def test_stock_twin_shares_the_parameters(hf_folder):
  """The stock path is the same module with implementation="xla" on the same arrays (no
  second set of weights), and in step after the demo's update."""
  model = models.from_pretrained(hf_folder)
  twin = grpo_demo.stock_twin(model)
  assert model.implementation is None and twin.implementation == "xla"
  assert {layer.self_attn.implementation for layer in twin.layers} == {"xla"}
  assert twin.head.implementation == "xla" and twin.row_chunks == model.row_chunks
  ours = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(a is b for a, b in zip(ours, jax.tree.leaves(nnx.state(twin, nnx.Param)),
                                    strict=True))
  # The demo's update: new arrays in the model, then nnx.update of the twin.
  nnx.update(model, jax.tree.map(lambda x: x * 2, nnx.state(model, nnx.Param)))
  nnx.update(twin, nnx.state(model))
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                                    jax.tree.leaves(nnx.state(twin, nnx.Param)), strict=True))
  tiny = grpo_demo.build_policy(grpo_demo.policy_spec("test"), seed=0, implementation=None)
  tiny_twin = grpo_demo.stock_twin(tiny)
  assert tiny.config.implementation is None and tiny_twin.config.implementation == "xla"
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(tiny, nnx.Param)),
                                    jax.tree.leaves(nnx.state(tiny_twin, nnx.Param)),
                                    strict=True))
  with pytest.raises(TypeError, match="must be a TinyCausalLM or a DecoderLM, got int"):
    grpo_demo.stock_twin(3)


def test_policy_spec_reads_presets_layers_and_dtypes(hf_folder):
  spec = grpo_demo.policy_spec("qwen2.5-0.5b", layers=2)
  assert spec.kind == "preset" and spec.dtype == "bfloat16"  # the real shapes' default
  assert spec.config == models.config("qwen2.5-0.5b", num_hidden_layers=2)
  assert grpo_demo.describe(spec) == ("qwen2.5-0.5b: DecoderLM qwen2, 2 layers, 166.0M "
                                      "parameters, bfloat16, random weights")
  assert grpo_demo.policy_spec("llama-3.2-1b", dtype="float32").config == models.config(
      "llama-3.2-1b")
  tiny = grpo_demo.policy_spec("small", dtype="bfloat16")
  assert tiny.kind == "tiny" and tiny.config.dtype == "bfloat16"
  assert tiny.config.vocab_size == grpo_demo.VOCAB == 16
  assert grpo_demo.policy_spec("tiny").config.dtype == "float32"
  folder = grpo_demo.policy_spec(f"hf:{hf_folder}")
  assert folder.kind == "hf" and folder.dtype is None and folder.path == str(hf_folder)
  # The architecture from config.json alone (the weights are read only when building).
  assert folder.config.model_type == "qwen2" and folder.config.hidden_size == 32
  assert folder.config.vocab_size == 20 and folder.config.num_hidden_layers == 1


def _config_only_folder(path, vocab_size):
  cfg = models.config("qwen2.5-0.5b", **{**TINY_DECODER, "vocab_size": vocab_size})
  path.mkdir()
  (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
  return path


def _refused(argv, capsys):
  """``grpo_demo.main(argv)`` stops with exit status 2 and one line on stderr, no traceback,
  before any model is built; returns that line."""
  with pytest.raises(SystemExit) as e:
    grpo_demo.main(argv)
  out, err = capsys.readouterr()
  assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, (out, err)
  assert "model " not in out  # nothing was built
  return err


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt2"], r"--model must be one of test, tiny, small, .*qwen2\.5-0\.5b.*hf:PATH, "
                          r"got 'gpt2'"),
    (["--model", "hf:/no/such/folder"], r"--model hf:/no/such/folder: expected a Hugging Face "
                                        r"folder with config.json"),
    (["--model", "tiny", "--layers", "2"], r"--layers applies to the models presets .* got "
                                           r"--model 'tiny'"),
    (["--model", "qwen2.5-0.5b", "--layers", "0"], r"argument --layers: must be an int >= 1, "
                                                   r"got '0'"),
    (["--steps", "0"], r"argument --steps: must be an int >= 1, got '0'"),
    (["--steps", "-3"], r"argument --steps: must be an int >= 1, got '-3'"),
    (["--group-size", "0"], r"argument --group-size: must be an int >= 1"),
    (["--docs-per-step", "-1"], r"argument --docs-per-step: must be an int >= 0"),
    (["--lr", "nan"], r"argument --lr: must be a finite number > 0, got 'nan'"),
    (["--temperature", "0"], r"argument --temperature: temperature must be > 0"),
    (["--temperature", "-1"], r"argument --temperature: temperature must be > 0"),
    (["--temperature", "nan"], r"argument --temperature: temperature must be finite"),
    (["--seed", "-1"], r"argument --seed: must be an int in \[0, 4294967295\], got '-1'"),
    (["--new-tokens", "2"], r"argument --new-tokens: must be an int >= 3"),
    (["--model-dtype", "float64"], r"argument --model-dtype: invalid choice: 'float64'"),
    (["--model-dtype", "float16"], r"--model-dtype float16 with --model tiny: TinyLMConfig: "
                                   r"dtype must be"),
    (["--prompts-per-step", "3", "--micro-batch-groups", "2"],
     r"--prompts-per-step 3 x --group-size 4 = 12 completions per step do not split into "
     r"micro-batches of --micro-batch-groups 2"),
])
def test_bad_arguments_exit_2_naming_the_flag(tmp_path, argv, match, capsys):
  err = _refused([*argv, "--out", str(tmp_path), "--no-plot"], capsys)
  assert re.search(match, err), err


def test_out_that_is_a_file_exits_2(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  err = _refused(["--out", str(tmp_path / "file"), "--no-plot"], capsys)
  assert f"--out {tmp_path / 'file'}: " in err


def test_layers_with_a_folder_and_a_small_vocabulary_are_refused(hf_folder, tmp_path, capsys):
  err = _refused(["--model", f"hf:{hf_folder}", "--layers", "1", "--out", str(tmp_path)],
                 capsys)
  assert re.search(r"--layers applies to the models presets .* got --model 'hf:", err)
  # Checked from config.json before any weight is read (the folder has none).
  small = _config_only_folder(tmp_path / "v15", 15)
  err = _refused(["--model", f"hf:{small}", "--out", str(tmp_path)], capsys)
  assert re.search(r"--model hf:.*v15 has a vocabulary of 15 ids, but the task's tokens are "
                   r"ids 0\.\.15 \(at least 16\)", err)
  assert grpo_demo.policy_spec(f"hf:{_config_only_folder(tmp_path / 'v16', 16)}").config \
      .vocab_size == 16  # the task's 16 ids are enough
  with pytest.raises(ValueError, match=r"--model-dtype must be one of float32, bfloat16, "
                                       r"float16, fp32, bf16, fp16, auto, got 'float64'"):
    grpo_demo.policy_spec("tiny", dtype="float64")
  assert grpo_demo.policy_spec("tiny", dtype="bf16").config.dtype == "bfloat16"
  assert grpo_demo.policy_spec("qwen2.5-0.5b", dtype="fp16").dtype == "fp16"  # as given


def test_a_corrupt_folder_exits_2(hf_folder, tmp_path, capsys):
  import shutil
  bad = tmp_path / "badjson"
  bad.mkdir()
  (bad / "config.json").write_text("[1, 2]")
  err = _refused(["--model", f"hf:{bad}", "--out", str(tmp_path)], capsys)
  assert f"--model hf:{bad}: cannot read {bad / 'config.json'}" in err
  # Weights cut short: refused by the library while loading, exit 2 (the run announced the
  # model on stdout first).
  cut = tmp_path / "cut"
  shutil.copytree(hf_folder, cut)
  weights = sorted(cut.glob("*.safetensors"))[0]
  weights.write_bytes(weights.read_bytes()[:100])
  with pytest.raises(SystemExit) as e:
    grpo_demo.main(["--model", f"hf:{cut}", "--out", str(tmp_path), "--no-plot"])
  out, err = capsys.readouterr()
  assert e.value.code == 2 and err.count("\n") == 1 and f"--model hf:{cut}: " in err


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


@pytest.mark.slow
def test_real_preset_shape_on_cpu(tmp_path):
  """qwen2.5-0.5b's true layer and vocabulary shapes (151936 ids, one layer via --layers):
  ours bitwise; the stock path's materialised log-softmax over 151936 ids, at the
  sampler's and the trainer's shapes, differs (at both steps on this CPU)."""
  rc, rows, _ = _run_demo(tmp_path, "--no-plot", "--layers", "1", "--model-dtype", "float32",
                          model="qwen2.5-0.5b", steps=2)
  assert rc == 0
  _assert_exactly_on_policy(rows)
  assert any(r["ratio_exact_xla"] == "False" for r in rows), "control: stock XLA drifted nowhere"


@pytest.mark.gpu
def test_demo_is_exactly_on_policy_inside_grad_on_gpu(tmp_path):
  rc, rows, _ = _run_demo(tmp_path, "--no-plot")
  assert rc == 0
  for r in rows:
    assert r["ratio_exact_jaxrl_grad"] == "True" and float(r["max_dlogp_jaxrl_grad"]) == 0.0


@pytest.mark.gpu
def test_real_preset_is_exactly_on_policy_on_gpu(tmp_path):
  """qwen2.5-0.5b at its true shapes in bfloat16 (two layers, to keep the compile short):
  the sampler (32 rows) and the trainer (8-row micro-batches) give the same bits; the
  stock XLA path, sampled and rescored at those batch sizes, does not at some step."""
  out = tmp_path / "demo"
  rc = main(["grpo-demo", "--model", "qwen2.5-0.5b", "--model-dtype", "bfloat16",
             "--layers", "2", "--steps", "4", "--no-plot", "--out", str(out)])
  rows = list(csv.DictReader(open(out / "grpo_demo.csv")))
  assert rc == 0 and len(rows) == 4
  _assert_exactly_on_policy(rows)
  assert any(r["ratio_exact_xla"] == "False" for r in rows), "control: stock XLA drifted nowhere"
