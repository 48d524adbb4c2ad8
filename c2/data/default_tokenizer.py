"""The embedded default tokenizer: a byte-level BPE trained on the stdlib source, cached on disk.

Training takes a few seconds (a bounded, deterministic subset of the train split), so every run can
build it; it is cached in the workdir because the stdlib differs between Python versions and a
resumed run must keep its vocabulary.

Layout mirrors Kimi's: BPE ids first (256 byte symbols, then merges in training order), then Kimi's
*named* special tokens in Kimi's order, so `vocab_size` = merges + 256 + 23 specials. The
pre-tokenizer is Kimi's regex followed by the GPT-2 byte-to-unicode mapping, which makes the
vocabulary exportable to a tiktoken ranks file with identical ids (see `to_tiktoken_ranks`).
"""
from __future__ import annotations

import os
import uuid

from etils import epath
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from c2.data import kimi_vocab
from c2.data import stdlib_corpus

DEFAULT_VOCAB_SIZE = 4096
# ~6 MB of source trains a 4k vocabulary in a few seconds on 2 cores; more data changes the
# merges little at this vocabulary size.
DEFAULT_MAX_TRAIN_BYTES = 6_000_000
CACHE_FILENAME = "tokenizer.json"


def _untrained_tokenizer() -> tokenizers.Tokenizer:
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(kimi_vocab.KIMI_PRETOKENIZER_PATTERN), "isolated"),
      # The regex already split the text, so ByteLevel only maps bytes to printable symbols.
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def train_stdlib_bpe(vocab_size: int = DEFAULT_VOCAB_SIZE,
                     max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES) -> tokenizers.Tokenizer:
  """Trains the default tokenizer; deterministic for a given Python stdlib.

  Args:
    vocab_size: total ids, special tokens included (may come out smaller if the corpus runs out of
      pairs seen at least twice).
    max_train_bytes: size of the training subset of the stdlib train split.
  """
  specials = kimi_vocab.DEFAULT_TOKENIZER_SPECIAL_TOKENS
  num_bpe = vocab_size - len(specials)
  if num_bpe <= 256:
    raise ValueError(f"vocab_size {vocab_size} leaves no room for merges after 256 byte symbols "
                     f"and {len(specials)} special tokens")
  tokenizer = _untrained_tokenizer()
  trainer = trainers.BpeTrainer(vocab_size=num_bpe, min_frequency=2, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=[])
  tokenizer.train_from_iterator(stdlib_corpus.training_subset(max_train_bytes), trainer=trainer)
  # Added after training so that they take the ids right after the BPE vocabulary, as in Kimi.
  tokenizer.add_special_tokens([tokenizers.AddedToken(name, special=True, normalized=False)
                                for name in specials])
  # An exact size keeps the cache check in `ensure_default_tokenizer` meaningful.
  if tokenizer.get_vocab_size() != vocab_size:
    raise ValueError(f"{max_train_bytes} bytes of stdlib only support {tokenizer.get_vocab_size()} "
                     f"ids, not {vocab_size}: raise max_train_bytes")
  return tokenizer


def ensure_default_tokenizer(cache_dir: str | epath.PathLike, *,
                             vocab_size: int = DEFAULT_VOCAB_SIZE,
                             max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES) -> epath.Path:
  """Path of `cache_dir/tokenizer.json`, training and writing it first if it is missing.

  Every host may call this: training is deterministic, so hosts that race produce the same file,
  and the write goes through a temporary name so a reader never sees a partial file.
  """
  path = epath.Path(cache_dir) / CACHE_FILENAME
  if path.exists():
    cached_size = tokenizers.Tokenizer.from_str(path.read_text()).get_vocab_size()
    if cached_size != vocab_size:
      raise ValueError(f"{path} holds a {cached_size}-id tokenizer but vocab_size={vocab_size} was "
                       "requested; delete it or use another cache_dir")
    return path
  tokenizer = train_stdlib_bpe(vocab_size, max_train_bytes)
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.parent / f".{CACHE_FILENAME}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
  temporary.write_text(tokenizer.to_str())
  temporary.rename(path)
  return path


def _byte_level_symbol_to_byte() -> dict[str, int]:
  """Inverse of GPT-2's byte -> printable-unicode table used by the ByteLevel pre-tokenizer."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  symbols = {b: chr(b) for b in printable}
  shifted = 0
  for b in range(256):
    if b not in symbols:
      symbols[b] = chr(256 + shifted)
      shifted += 1
  return {symbol: b for b, symbol in symbols.items()}


def to_tiktoken_ranks(tokenizer: tokenizers.Tokenizer) -> dict[bytes, int]:
  """The BPE part of a byte-level tokenizer as tiktoken ranks (bytes -> id), specials excluded.

  Used to cross-check the tiktoken path against the HF path on one vocabulary, and to hand the
  default vocabulary to tools that read Kimi's format.
  """
  to_byte = _byte_level_symbol_to_byte()
  return {bytes(to_byte[ch] for ch in token): token_id
          for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items()}
