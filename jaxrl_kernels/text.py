"""Text in, text out for a local Hugging Face folder: a tokenizer, its chat template, and
:func:`generate_text` over :func:`jaxrl_kernels.nn.sample`.

:class:`Tokenizer` reads ``tokenizer.json`` (with the ``tokenizers`` package),
``tokenizer_config.json`` (special tokens, ``chat_template``, ``add_bos_token``) and, where
present, ``chat_template.jinja`` and ``generation_config.json`` (its eos ids). Chat templates
render with ``jinja2`` the way ``transformers`` renders them: a sandboxed immutable
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII characters and takes ``indent``, and the globals
``raise_exception`` and ``strftime_now``.

This module sits above the library: it imports :mod:`jaxrl_kernels.nn`, and no other module
of the package imports it. ``tokenizers`` and ``jinja2`` are imported when first needed
(``pip install jaxrl_kernels[text]``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_kernels import nn

_EXTRA = "pip install jaxrl_kernels[text]"


def _import_tokenizers():
  try:
    import tokenizers
  except ImportError as e:
    raise ImportError(f"jaxrl_kernels.text needs the 'tokenizers' package ({_EXTRA})") from e
  return tokenizers


def _import_jinja2():
  try:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
  except ImportError as e:
    raise ImportError(f"jaxrl_kernels.text needs the 'jinja2' package ({_EXTRA})") from e
  return jinja2


def _read_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"Tokenizer: {path} is not valid JSON ({e})") from e


def _token_str(value: Any, name: str, path: str) -> str | None:
  """A special token of tokenizer_config.json: a string, an AddedToken dict, or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"Tokenizer: {path} has {name} = {value!r}; expected a string, an "
                   f"AddedToken dict with 'content', or null")


def _compile_template(source: str):
  """The chat template compiled in the environment ``transformers`` renders templates in."""
  jinja2 = _import_jinja2()

  class _Generation(jinja2.ext.Extension):
    # ``{% generation %} ... {% endgeneration %}`` marks assistant text for masks; rendering
    # it gives its body unchanged.
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.Scope(body, lineno=lineno)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters ('<' as \u003c); templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


