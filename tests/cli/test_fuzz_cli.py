"""Property-based fuzz over the command line: a bad argument or a bad input file always exits
with status 2 and one line on stderr naming the flag, never a traceback, before any work.

Draws, per command (``parity``, ``kernels``, ``grpo-demo``), one flag and a bad value for it
(numbers out of range, non-finite, non-numeric text, unknown choices), missing files, and
corrupt files written to ``tmp_path`` (random bytes, a safetensors header that lies, a
``config.json`` that is not an object or not JSON). Runs ``main(argv)`` in-process. Bounded
for CI (``derandomize=True``, a few dozen examples); the module prints its counts at teardown
(``pytest -s``): cases tried, exits 2 with the flag named.
"""

from __future__ import annotations

import collections
import json
import struct

import pytest
from helpers import fuzz
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_kernels.cli import main

COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _counts():
  yield
  print(f"\nfuzz_cli: {COUNTS['cases']} cases tried, {COUNTS['named']} exits 2 naming the "
        f"flag, {COUNTS['tracebacks']} tracebacks")


def _assert_refused(argv: list[str], flag: str, capsys) -> None:
  COUNTS["cases"] += 1
  capsys.readouterr()
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  out, err = capsys.readouterr()
  if "Traceback" in err:
    COUNTS["tracebacks"] += 1
  assert rc == 2, (argv, rc, out[-500:], err[-500:])
  assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
  assert err.startswith("jaxrl-kernels") and flag in err, (argv, err)
  COUNTS["named"] += 1


_NOT_A_NUMBER = st.sampled_from(["", "x", "1.5.2", "0x", "--", "one", "1e", "ｎａｎ"])
_BAD_POSITIVE_INT = st.one_of(st.integers(-10**6, 0).map(str), _NOT_A_NUMBER,
                              st.sampled_from(["1.5", "nan", "inf"]))
_BAD_SEED = st.one_of(st.integers(-10**20, -1).map(str), st.integers(2**32, 2**70).map(str),
                      _NOT_A_NUMBER, st.sampled_from(["1.0", "nan"]))
_BAD_TEMPERATURE = st.one_of(
    st.sampled_from(["0", "-0", "-1", "nan", "-nan", "inf", "-inf", "1e-42", "1e39", "1e400"]),
    st.floats(max_value=0.0).map(repr), st.floats(min_value=1e-300, max_value=1e-39).map(repr),
    _NOT_A_NUMBER)
_UNKNOWN_CHOICE = st.sampled_from(["float64", "int8", "BF16", "half", "f32", "", "cuda", "tpu"])


@fuzz(60)
@given(data=st.data())
def test_parity_bad_values_exit_2(data, capsys):
  flag, value = data.draw(st.one_of(
      st.tuples(st.just("--temperature"), _BAD_TEMPERATURE),
      st.tuples(st.just("--seed"), _BAD_SEED),
      st.tuples(st.sampled_from(["--rollout-tp", "--train-fsdp"]), _BAD_POSITIVE_INT),
      st.tuples(st.sampled_from(["--batch", "--prompt-len", "--new-tokens", "--tp"]),
                st.one_of(st.integers(-10**6, 0).map(str), _NOT_A_NUMBER)),
      st.tuples(st.sampled_from(["--model-dtype", "--dtype", "--implementation", "--device"]),
                _UNKNOWN_CHOICE),
      st.tuples(st.just("--model"), st.sampled_from(["gpt2", "hf:", "llama", "TINY", ""])),
      st.tuples(st.just("--model-fn"), st.sampled_from(["x", "a:b:c", ":f", "m:", ""])),
  ))
  command = data.draw(st.sampled_from(["parity", "kernels"])) if flag in (
      "--dtype", "--implementation", "--device") else "parity"
  _assert_refused([command, "--model", "test", f"{flag}={value}"], flag, capsys)


@fuzz(40)
@given(data=st.data())
def test_grpo_demo_bad_values_exit_2(data, capsys):
  flag, value = data.draw(st.one_of(
      st.tuples(st.sampled_from(["--steps", "--prompts-per-step", "--group-size",
                                 "--micro-batch-groups", "--layers"]), _BAD_POSITIVE_INT),
      st.tuples(st.just("--docs-per-step"),
                st.one_of(st.integers(-10**6, -1).map(str), _NOT_A_NUMBER)),
      st.tuples(st.just("--new-tokens"), st.integers(-10, 2).map(str)),
      st.tuples(st.just("--lr"), st.sampled_from(["0", "-1e-3", "nan", "inf", "lr"])),
      st.tuples(st.just("--temperature"), _BAD_TEMPERATURE),
      st.tuples(st.just("--seed"), _BAD_SEED),
      st.tuples(st.sampled_from(["--model-dtype", "--implementation"]), _UNKNOWN_CHOICE),
      st.tuples(st.just("--model"), st.sampled_from(["gpt2", "hf:/no/such/dir", "llama"])),
  ))
  _assert_refused(["grpo-demo", "--no-plot", "--out", "/nonexistent-dir-is-not-made",
                   f"{flag}={value}"], flag, capsys)


@st.composite
def corrupt_safetensors(draw) -> bytes:
  kind = draw(st.sampled_from(["random", "short", "lying_header", "bad_json", "list_header",
                               "bad_offsets"]))
  if kind == "random":
    return draw(st.binary(max_size=64))
  if kind == "short":
    return draw(st.binary(max_size=7))

  def with_header(text: str, payload: bytes = b"") -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + payload

  if kind == "lying_header":
    return struct.pack("<Q", draw(st.integers(9, 2**63 - 1))) + b"{}"
  if kind == "bad_json":
    return with_header(draw(st.sampled_from(["{", "not json", "{'a': 1}", "\x00\x01"])))
  if kind == "list_header":
    return with_header(json.dumps(draw(st.sampled_from([[], [1, 2], "s", 3, None]))))
  name = draw(st.sampled_from(["embed.embedding", "x"]))
  return with_header(json.dumps({name: {"dtype": draw(st.sampled_from(["F32", "Q9"])),
                                        "shape": [4, 4],
                                        "data_offsets": [0, draw(st.integers(0, 100))]}}),
                     draw(st.binary(max_size=16)))


@fuzz(25)
@given(data=st.data())
def test_corrupt_params_files_exit_2(data, tmp_path_factory, capsys):
  path = tmp_path_factory.mktemp("params") / "p.safetensors"
  missing = data.draw(st.booleans())
  if not missing:
    path.write_bytes(data.draw(corrupt_safetensors()))
  _assert_refused(["parity", "--model", "test", "--batch", "2", "--prompt-len", "2",
                   "--new-tokens", "2", "--params", str(path)], "--params", capsys)


_BAD_CONFIG = st.one_of(
    st.sampled_from(["", "{", "not json", "{'model_type': 'llama'}", "null", "[]", "[1, 2]",
                     "3", '"qwen2"']),
    st.just(json.dumps({"model_type": "gpt9"})),
    st.builds(lambda t: json.dumps({"model_type": "llama", "hidden_size": t}),
              st.sampled_from([None, "64", -1, 0, [64]])),
)


@fuzz(20)
@given(config=_BAD_CONFIG, command=st.sampled_from(["parity", "grpo-demo"]))
def test_corrupt_hf_folders_exit_2(config, command, tmp_path_factory, capsys):
  folder = tmp_path_factory.mktemp("hf")
  (folder / "config.json").write_text(config)
  extra = ["--no-plot", "--out", str(folder / "out")] if command == "grpo-demo" else []
  _assert_refused([command, "--model", f"hf:{folder}", *extra], "--model", capsys)
