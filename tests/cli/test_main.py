"""The command line end to end on this device: ``parity`` (default), ``kernels``, ``grpo-demo``;
its manners: unknown commands, ``--version``, help text, arguments refused before any work."""

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxrl_kernels
import jaxrl_kernels.nn.sampler
from jaxrl_kernels.cli import main, parity

SMALL = ["--model", "test", "--batch", "3", "--prompt-len", "4", "--new-tokens", "5",
         "--dtype", "float32"]


def test_parity_is_the_default_exits_zero_and_nonzero_when_the_trainer_drifts(capsys,
                                                                             monkeypatch):
  """``parity`` (the default command), then the same run with a drifting trainer: one test,
  so the second run reuses the first one's compiled programs."""
  # One run checks both the default command and the vocab-parallel head: the preset's V=64 is
  # one 128-wide vocab tile, so at TP=2 the CLI pads the head to 2 x 128 itself instead of
  # failing inside the TP head. Recomputations 1 and 2 are the ones a run without --tp makes.
  assert main([*SMALL, "--tp", "2"]) == 0
  out = capsys.readouterr().out
  assert "jax " in out and "device" in out
  assert "== kernels" in out and "det_matmul" in out and "jnp.dot (XLA)" in out
  assert "-- stock XLA" in out and "-- jaxrl_kernels" in out
  assert out.count("logprob drift") == 2 and "approx_kl0" in out and "worst token" in out
  assert "V=256 (64 padded for TP=2)" in out and "vocab-parallel head, TP=2" in out
  # jaxrl_kernels' table says bitwise for every recomputation (the stock one may or may not
  # on CPU).
  ours = out.split("-- jaxrl_kernels")[1]
  assert "bitwise equal  yes" in ours and "bitwise NO" not in ours
  assert all(f"  {i}. bitwise yes" in ours for i in (1, 2, 3))
  assert "jaxrl_kernels is bitwise on-policy" in out

  # The same run with the trainer's log-probs one ulp off exits 1 (it reuses the programs the
  # run above compiled).
  score = jaxrl_kernels.nn.sampler.score

  def one_ulp_off(*a, **kw):
    out = score(*a, **kw)
    return np.where(out != 0, np.nextafter(out, np.float32(0)), out)

  monkeypatch.setattr(jaxrl_kernels.nn.sampler, "score", one_ulp_off)
  assert main(["parity", *SMALL, "--tp", "2"]) == 1
  assert "NOT bitwise on-policy" in capsys.readouterr().out


@pytest.mark.parametrize("vocab, tp, valid", [(64, 2, None), (128, 2, None), (129, 2, 256),
                                               (256, 2, 256), (300, 3, 384), (200, 3, None),
                                               (1000, 8, 1024), (64, 1, 64)])
