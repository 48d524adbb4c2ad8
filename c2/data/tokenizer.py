"""One small tokenizer interface over a Hugging Face `tokenizer.json` and Kimi's tiktoken file.

Contract shared by every implementation:
  * `encode(text)` treats the text as *ordinary* text: a literal "<|im_end|>" typed by a user is
    encoded as characters, never as the special token. Special tokens enter a sequence only by id
    (the chat template in c2/data/chat.py inserts them), which keeps training data injection-safe.
  * `decode(ids)` renders special tokens by name, so a rendered chat decodes to the template text.
  * Special tokens are looked up by Kimi's names (c2/data/kimi_vocab.py); `bos_id`, `eos_id` and
    `pad_id` are shortcuts for `[BOS]`, `[EOS]` and `[PAD]`.

Loaders: `load_tokenizer("default", cache_dir=...)` (the stdlib BPE, trained once and cached),
`load_tokenizer("path/to/tokenizer.json")`, `load_tokenizer("path/to/tiktoken.model")`. Paths
may be local or `gs://` (read through etils.epath).
"""
from __future__ import annotations

import abc
import base64
import re
from typing import Mapping, Sequence

from etils import epath
import tiktoken
import tokenizers

from c2.data import kimi_vocab


class Tokenizer(abc.ABC):
  """Text <-> token ids, plus Kimi-named special tokens."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids (BPE ranks plus special tokens); every id is < vocab_size."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Ordinary-text encoding; special-token strings inside `text` are not recognised."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Inverse of encode; special ids are rendered as their names."""

  @abc.abstractmethod
  def _lookup_special(self, name: str) -> int | None:
    """Id of a special token by name, or None if this vocabulary lacks it."""

  def special_id(self, name: str) -> int:
    token_id = self._lookup_special(name)
    if token_id is None:
      raise KeyError(f"tokenizer has no special token {name!r}; the chat template and the packer "
                     f"need {kimi_vocab.REQUIRED_SPECIAL_TOKENS}")
    return token_id

  @property
  def bos_id(self) -> int:
    return self.special_id(kimi_vocab.BOS)

  @property
  def eos_id(self) -> int:
    return self.special_id(kimi_vocab.EOS)

  @property
  def pad_id(self) -> int:
    return self.special_id(kimi_vocab.PAD)

  def missing_special_tokens(self) -> list[str]:
    return [n for n in kimi_vocab.REQUIRED_SPECIAL_TOKENS if self._lookup_special(n) is None]


