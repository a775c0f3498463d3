"""jaxrl_kernels.text: a tokenizer folder read with `tokenizers`, its chat template rendered
as `transformers` renders it, and generate_text whose log-probs are the trainer's bits."""

import ast
import json
import pathlib
import shutil
import sys
import tomllib

import jax
import jinja2
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers.models import BPE, WordLevel

from jaxrl_kernels import text
from jaxrl_kernels.nn.sampler import score
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CORPUS = ["You are a helpful assistant.", "Hello, how are you? I am fine.",
          "The answer is 42.", "héllo wörld <tag> & \"quotes\""] * 4

# Qwen's ChatML template without whitespace control: its output is right only with
# trim_blocks (the newline after a block tag goes) and lstrip_blocks (the indent before one).
CHATML = (
    "{% for message in messages %}\n"
    "  {% if loop.first and message['role'] != 'system' %}\n"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "  {% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n")


def _backend() -> HFTokenizer:
  tok = HFTokenizer(BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  return tok


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  _backend().save(str(path))
  return path


def _folder(tmp_path, tokenizer_json, *, template=CHATML, gen_eos=None, name="folder",
            **config):
  d = tmp_path / name
  d.mkdir()
  shutil.copy(tokenizer_json, d / "tokenizer.json")
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
         "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                       "normalized": False, "rstrip": False, "single_word": False,
                       "special": True},
         "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
         "clean_up_tokenization_spaces": False, **config}
  if template is not None:
    cfg["chat_template"] = template
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  if gen_eos is not None:
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
  return d


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer_json):
  return _folder(tmp_path_factory.mktemp("f"), tokenizer_json, gen_eos=[2, 0])


@pytest.fixture(scope="module")
def tok(folder):
  return text.Tokenizer.from_pretrained(folder)


STRINGS = ["Hello, how are you?", "héllo wörld", " The answer is 42.\n\nnew line",
           "<|im_start|>user\nhi<|im_end|>\n", "unseen wörds: ℏ 🙂"]


def test_encode_decode_round_trip(tok):
  assert tok.vocab_size == 300
  assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.eos_ids) == (2, 0, None, (0, 2))
  for s in STRINGS:
    ids = tok.encode(s)
    assert all(0 <= i < 300 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == s
  ids = tok.encode(STRINGS[3])
  assert ids[0] == 1 and 2 in ids  # special tokens are one id each
  assert tok.decode(ids) == "user\nhi\n"  # and left out by default


def test_add_bos_token(tmp_path, tokenizer_json):
  t = text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, bos_token="<|im_start|>",
                                             add_bos_token=True))
  assert t.encode("Hello")[0] == 1 and t.encode("Hello", add_special_tokens=False)[0] != 1
  assert t.encode("Hello")[1:] == t.encode("Hello", add_special_tokens=False)


def test_clean_up_tokenization_spaces(tmp_path, tokenizer_json):
  """The clean-up joins punctuation for a word-level model and leaves a BPE model's text as
  it is (there it would delete spaces the text has)."""
  wl = HFTokenizer(WordLevel({w: i for i, w in enumerate(
      ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Hello", ",", "I", "'m", "fine", "."])},
      unk_token="<|endoftext|>"))
  wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  wl_json = tmp_path / "wl.json"
  wl.save(str(wl_json))
  s = "Hello , I 'm fine ."
  for path, name, want in ((wl_json, "wl", "Hello, I'm fine."), (tokenizer_json, "bpe", s)):
    t = text.Tokenizer.from_pretrained(_folder(tmp_path, path, name=name,
                                               clean_up_tokenization_spaces=True))
    assert t.decode(t.encode(s)) == want, name
  plain = text.Tokenizer.from_pretrained(_folder(tmp_path, wl_json, name="off"))
  assert plain.decode(plain.encode(s)) == s


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello, how are you?"},
            {"role": "assistant", "content": "I am fine."},
            {"role": "user", "content": "The answer?"}]


def test_chat_template_renders_chatml(tok):
  want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
          "<|im_start|>user\nHello, how are you?<|im_end|>\n"
          "<|im_start|>assistant\nI am fine.<|im_end|>\n"
          "<|im_start|>user\nThe answer?<|im_end|>\n")
  assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == want
  assert tok.apply_chat_template(MESSAGES) == want + "<|im_start|>assistant\n"
  # Without a system message the template writes its default one.
  assert tok.apply_chat_template(MESSAGES[1:2]) == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n")
  ids = tok.apply_chat_template(MESSAGES, tokenize=True)
  assert ids == tok.encode(want + "<|im_start|>assistant\n", add_special_tokens=False)
  # The stock jinja2 environment (no trim_blocks / lstrip_blocks) renders another string.
  assert jinja2.Template(CHATML).render(messages=MESSAGES, add_generation_prompt=True) != (
      want + "<|im_start|>assistant\n")