def test_tp_vocab_size(vocab, tp, valid):
  if tp == 1:
    assert parity.model_vocab_size(vocab, None, tp) == vocab
    return
  # What the TP head pads a vocabulary to: whole 128-wide tiles per shard, and every shard
  # holds at least one real id (None: no such padding exists).
  assert parity.tp_vocab_size(vocab, tp) == valid
  if valid is not None:
    v_s = valid // tp
    assert v_s % 128 == 0 and (tp - 1) * v_s < vocab <= valid
  # The model's vocabulary the CLI picks: the preset's where it splits, else the preset's
  # rounded up to a multiple of tp x 128, which always splits.
  model_v = parity.model_vocab_size(vocab, None, tp)
  assert model_v == (vocab if valid else -(-vocab // (tp * 128)) * tp * 128)
  assert parity.tp_vocab_size(model_v, tp) is not None


def test_a_vocabulary_tp_cannot_split_is_refused_before_any_work(capsys):
  t0 = time.perf_counter()
  with pytest.raises(SystemExit) as e:
    main([*SMALL, "--tp", "3", "--vocab-size", "200"])
  assert e.value.code == 2 and time.perf_counter() - t0 < 5
  out, err = capsys.readouterr()
  assert out == ""  # nothing ran: not even the header
  assert err.count("\n") == 1 and "--vocab-size 200 cannot be split over --tp 3" in err
  assert "use --vocab-size > 256, or leave it out" in err


def test_tp_on_one_device_says_what_to_do_before_any_work():
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # a one-device CPU
  t0 = time.perf_counter()
  r = subprocess.run([sys.executable, "-m", "jaxrl_kernels", "--tp", "2"], env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr
  assert r.stdout == "" and time.perf_counter() - t0 < 60
  assert r.stderr == ("jaxrl-kernels: error: --tp 2 needs 2 devices, JAX sees 1 (cpu); "
                      "--device cpu makes a host mesh of 2 CPU devices\n")


def test_unknown_command_lists_the_commands_and_the_closest(capsys):
  with pytest.raises(SystemExit) as e:
    main(["kernel"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "unknown command 'kernel'; did you mean 'kernels'?" in err
  assert "(commands: parity, kernels, grpo-demo)" in err
  with pytest.raises(SystemExit):
    main(["zzz"])
  assert "did you mean" not in capsys.readouterr().err


def test_version(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith(f"jaxrl-kernels {jaxrl_kernels.__version__} (jax ")


@pytest.mark.parametrize("argv", [["--help"], ["parity", "-h"], ["kernels", "-h"],
                                  ["grpo-demo", "-h"]])
def test_help_is_plain_text_with_defaults(argv, capsys):
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "``" not in out and ":mod:" not in out and ":func:" not in out and "**" not in out
  assert max(len(line) for line in out.splitlines()) <= 100
  if argv[0] == "--help":
    assert "parity" in out and "kernels" in out and "grpo-demo" in out and "--version" in out
  elif argv[0] == "grpo-demo":
    assert "(default: 80)" in out and "(default: 0.003)" in out
  else:
    assert "(default: bfloat16)" in out


def test_kernels_command(capsys):
  assert main(["kernels", "--dtype", "float32"]) == 0
  out = capsys.readouterr().out
  assert "bitwise batch-invariant on this device" in out and "on-policy" not in out


@pytest.mark.parametrize("argv, flag", [
    (["--implementation", "interpret"], True),
    (["parity", "--implementation", "cpu"], False),
    (["kernels", "--implementation", "xla"], False),
    (["kernels"], False),  # the CPU default, "cpu", needs no flag
])
def test_no_fma_flag_only_for_interpreted_kernels(argv, flag, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  seen = []
  monkeypatch.setattr(parity, "run_parity", lambda args: seen.append(os.environ["XLA_FLAGS"]))
  monkeypatch.setattr(parity, "run_kernels", lambda args: seen.append(os.environ["XLA_FLAGS"]))
  main(argv)
  assert ("--xla_cpu_max_isa=AVX" in seen[0]) == flag
  assert "--xla_force_host_platform_device_count=8" in seen[0]


def test_grpo_demo_gets_its_arguments(monkeypatch):
  from jaxrl_kernels.cli import grpo_demo
  seen = []
  monkeypatch.setattr(grpo_demo, "main", lambda argv: seen.append(argv) or 0)
  assert main(["grpo-demo", "--steps", "2"]) == 0
  assert seen == [["--steps", "2"]]


def test_progress_falls_back_to_prints_without_rich(capsys, monkeypatch):
  from jaxrl_kernels.cli.parity import Progress
  monkeypatch.setitem(sys.modules, "rich.progress", None)  # `import rich.progress` fails
  with Progress(2) as bar:
    bar.stage("sample")
    bar.stage("score")
    bar.finish()
  assert capsys.readouterr().out == "[1/2] sample\n[2/2] score\n"


def test_package_ships_py_typed():
  import importlib.resources
  import tomllib
  assert importlib.resources.files("jaxrl_kernels").joinpath("py.typed").is_file()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  assert "py.typed" in project["tool"]["setuptools"]["package-data"]["jaxrl_kernels"]
  # orbax-checkpoint is an extra that names what it is for; the core does not need it.
  deps = project["project"]["dependencies"]
  assert not any("orbax" in d for d in deps) and any(d.startswith("flax>=0.12,<0.13") for d in deps)
  assert project["project"]["optional-dependencies"]["orbax"] == ["orbax-checkpoint"]
  assert project["project"]["version"] == jaxrl_kernels.__version__


# ------------------------------------------- sharded models: --rollout-tp / --train-fsdp

SHARDED = ["parity", "--batch", "4", "--prompt-len", "4", "--new-tokens", "3"]


@pytest.mark.slow  # the library claim runs in CI: tests/models/test_parallel.py
def test_rollout_tp_against_train_fsdp_exits_zero_and_nonzero_on_a_drift(capsys, monkeypatch):
  assert main([*SHARDED, "--rollout-tp", "2", "--train-fsdp", "2"]) == 0
  out = capsys.readouterr().out
  assert "== rollout TP=2 vs training FSDP=2: tiny (V=1000, H=64, layers=2, float32)" in out
  assert "== kernels" not in out and "TinyCausalLM" not in out  # only this section runs
  rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
  ours = [r for r in rows if r[0] == "jaxrl_kernels"]
  # Sampled at TP=2 and unsharded, each scored by the FSDP=2 and the unsharded trainer.
  assert len(ours) == 4 and all("yes" in r and "12/12" in r for r in ours)
  assert [r[1] for r in ours] == ["TP=2", "TP=2", "unsharded", "unsharded"]
  # The controls are printed beside it (psum merge at TP=2, stock XLA).
  assert sum(r[:2] == ["psum", "merge"] for r in rows) == 2
  assert sum(r[:2] == ["stock", "XLA"] for r in rows) == 2
  assert "FSDP=2, packed" in out and "unsharded, chunks of 1" in out
  assert "is bitwise on-policy, every sampled token" in out

  # The same run with the FSDP trainer one ulp off exits 1 (it reuses the programs the run
  # above compiled).
  from jaxrl_kernels.models import ShardedDecoderLM
  score = jaxrl_kernels.nn.sampler.score

  def fsdp_one_ulp_off(model, *a, **kw):
    out = score(model, *a, **kw)
    if isinstance(model, ShardedDecoderLM) and model.parallelism.fsdp:
      out = np.where(out != 0, np.nextafter(out, np.float32(0)), out)
    return out

  monkeypatch.setattr(jaxrl_kernels.nn.sampler, "score", fsdp_one_ulp_off)
  assert main([*SHARDED, "--rollout-tp", "2", "--train-fsdp", "2"]) == 1
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.startswith("  jaxrl_kernels")]
  assert "NO" in rows[0] and "0/12" in " ".join(rows[0]) and "yes" in rows[1]
  assert "NO" in rows[2] and "0/12" in " ".join(rows[2]) and "yes" in rows[3]
  assert "NOT bitwise on-policy here" in out


@pytest.mark.parametrize("argv, message", [
    (["--rollout-tp", "0"], "argument --rollout-tp: must be an int >= 1, got '0'"),
    (["--train-fsdp", "two"], "argument --train-fsdp: must be an int >= 1, got 'two'"),
    (["--model", "gpt-9"], "argument --model: must be one of test, tiny, small, "),
    (["--model-fn", "no_function"], "argument --model-fn: must be 'module:function', got "
                                    "'no_function'"),
])
def test_bad_values_of_the_new_flags_are_argparse_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    main(["parity", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rollout-tp", "16"], "--rollout-tp 16 needs 16 devices, JAX sees 8"),
    (["--train-fsdp", "2", "--rollout-tp", "3"],
     "--rollout-tp 3 must divide the model's 8 key/value heads"),
    (["--rollout-tp", "2", "--tp", "2"], "--tp belongs to the TinyCausalLM check"),
    (["--model", "hf:/nonexistent/folder"], "--model hf:/nonexistent/folder: "),
    (["--model-fn", "no_such_module_xyz:build"],
     "--model-fn no_such_module_xyz:build: model_fn: cannot import module "
     "'no_such_module_xyz'"),
    (["--model-fn", "json:no_such_function"],
     "--model-fn json:no_such_function: model_fn: module 'json' has no attribute "
     "'no_such_function'"),
    (["--model-fn", "json:loads", "--rollout-tp", "2"], "--model-fn checks a user's model "
                                                        "function; it does not take"),
])
def test_sharded_and_model_fn_arguments_are_refused_before_any_work(argv, message, capsys):
  t0 = time.perf_counter()
  with pytest.raises(SystemExit) as e:
    main(["parity", *argv])
  assert e.value.code == 2 and time.perf_counter() - t0 < 5
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and message in err


def test_rollout_tp_must_divide_the_models_chunks():
  """A TP degree dividing the kv heads but not the model's canonical row-parallel chunks
  (at most 8) is named; one dividing both passes."""
  from jaxrl_kernels.cli.parity_tp import TINY, check_layout
  from jaxrl_kernels.models import config as preset_config

  wide = dataclasses.replace(TINY, num_attention_heads=16, num_key_value_heads=16)
  assert check_layout(wide, rollout_tp=16, train_fsdp=1, num_devices=16) == (
      "--rollout-tp 16 must divide the model's canonical row-parallel K chunks (o_proj 8, "
      "down_proj 8; models.canonical_row_chunks)")
  assert check_layout(wide, rollout_tp=8, train_fsdp=1, num_devices=16) is None
  qwen = preset_config("qwen2.5-0.5b")  # chunks (2, 4), 2 kv heads
  assert check_layout(qwen, rollout_tp=2, train_fsdp=1, num_devices=8) is None
  assert "must divide the model's 2 key/value heads" in check_layout(
      qwen, rollout_tp=4, train_fsdp=1, num_devices=8)


MODEL_FN = '''
import jax.numpy as jnp
import numpy as np


class Bigram:
  """logits = embed[token] @ w: a model function with a GEMM for batch_invariant."""

  def forward(self, params, tokens):
    return params["embed"][tokens] @ params["w"]

  def init_cache(self, params, batch, max_len):
    return jnp.zeros((batch,), jnp.int32)

  def decode(self, params, cache, token, position):
    return params["embed"][token] @ params["w"], cache


def build(seed):
  rng = np.random.default_rng(seed)
  params = {"embed": jnp.asarray(rng.normal(size=(64, 32)) * 2.0 ** rng.integers(-8, 8, (64, 1)),
                                 jnp.float32),
            "w": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)}
  return params, Bigram()
'''


def test_model_fn_runs_a_users_model_function(tmp_path, monkeypatch, capsys):
  (tmp_path / "user_bigram.py").write_text(MODEL_FN)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert main(["parity", "--model-fn", "user_bigram:build", "--batch", "3", "--prompt-len", "3",
               "--new-tokens", "3"]) == 0
  out = capsys.readouterr().out
  assert "on-policy parity of user_bigram:build" in out and "== kernels" not in out
  assert "batch_invariant(user_bigram:build) is bitwise on-policy" in out


def test_model_fn_exit_status_follows_the_report(monkeypatch, tmp_path):
  from jaxrl_kernels.cli import model_fn
  (tmp_path / "user_bigram.py").write_text(MODEL_FN)
  monkeypatch.syspath_prepend(str(tmp_path))
  seen = []
  monkeypatch.setattr(model_fn, "parity_report",
                      lambda spec, **kw: seen.append((spec, kw)) or False)
  assert main(["parity", "--model-fn", "user_bigram:build", "--seed", "3"]) == 1
  spec, kw = seen[0]
  assert spec == "user_bigram:build" and kw["seed"] == 3 and kw["batch"] == 8
  assert callable(kw["progress"])


# --------------------------------------- bad arguments and bad input files: exit 2, one line


def _refused(argv, capsys):
  """Runs ``main(argv)``; asserts exit status 2, nothing on stdout, one line on stderr (no
  traceback); returns that line."""
  with pytest.raises(SystemExit) as e:
    main(argv)
  out, err = capsys.readouterr()
  assert e.value.code == 2, (out, err)
  assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], "argument --temperature: temperature must be > 0, got 0.0"),
    (["--temperature", "-1"], "argument --temperature: temperature must be > 0, got -1.0"),
    (["--temperature", "nan"], "argument --temperature: temperature must be finite"),
    (["--temperature", "inf"], "argument --temperature: temperature must be finite"),
    (["--temperature", "1e-42"], "argument --temperature: temperature must lie in"),
    (["--temperature", "warm"], "argument --temperature: "),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 4294967295], got '-1'"),
    (["--seed", "4294967296"], "argument --seed: must be an int in [0, 4294967295]"),
    (["--model-dtype", "float64"], "argument --model-dtype: invalid choice: 'float64'"),
    (["--params", "/no/such/params.safetensors"],
     "--params /no/such/params.safetensors: no such file or folder"),
    (["--model-dtype", "float16"], "--model-dtype float16: TinyLMConfig: dtype must be"),
    (["--model-dtype", "float16", "--model", "test"], "--model-dtype float16: "),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
  err = _refused(["parity", *argv], capsys)
  assert message in err and "jaxrl-kernels" in err


def test_model_dtype_aliases_are_accepted(monkeypatch):
  seen = []
  monkeypatch.setattr(parity, "run_parity", lambda args: seen.append(args.model_dtype) or 0)
  for dtype in parity.MODEL_DTYPES:
    assert main(["parity", "--model-dtype", dtype]) == 0
  assert seen == list(parity.MODEL_DTYPES)
  assert {"float16", "bf16", "fp16", "fp32", "auto"} <= set(seen)
  assert parity.plain_dtype("--model-dtype", "bf16", "float32") == "bfloat16"
  assert parity.plain_dtype("--model-dtype", "auto", "float32") == "float32"


def test_a_corrupt_or_mismatched_params_file_exits_2(tmp_path, capsys):
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
  err = _refused(["parity", *SMALL, "--params", str(bad)], capsys)
  assert f"--params {bad}: " in err
  # A real checkpoint of another model: the names/shapes that do not match are listed.
  from flax import nnx

  from jaxrl_kernels.nn import checkpoint
  from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig
  other = tmp_path / "other.safetensors"
  checkpoint.save_params(TinyCausalLM(TinyLMConfig.preset("test", vocab_size=32),
                                      rngs=nnx.Rngs(0)), str(other))
  err = _refused(["parity", *SMALL, "--params", str(other)], capsys)
  assert f"--params {other}: load_params: " in err and "does not match the model" in err


def test_a_corrupt_hf_folder_exits_2(tmp_path, capsys):
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text("{not json")
  err = _refused(["parity", "--model", f"hf:{folder}"], capsys)
  assert f"--model hf:{folder}: " in err
  (folder / "config.json").write_text("[1, 2]")
  assert f"--model hf:{folder}: " in _refused(["parity", "--model", f"hf:{folder}"], capsys)


# A one-layer Qwen2 small enough for the CPU, saved as a Hugging Face folder in bfloat16.
# (V = 1000, H = 128: large enough that a temperature applied two ways differs in bf16.)
TINY_DECODER = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=128, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
  from jaxrl_kernels import models
  path = tmp_path_factory.mktemp("parity_hf") / "qwen2-tiny-bf16"
  models.save_pretrained(models.preset("qwen2.5-0.5b", 5, "bfloat16", **TINY_DECODER), path)
  return path


@pytest.mark.slow  # a subprocess of about 75 s
def test_hf_bf16_at_temperature_0_7_checks_the_unsharded_sampler_too(bf16_folder):
  """bf16 at a temperature that is not a power of two, with the user's default XLA flags
  (a subprocess: the suite's own flags turn FMA contraction off): the sampler on the plain
  DecoderLM (nn.sample unsharded) and the one on the model sharded TP = 1 both give the
  trainers' bits, and the command reports both."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  r = subprocess.run([sys.executable, "-m", "jaxrl_kernels", "parity", "--model",
                      f"hf:{bf16_folder}", "--model-dtype", "bfloat16", "--temperature", "0.7",
                      "--batch", "8", "--prompt-len", "8", "--new-tokens", "16"],
                     env=env, capture_output=True, text=True, timeout=300)
  rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  jaxrl_kernels")]
  assert [row[1] for row in rows] == ["TP=1", "TP=1", "unsharded", "unsharded"], r.stdout
  assert all("yes" in row for row in rows), r.stdout
  assert "temperature 0.7" in r.stdout and r.returncode == 0, r.stderr


def test_a_corrupt_checkpoint_in_an_hf_folder_exits_2(bf16_folder, tmp_path, capsys):
  import shutil
  folder = tmp_path / "truncated"
  shutil.copytree(bf16_folder, folder)
  weights = sorted(folder.glob("*.safetensors"))[0]
  weights.write_bytes(weights.read_bytes()[:200])
  err = _refused(["parity", "--model", f"hf:{folder}", "--model-dtype", "bf16"], capsys)
  assert f"--model hf:{folder} --model-dtype bf16: " in err


@pytest.mark.slow  # the library claim runs in CI: tests/models/test_moe_parallel.py
def test_a_moe_folder_is_bitwise_on_policy_sampled_tp2_scored_fsdp2(tmp_path, capsys):
  """A tiny qwen3_moe folder through the sharded check: experts split over TP = 2 in the
  sampler, gathered under FSDP = 2 in the trainer; every sampled token bitwise."""
  from flax import nnx

  from jaxrl_kernels import models
  cfg = models.DecoderConfig(model_type="qwen3_moe", vocab_size=1000, hidden_size=64,
                             intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=8, head_dim=16, qk_norm=True, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32)
  models.save_pretrained(models.DecoderLM(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "moe"))
  argv = [*SHARDED, "--model", f"hf:{tmp_path / 'moe'}", "--rollout-tp", "2", "--train-fsdp",
          "2"]
  assert main(argv) == 0
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.startswith("  jaxrl_kernels")]
  assert len(rows) == 4 and all("yes" in r for r in rows)
  assert "is bitwise on-policy, every sampled token" in out


@pytest.mark.parametrize("argv, message", [
    (["--layers", "2"], "--layers sets the depth of a models preset"),
    (["--model", "qwen3-30b-a3b", "--layers", "1", "--rollout-tp", "3"],
     "--rollout-tp 3 must divide the model's 128 experts"),
])
def test_layers_and_expert_split_are_checked_before_any_work(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    main(["parity", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