class HuggingFaceTokenizer(Tokenizer):
  """A `tokenizers.Tokenizer` (any `tokenizer.json`), e.g. the default stdlib BPE.

  `special_token_aliases` maps Kimi names onto a foreign vocabulary's names (for example
  {"[BOS]": "<s>"}) so that LM pretraining works with a tokenizer that has no Kimi tokens.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer,
               special_token_aliases: Mapping[str, str] | None = None):
    self._tokenizer = tokenizer
    # Without this, added tokens such as "<|im_end|>" appearing in raw text would be matched
    # before the model runs, breaking the ordinary-text contract.
    self._tokenizer.encode_special_tokens = True
    self._aliases = dict(special_token_aliases or {})

  @classmethod
  def from_file(cls, path: str | epath.PathLike, **kwargs) -> HuggingFaceTokenizer:
    return cls(tokenizers.Tokenizer.from_str(epath.Path(path).read_text()), **kwargs)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tokenizer

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode(list(ids), skip_special_tokens=False)

  def _lookup_special(self, name: str) -> int | None:
    return self._tokenizer.token_to_id(self._aliases.get(name, name))


# tiktoken's Rust core panics on inputs over ~400k characters and its regex slows down sharply on
# very long runs of a single character class, so long inputs are cut first (as Kimi's own
# tokenizer class does). Cuts fall only inside such runs or at the 400k boundary, which matches
# unsplit encoding everywhere except at those rare cut points.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_TIKTOKEN_MAX_RUN, _TIKTOKEN_MAX_RUN))


def _cut_for_tiktoken(text: str) -> list[str]:
  pieces = []
  for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
    window = text[start:start + _TIKTOKEN_MAX_CHARS]
    cursor = 0
    for run in _LONG_RUN.finditer(window):
      for cut in range(run.start() + _TIKTOKEN_MAX_RUN, run.end(), _TIKTOKEN_MAX_RUN):
        pieces.append(window[cursor:cut])
        cursor = cut
    pieces.append(window[cursor:])
  return [p for p in pieces if p]


def read_tiktoken_ranks(path: str | epath.PathLike) -> dict[bytes, int]:
  """Parses a tiktoken BPE file ("<base64 token> <rank>" per line).

  Same format and result as `tiktoken.load.load_tiktoken_bpe`, but read through epath so `gs://`
  works, and without tiktoken's /tmp cache, which is keyed by path and would serve a stale copy
  when a different file later appears at the same local path.
  """
  ranks = {}
  for line in epath.Path(path).read_bytes().splitlines():
    if line:
      token, rank = line.split()
      ranks[base64.b64decode(token)] = int(rank)
  return ranks


def write_tiktoken_ranks(ranks: Mapping[bytes, int], path: str | epath.PathLike) -> None:
  lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in
           sorted(ranks.items(), key=lambda item: item[1])]
  epath.Path(path).write_bytes(b"\n".join(lines) + b"\n")


class TiktokenTokenizer(Tokenizer):
  """Kimi's tokenizer: tiktoken BPE ranks, Kimi's regex, 256 special slots after the ranks."""

  def __init__(self, mergeable_ranks: Mapping[bytes, int],
               pattern: str = kimi_vocab.KIMI_PRETOKENIZER_PATTERN, name: str = "kimi"):
    num_ranks = len(mergeable_ranks)
    if sorted(mergeable_ranks.values()) != list(range(num_ranks)):
      raise ValueError("BPE ranks must be exactly 0..len(ranks)-1, as in Kimi's tiktoken.model")
    self._special_ids = kimi_vocab.kimi_special_token_ids(num_ranks)
    self._encoding = tiktoken.Encoding(name=name, pat_str=pattern,
                                       mergeable_ranks=dict(mergeable_ranks),
                                       special_tokens=self._special_ids)

  @classmethod
  def from_file(cls, path: str | epath.PathLike, **kwargs) -> TiktokenTokenizer:
    return cls(read_tiktoken_ranks(path), **kwargs)

  @property
  def vocab_size(self) -> int:
    return self._encoding.n_vocab

  def encode(self, text: str) -> list[int]:
    ids = []
    for piece in _cut_for_tiktoken(text):
      ids.extend(self._encoding.encode_ordinary(piece))
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._encoding.decode(list(ids))

  def _lookup_special(self, name: str) -> int | None:
    return self._special_ids.get(name)


def load_tokenizer(spec: str, *, cache_dir: str | epath.PathLike | None = None,
                   default_vocab_size: int | None = None) -> Tokenizer:
  """Builds a tokenizer from a short spec.

  Args:
    spec: "default" (stdlib byte-level BPE, trained once into `cache_dir/tokenizer.json`), a
      path to a Hugging Face `tokenizer.json`, or a path to a tiktoken BPE file (`tiktoken.model`,
      `*.tiktoken`, or any path prefixed with "tiktoken:").
    cache_dir: where the default tokenizer is cached (normally the workdir). Required for
      "default".
    default_vocab_size: vocabulary size of the default tokenizer (None: its default, 4096).
  """
  if spec == "default":
    if cache_dir is None:
      raise ValueError("the default tokenizer needs a cache_dir (normally the workdir)")
    # Imported here because training pulls in the stdlib corpus, which other loaders never need.
    from c2.data import default_tokenizer
    kwargs = {} if default_vocab_size is None else {"vocab_size": default_vocab_size}
    return HuggingFaceTokenizer.from_file(default_tokenizer.ensure_default_tokenizer(cache_dir,
                                                                                     **kwargs))
  if spec.startswith("tiktoken:"):
    return TiktokenTokenizer.from_file(spec.removeprefix("tiktoken:"))
  if spec.endswith((".model", ".tiktoken")):
    return TiktokenTokenizer.from_file(spec)
  if spec.endswith(".json"):
    return HuggingFaceTokenizer.from_file(spec)
  raise ValueError(f"cannot tell the tokenizer kind of {spec!r}: expected 'default', a "
                   "tokenizer.json, a tiktoken.model/*.tiktoken or 'tiktoken:<path>'")