def test_template_environment(tmp_path, tokenizer_json):
  tpl = ("{% for m in messages %}{% if m['role'] == 'bad' %}"
         "{{ raise_exception('role ' + m['role'] + ' is not allowed') }}{% endif %}"
         "{{ m['content'] | tojson }}|{{ m | tojson(indent=2) }}|"
         "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
         "{{ eos_token }}{{ bos_token }}{{ tools is none }}{{ strftime_now('%Y') | length }}")
  t = text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, template=tpl))
  m = {"role": "user", "content": "<é> & \"q\""}
  got = t.apply_chat_template([m, m, m])
  one = json.dumps(m["content"], ensure_ascii=False) + "|" + json.dumps(
      m, ensure_ascii=False, indent=2) + "|"
  assert got == one * 2 + "<|im_end|>True4"  # loop break after two; bos_token undefined: ""
  with pytest.raises(jinja2.exceptions.TemplateError, match="role bad is not allowed"):
    t.apply_chat_template([{"role": "bad", "content": "x"}])
  # The sandbox refuses attribute access to Python internals.
  bad = text.Tokenizer.from_pretrained(_folder(
      tmp_path, tokenizer_json, name="sandbox",
      template="{{ messages.__class__.__mro__[1].__subclasses__() }}"))
  with pytest.raises(jinja2.exceptions.SecurityError):
    bad.apply_chat_template([m])


def test_batch(tok):
  prompts = ["Hello", "The answer is 42.", "héllo"]
  ids, lengths = tok.batch(prompts)
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  want = [tok.encode(p) for p in prompts]
  np.testing.assert_array_equal(lengths, [len(w) for w in want])
  assert ids.shape == (3, max(len(w) for w in want))
  for r, w in enumerate(want):
    assert ids[r, :len(w)].tolist() == w and np.all(ids[r, len(w):] == tok.pad_id)
  ids, lengths = tok.batch([MESSAGES, MESSAGES[1:2]])
  assert ids[0, :lengths[0]].tolist() == tok.apply_chat_template(MESSAGES, tokenize=True)


def test_errors_name_argument_and_file(tmp_path, tokenizer_json, tok):
  with pytest.raises(ValueError, match=f"{tmp_path}/tokenizer.json is missing"):
    text.Tokenizer.from_pretrained(tmp_path)
  plain = text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, template=None))
  with pytest.raises(ValueError, match="tokenizer_config.json has no chat_template"):
    plain.batch([MESSAGES])
  assert plain.batch(["Hello"])[1].tolist() == [len(plain.encode("Hello"))]
  with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with 'role' and "
                                       r"'content', got \['role', 'text'\]"):
    tok.apply_chat_template([MESSAGES[0], {"role": "user", "text": "hi"}])
  with pytest.raises(ValueError, match=r"batch: prompts\[1\]: messages\[0\] must be a dict "
                                       r"with 'role' and 'content', got \['content'\]"):
    tok.batch(["Hi", [{"content": "x"}]])
  with pytest.raises(ValueError, match=r"prompts\[0\] must be a str or a list of message dicts"):
    tok.batch([3])
  with pytest.raises(ValueError, match=r"prompts\[1\] has \d+ tokens, more than max_length=3"):
    tok.batch(["Hi", "The answer is 42."], max_length=3)
  with pytest.raises(ValueError, match=r"prompts\[0\] encodes to no tokens"):
    tok.batch([""])
  with pytest.raises(ValueError, match="eos_token '<nope>', which is not in"):
    text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, name="e", eos_token="<nope>"))
  with pytest.raises(ValueError, match="generation_config.json has eos_token_id"):
    text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, name="g", gen_eos="x"))
  with pytest.raises(ValueError, match=r"decode: ids must lie in \[0, 300\), got 300"):
    tok.decode([5, 300])


def test_optional_packages_named_in_import_error(monkeypatch, folder):
  monkeypatch.setitem(sys.modules, "jinja2", None)
  t = text.Tokenizer.from_pretrained(folder)  # jinja2 is imported when a template renders
  with pytest.raises(ImportError, match=r"'jinja2' package \(pip install jaxrl_kernels\[text\]"):
    t.apply_chat_template(MESSAGES)
  monkeypatch.setitem(sys.modules, "tokenizers", None)
  with pytest.raises(ImportError, match=r"'tokenizers' package \(pip install "
                                        r"jaxrl_kernels\[text\]\)"):
    text.Tokenizer.from_pretrained(folder)