def _clean_up_spaces(text: str) -> str:
  """``transformers``' ``clean_up_tokenization``: no space before punctuation and
  contractions."""
  for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
               (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
    text = text.replace(a, b)
  return text


class Tokenizer:
  """A Hugging Face fast tokenizer and chat template, read from a local folder.

  Attributes:
    folder: the folder it was read from.
    bos_token, eos_token, pad_token, unk_token: strings or None (tokenizer_config.json).
    bos_id, eos_id, pad_id: their ids or None.
    eos_ids: every stop id, sorted: ``eos_id`` and generation_config.json's
      ``eos_token_id`` (an int or a list).
    chat_template: the template source or None.
    add_bos_token: tokenizer_config.json's ``add_bos_token`` (False when absent).
    vocab_size: ids are in ``[0, vocab_size)`` (added tokens included).
  """

  def __init__(self, backend, config: dict, *, folder: str, chat_template: str | None,
               generation_eos: Sequence[int] = ()):
    self._tok = backend
    self.folder = folder
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    self.config = config
    tokens = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
      tokens[name] = _token_str(config.get(name), name, cfg_path)
    self.bos_token = tokens["bos_token"]
    self.eos_token = tokens["eos_token"]
    self.pad_token = tokens["pad_token"]
    self.unk_token = tokens["unk_token"]
    # One past the largest id (added tokens included): the ids need not be contiguous.
    self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    ids = {}
    for name, s in tokens.items():
      i = None if s is None else backend.token_to_id(s)
      if s is not None and i is None:
        raise ValueError(f"Tokenizer: {cfg_path} names {name} {s!r}, which is not in "
                         f"{folder}/tokenizer.json's vocabulary")
      ids[name] = i
    self.bos_id, self.eos_id, self.pad_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
    eos = set(int(i) for i in generation_eos)
    if self.eos_id is not None:
      eos.add(self.eos_id)
    self.eos_ids = tuple(sorted(eos))
    self.add_bos_token = bool(config.get("add_bos_token", False))
    # The clean-up is for WordPiece-style decoders; on a BPE model it would delete real spaces
    # before punctuation, and transformers skips it there too.
    self.clean_up_tokenization_spaces = (
        bool(config.get("clean_up_tokenization_spaces", False))
        and type(backend.model).__name__ != "BPE")
    self.chat_template = chat_template
    self._template = None

  @classmethod
  def from_pretrained(cls, folder: str | os.PathLike) -> Tokenizer:
    """Reads ``folder``'s ``tokenizer.json`` (required), ``tokenizer_config.json``,
    ``chat_template.jinja`` (which takes precedence over the config's ``chat_template``, as
    in ``transformers``) and ``generation_config.json`` (optional)."""
    tokenizers = _import_tokenizers()
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
      raise ValueError(f"Tokenizer: folder {folder} is not a directory")
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
      raise ValueError(f"Tokenizer: {folder}/tokenizer.json is missing")
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust parser's errors carry no file name
      raise ValueError(f"Tokenizer: {path} could not be read ({e})") from e
    config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    if template is not None and not isinstance(template, str):
      raise ValueError(f"Tokenizer: {folder}/tokenizer_config.json has a chat_template of "
                       f"type {type(template).__name__}; expected a string")
    gen = _read_json(os.path.join(folder, "generation_config.json")) or {}
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
      raise ValueError(f"Tokenizer: {folder}/generation_config.json has eos_token_id "
                       f"{gen.get('eos_token_id')!r}; expected an int or a list of ints")
    return cls(backend, config, folder=folder, chat_template=template, generation_eos=eos)

  # ------------------------------------------------------------------------- ids <-> text

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. ``add_special_tokens``: tokenizer.json's post-processor runs
    (e.g. Llama 3's leading ``<|begin_of_text|>``), and with ``add_bos_token`` a bos id
    leads the ids if the post-processor did not put one there (``add_bos_token`` False
    removes no bos the post-processor writes)."""
    if not isinstance(text, str):
      raise ValueError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
    ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
    if (add_special_tokens and self.add_bos_token and self.bos_id is not None
        and ids[:1] != [self.bos_id]):
      ids.insert(0, self.bos_id)
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
    """The text of ``ids`` (special tokens left out with ``skip_special_tokens``); with
    tokenizer_config.json's ``clean_up_tokenization_spaces`` and a model other than BPE,
    spaces before punctuation and contractions removed as ``transformers`` does."""
    ids = [int(i) for i in np.asarray(ids, np.int64).reshape(-1)]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"Tokenizer.decode: ids must lie in [0, {self.vocab_size}), got "
                       f"{bad[0]}")
    text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
    return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

  # -------------------------------------------------------------------------- chat template

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs) -> str | list[int]:
    """The chat template rendered over ``messages`` (dicts with 'role' and 'content').

    The template sees ``messages``, ``add_generation_prompt``, ``tools=None``, the special
    tokens that are set (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, as
    strings) and ``kwargs``. ``tokenize=True`` gives the ids of the rendered text, encoded
    without adding special tokens (the template writes them), as ``transformers`` does.
    """
    where = f"{self.folder}/tokenizer_config.json"
    if self.chat_template is None:
      raise ValueError(f"Tokenizer.apply_chat_template: {where} has no chat_template; pass "
                       f"prompts as strings instead of messages")
    _check_messages("Tokenizer.apply_chat_template", messages)
    if self._template is None:
      self._template = _compile_template(self.chat_template)
    specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                  ("pad_token", self.pad_token), ("unk_token", self.unk_token))
                if v is not None}
    env = {**specials, "tools": None, **kwargs}
    text = self._template.render(messages=[dict(m) for m in messages],
                                 add_generation_prompt=bool(add_generation_prompt), **env)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  # ------------------------------------------------------------------------------- batches

  def batch(self, prompts: Sequence[str] | Sequence[Sequence[dict]], *,
            max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a batch of prompts for :func:`jaxrl_kernels.nn.sample`.

    Args:
      prompts: strings (encoded with special tokens) or chat message lists (rendered with
        the chat template and a generation prompt, encoded without adding special tokens).
      max_length: optional limit on a prompt's tokens (a ValueError names the prompt).

    Returns:
      ``(ids [B, P] int32, lengths [B] int32)``: row ``b`` holds prompt ``b``'s tokens then
      ``pad_id`` (0 without a pad token) up to ``P``, the longest prompt's length.
    """
    if isinstance(prompts, str | dict) or not isinstance(prompts, Sequence):
      raise ValueError(f"Tokenizer.batch: prompts must be a list of strings or of message "
                       f"lists, got {type(prompts).__name__}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
      raise ValueError(f"Tokenizer.batch: max_length must be None or an int >= 1, got "
                       f"{max_length!r}")
    rows = []
    for i, p in enumerate(prompts):
      if isinstance(p, str):
        ids = self.encode(p, add_special_tokens=True)
      elif isinstance(p, Sequence) and not isinstance(p, bytes):
        _check_messages(f"Tokenizer.batch: prompts[{i}]", p)
        ids = self.encode(self.apply_chat_template(p, add_generation_prompt=True),
                          add_special_tokens=False)
      else:
        raise ValueError(f"Tokenizer.batch: prompts[{i}] must be a str or a list of message "
                         f"dicts, got {type(p).__name__}")
      if not ids:
        raise ValueError(f"Tokenizer.batch: prompts[{i}] encodes to no tokens (a prompt "
                         f"needs at least one)")
      if max_length is not None and len(ids) > max_length:
        raise ValueError(f"Tokenizer.batch: prompts[{i}] has {len(ids)} tokens, more than "
                         f"max_length={max_length}")
      rows.append(ids)
    lengths = np.array([len(r) for r in rows], np.int32)
    width = int(lengths.max()) if rows else 1
    out = np.full((len(rows), width), 0 if self.pad_id is None else self.pad_id, np.int32)
    for i, r in enumerate(rows):
      out[i, :len(r)] = r
    return out, lengths


def _check_messages(fn: str, messages) -> None:
  if isinstance(messages, str | dict) or not isinstance(messages, Sequence):
    raise ValueError(f"{fn}: messages must be a list of dicts with 'role' and 'content', got "
                     f"{type(messages).__name__}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      got = sorted(m) if isinstance(m, dict) else type(m).__name__
      raise ValueError(f"{fn}: messages[{i}] must be a dict with 'role' and 'content', got "
                       f"{got}")


# ----------------------------------------------------------------------------- generation


class Completion(NamedTuple):
  """One completion of :func:`generate_text`.

  Attributes:
    prompt: the prompt as given (a string or a message list).
    text: the completion's text (special tokens left out), cut before the first stop string.
    token_ids: the completion's kept token ids (list of int; a final eos id included).
    logp: ``[len(token_ids)]`` float32, the sampler's log-prob of each kept token (bitwise
      :func:`jaxrl_kernels.nn.score`'s for the same sequence).
    finish_reason: ``'stop'`` (an eos id was sampled, or a stop string cut the text) or
      ``'length'`` (``max_new_tokens`` reached).
  """

  prompt: str | list[dict]
  text: str
  token_ids: list[int]
  logp: np.ndarray
  finish_reason: str


def _cut(tokenizer: Tokenizer, ids: list[int], text: str,
         stop_strings: Sequence[str]) -> tuple[str, int] | None:
  """``(cut text, kept tokens)`` at the first stop string in ``text``, or None. The kept
  tokens end before the first prefix of ``ids`` that decodes past the cut (a prefix ending
  inside a multi-byte character decodes to replacement characters, so lengths of prefixes
  need not grow with the prefix)."""
  hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
  if not hits:
    return None
  cut = min(hits)
  kept = 0
  for k in range(1, len(ids) + 1):
    if len(tokenizer.decode(ids[:k])) > cut:
      break
    kept = k
  return text[:cut], kept


def generate_text(model: nn.CausalLM, tokenizer: Tokenizer,
                  prompts: Sequence[str] | Sequence[Sequence[dict]], *, max_new_tokens: int,
                  key, temperature: float = 1.0, num_samples: int = 1,
                  stop_strings: Sequence[str] = (), top_k: int | None = None,
                  top_p: float | None = None) -> list[Completion]:
  """Samples completions of text prompts with :func:`jaxrl_kernels.nn.sample` and decodes them.

  The prompts are batched with :meth:`Tokenizer.batch` (message lists through the chat
  template); ``nn.sample`` runs with ``stop_ids = tokenizer.eos_ids``, ``num_samples`` and the
  sampling arguments. Each completion is decoded with special tokens left out.

  Stop strings: each string's encoding (``tokenizer.encode(s, add_special_tokens=False)``,
  when it decodes back to a text holding the string) is a stop sequence of ``nn.sample``, so
  a row that samples exactly those tokens stops decoding there; a row that spells the
  string with other tokens runs on to an eos id or ``max_new_tokens``. Then the text is cut
  just before the first occurrence (lowest position) of any stop string (the stop string is
  not part of ``text``). The kept tokens
  are those whose decoded text ends at or before the cut: the longest prefix ``ids[:k]``
  such that no ``ids[:j]``, ``j <= k``, decodes to more characters than the cut text. A
  token whose text straddles the cut is dropped, with everything after it (``text`` keeps
  the part of its text before the cut). ``token_ids`` and ``logp`` hold the kept tokens.

  Args:
    model: a :class:`jaxrl_kernels.nn.CausalLM` whose vocabulary holds the tokenizer's ids.
    tokenizer: a :class:`Tokenizer`.
    prompts: ``B`` strings or ``B`` message lists.
    max_new_tokens, key, temperature, num_samples, top_k, top_p: as in ``nn.sample``.
    stop_strings: strings that end a completion's text.

  Returns:
    ``B * num_samples`` :class:`Completion`, prompt-major (``num_samples`` per prompt).
  """
  if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
    raise ValueError(f"generate_text: stop_strings must be a sequence of non-empty strings, "
                     f"got {stop_strings!r}")
  if isinstance(prompts, str):
    raise ValueError("generate_text: prompts must be a list of strings or of message lists, "
                     "got a str (wrap it in a list)")
  prompts = list(prompts)
  v = model.config.vocab_size
  if tokenizer.vocab_size > v:
    raise ValueError(f"generate_text: the tokenizer has {tokenizer.vocab_size} ids but the "
                     f"model's vocab_size is {v}")
  ids, lengths = tokenizer.batch(prompts)
  # Each stop string's own encoding stops its row inside the sampling loop; the text cut
  # below stays the authority (a string the model spells with other tokens is cut there).
  # An encoding whose text does not give the string back (a special token decode leaves
  # out, a normalizer) is not passed: the row would stop with nothing to cut.
  encoded = [q for s in stop_strings if (q := tokenizer.encode(s, add_special_tokens=False))
             and s in tokenizer.decode(q)]
  res = nn.sample(model, ids, lengths, max_new_tokens=max_new_tokens, key=key,
                  temperature=temperature, stop_ids=tokenizer.eos_ids, top_k=top_k,
                  top_p=top_p, num_samples=num_samples, stop_sequences=encoded or None)
  tokens, mask, logp = (np.asarray(x) for x in (res.tokens, res.completion_mask, res.logp))
  eos = set(tokenizer.eos_ids)
  out = []
  for r in range(tokens.shape[0]):
    comp = tokens[r][mask[r]].tolist()
    lp = logp[r][mask[r]]
    text = tokenizer.decode(comp)
    reason = "stop" if comp and comp[-1] in eos else "length"
    cut = _cut(tokenizer, comp, text, stop_strings) if stop_strings else None
    if cut is not None:
      text, k = cut
      comp, lp, reason = comp[:k], lp[:k], "stop"
    out.append(Completion(prompts[r // num_samples], text, comp, lp.copy(), reason))
  return out