def test_no_library_module_imports_text():
  """jaxrl_kernels.text sits above the library: nothing else in the package imports it."""
  root = pathlib.Path(text.__file__).parent
  for path in root.rglob("*.py"):
    if path.name == "text.py" and path.parent == root:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module}.{a.name}" for a in node.names]
               if isinstance(node, ast.ImportFrom) and node.module else [])
      assert not any(n.startswith("jaxrl_kernels.text") for n in names), path


def test_text_extra_in_pyproject():
  """`pip install jaxrl_kernels[text]` brings both packages; CI's `.[test]` does too."""
  with open(pathlib.Path(text.__file__).parent.parent / "pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  assert extras["text"] == ["tokenizers", "jinja2"]
  assert {"tokenizers", "jinja2"} <= set(extras["test"])


# ------------------------------------------------------------------------ generate_text


@pytest.fixture(scope="module")
def lm():
  return TinyCausalLM(TinyLMConfig.preset("test", vocab_size=300), rngs=nnx.Rngs(0))


PROMPTS = ["Hello, how are you?", [{"role": "user", "content": "The answer?"}], "héllo"]


def _scored(lm, tok, outs, prompts, g, temperature):
  """score() of each completion's sequence (its prompt's ids, then its token ids)."""
  ids, lengths = tok.batch(prompts)
  seqs = [ids[i // g, :lengths[i // g]].tolist() + c.token_ids for i, c in enumerate(outs)]
  t = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), t), np.int32)
  mask = np.zeros((len(seqs), t), bool)
  for r, s in enumerate(seqs):
    tokens[r, :len(s)] = s
    mask[r, lengths[r // g]:len(s)] = True
  got = np.asarray(score(lm, tokens, mask, temperature=temperature))
  return [got[r][mask[r]] for r in range(len(seqs))]


# One set of sampling arguments for the tests below: one compiled sampler between them.
GEN = dict(max_new_tokens=8, key=jax.random.key(3), temperature=0.9, num_samples=2)


def test_generate_text_logp_is_score_bitwise(lm, tok):
  g = GEN["num_samples"]
  outs = text.generate_text(lm, tok, PROMPTS, **GEN)
  assert len(outs) == len(PROMPTS) * g
  assert [o.prompt for o in outs] == [p for p in PROMPTS for _ in range(g)]
  assert outs[0].token_ids != outs[1].token_ids  # a group's samples differ
  for o, want in zip(outs, _scored(lm, tok, outs, PROMPTS, g, 0.9), strict=True):
    assert o.logp.dtype == np.float32 and len(o.logp) == len(o.token_ids) >= 1
    assert np.all(o.logp < 0)
    assert_bitwise_equal(o.logp, want, "generate_text vs score")
    assert o.text == tok.decode(o.token_ids)
    stopped = o.token_ids[-1] in tok.eos_ids
    assert o.finish_reason == ("stop" if stopped else "length")
    assert stopped or len(o.token_ids) == 8


def test_generate_text_stops_at_eos(lm, tmp_path, tokenizer_json, tok):
  """An eos id from generation_config.json ends the completion: finish_reason 'stop'."""
  first = text.generate_text(lm, tok, PROMPTS, **GEN)[0]
  assert first.finish_reason == "length"
  eos = first.token_ids[2]
  t = text.Tokenizer.from_pretrained(_folder(tmp_path, tokenizer_json, gen_eos=eos))
  assert t.eos_ids == tuple(sorted({2, eos}))
  out = text.generate_text(lm, t, PROMPTS, **GEN)[0]
  k = first.token_ids.index(eos) + 1
  assert out.token_ids == first.token_ids[:k] and out.finish_reason == "stop"
  assert_bitwise_equal(out.logp, first.logp[:k], "the same tokens, the same bits")


def test_stop_strings_cut_text_and_tokens(lm, tok):
  kw = GEN
  full = text.generate_text(lm, tok, PROMPTS, **kw)
  # Stop strings from the sampled texts: one that begins inside a token of several characters
  # (that token straddles the cut), one from the middle of the first text, one never found.
  straddle = next(
      f.text[c + 1:c + 3] for f in full for j, t in enumerate(f.token_ids)
      if len(piece := tok.decode([t])) >= 2 and piece.isascii()
      and f.text[(c := len(tok.decode(f.token_ids[:j]))):c + len(piece)] == piece)
  stops = ("\x00never", full[0].text[3:5], straddle)
  outs = text.generate_text(lm, tok, PROMPTS, stop_strings=stops, **kw)
  straddled = 0
  for f, o in zip(full, outs, strict=True):
    hits = [i for i in (f.text.find(s) for s in stops) if i >= 0]
    if not hits:
      assert (o.text, o.token_ids, o.finish_reason) == (f.text, f.token_ids, f.finish_reason)
      assert_bitwise_equal(o.logp, f.logp, "no stop string: all kept")
      continue
    cut = min(hits)
    assert o.text == f.text[:cut] and o.finish_reason == "stop"
    k = len(o.token_ids)
    # The rule: the longest prefix of tokens whose decoded text ends at or before the cut.
    assert o.token_ids == f.token_ids[:k]
    assert all(len(tok.decode(f.token_ids[:j])) <= cut for j in range(k + 1))
    assert len(tok.decode(f.token_ids[:k + 1])) > cut
    assert_bitwise_equal(o.logp, f.logp[:k], "kept log-probs")
    straddled += len(tok.decode(o.token_ids)) < cut
  assert outs[0].finish_reason == "stop" and straddled >= 1
  with pytest.raises(ValueError, match="stop_strings must be a sequence of non-empty"):
    text.generate_text(lm, tok, PROMPTS, stop_strings="x", **kw)


def test_stop_strings_stop_the_sampling_loop(lm, tok, monkeypatch):
  """A stop string whose encoding is a sampled token stops its rows inside the sampling loop
  (fewer tokens decoded), and the completions are those of the post-hoc cut alone."""
  full = text.generate_text(lm, tok, PROMPTS, **GEN)
  # A sampled token that is its own string's encoding (and decodes back to it).
  s = next(p for f in full for t in f.token_ids[1:]
           if (p := tok.decode([t])) and tok.encode(p, add_special_tokens=False) == [t])
  seen = []
  original = text.nn.sample

  def spy(*a, **k):
    res = original(*a, **k)
    seen.append((k.get("stop_sequences"), np.asarray(res.completion_mask).sum(1)))
    return res

  monkeypatch.setattr(text.nn, "sample", spy)
  outs = text.generate_text(lm, tok, PROMPTS, stop_strings=(s,), **GEN)
  monkeypatch.setattr(text.nn, "sample", lambda *a, **k: spy(*a, **{**k, "stop_sequences": None}))
  cut_only = text.generate_text(lm, tok, PROMPTS, stop_strings=(s,), **GEN)
  (passed, decoded), (_, decoded_cut_only) = seen
  assert passed == [tok.encode(s, add_special_tokens=False)]
  assert decoded.sum() < decoded_cut_only.sum(), "no row stopped inside the loop"
  for o, c in zip(outs, cut_only, strict=True):
    assert (o.text, o.token_ids, o.finish_reason) == (c.text, c.token_ids, c.finish_reason)
    assert_bitwise_equal(o.logp, c.logp, "kept log-probs")


def test_a_stop_string_that_decodes_to_nothing_is_not_a_stop_sequence(lm, tok, monkeypatch):
  """A special token's string (decode leaves it out) is not passed to the sampler: a row
  stopping there would have no text to cut and report 'length'."""
  special = next(t for t in (tok.decode([i], skip_special_tokens=False) for i in range(4))
                 if t and tok.decode(tok.encode(t, add_special_tokens=False)) == "")
  seen = []
  original = text.nn.sample
  monkeypatch.setattr(text.nn, "sample", lambda *a, **k: (
      seen.append(k.get("stop_sequences")), original(*a, **k))[1])
  text.generate_text(lm, tok, PROMPTS, stop_strings=(special,), **GEN)
  assert seen == [None]


# ------------------------------------------------------------- against transformers (GPU image)


@pytest.mark.gpu
def test_matches_transformers(tmp_path, tokenizer_json):
  import transformers
  d = _folder(tmp_path, tokenizer_json, gen_eos=[2, 0])
  ours = text.Tokenizer.from_pretrained(d)
  theirs = transformers.AutoTokenizer.from_pretrained(str(d))
  for s in STRINGS + CORPUS[:4]:
    assert ours.encode(s) == theirs(s)["input_ids"], s
    assert ours.encode(s, add_special_tokens=False) == theirs(
        s, add_special_tokens=False)["input_ids"], s
    ids = ours.encode(s)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), s
  for msgs in (MESSAGES, MESSAGES[1:2], MESSAGES[:3]):
    for gen in (True, False):
      assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == (
          theirs.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False))
  ids = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
  ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
  assert ours.apply_chat_template(MESSAGES, tokenize=True) == list(ids)
