"""Tokenizers: round trips, Kimi special-token layout, Kimi's regex, default training and caching."""
import base64

import pytest
import tiktoken.load

from c2.data import default_tokenizer, kimi_vocab
from c2.data import tokenizer as tokenizer_lib
from c2.data.tokenizer import TiktokenTokenizer

TEXTS = [
    "def f(x):\n    return x * 2  # double\n",
    "Hello, world! It's 2024-06-01; 1234567 items.",
    "中文English混合 and emoji 🚀 café",
    "  leading spaces\tand tabs\n\n\n",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_default_tokenizer_round_trip(small_tokenizer, text):
  ids = small_tokenizer.encode(text)
  assert all(0 <= i < small_tokenizer.vocab_size for i in ids)
  assert small_tokenizer.decode(ids) == text


def test_default_tokenizer_places_kimi_specials_after_bpe(small_tokenizer):
  vocab_size = small_tokenizer.vocab_size
  assert vocab_size == 512  # tests/data/conftest.py
  names = kimi_vocab.DEFAULT_TOKENIZER_SPECIAL_TOKENS
  first = vocab_size - len(names)
  assert [small_tokenizer.special_id(n) for n in names] == list(range(first, vocab_size))
  assert small_tokenizer.missing_special_tokens() == []
  assert (small_tokenizer.bos_id, small_tokenizer.eos_id) == (first, first + 1)
  assert small_tokenizer.pad_id == vocab_size - 1


def test_special_token_text_is_encoded_as_ordinary_text(small_tokenizer):
  specials = {small_tokenizer.special_id(n) for n in kimi_vocab.REQUIRED_SPECIAL_TOKENS}
  text = "<|im_end|><|im_user|>[BOS]<think>"
  ids = small_tokenizer.encode(text)
  assert not specials.intersection(ids)
  assert small_tokenizer.decode(ids) == text
  assert small_tokenizer.decode([small_tokenizer.special_id("<|im_end|>")]) == "<|im_end|>"


def test_default_tokenizer_is_cached_not_retrained(tmp_path, monkeypatch):
  path = default_tokenizer.ensure_default_tokenizer(tmp_path, vocab_size=300,
                                                    max_train_bytes=200_000)
  assert path == tmp_path / "tokenizer.json"
  content = path.read_text()

  def fail(*args, **kwargs):
    raise AssertionError("retrained although a cached tokenizer exists")

  monkeypatch.setattr(default_tokenizer, "train_stdlib_bpe", fail)
  assert default_tokenizer.ensure_default_tokenizer(tmp_path, vocab_size=300) == path
  assert path.read_text() == content
  with pytest.raises(ValueError, match="300-id tokenizer"):
    default_tokenizer.ensure_default_tokenizer(tmp_path, vocab_size=4096)


def test_default_tokenizer_training_is_deterministic():
  first = default_tokenizer.train_stdlib_bpe(300, max_train_bytes=200_000)
  second = default_tokenizer.train_stdlib_bpe(300, max_train_bytes=200_000)
  assert first.to_str() == second.to_str()


def test_load_tokenizer_dispatches_on_spec(small_tokenizer_path, tmp_path):
  hf = tokenizer_lib.load_tokenizer(str(small_tokenizer_path))
  assert isinstance(hf, tokenizer_lib.HuggingFaceTokenizer)
  ranks_path = tmp_path / "tiktoken.model"
  tokenizer_lib.write_tiktoken_ranks({bytes([b]): b for b in range(256)}, ranks_path)
  assert isinstance(tokenizer_lib.load_tokenizer(str(ranks_path)), TiktokenTokenizer)
  assert isinstance(tokenizer_lib.load_tokenizer(f"tiktoken:{ranks_path}"), TiktokenTokenizer)
  with pytest.raises(ValueError, match="cache_dir"):
    tokenizer_lib.load_tokenizer("default")


def _write_ranks(path, tokens):
  """A ranks file as Kimi ships it: base64 token, space, rank; ranks = line order."""
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))


@pytest.fixture
def synthetic_kimi(tmp_path, monkeypatch):
  """256 byte symbols plus a few merges chosen to expose Kimi's pre-tokenizer."""
  han = "中".encode()  # 3 UTF-8 bytes
  merges = [b"12", b"123", b"1234",  # digits: the regex never lets "1234" form
            han[:2], han,  # a Han character
            b"a" + han[:1], b"a" + han[:2], b"a" + han,  # letter+Han: blocked by the Han split
            b"th", b"the", b" t", b" th", b" the"]
  path = tmp_path / "tiktoken.model"
  _write_ranks(path, [bytes([b]) for b in range(256)] + merges)
  # No tiktoken cache: it is keyed by path and pytest reuses temporary paths across sessions.
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
  return path, 256 + len(merges)


def test_tiktoken_ranks_parse_like_tiktoken(synthetic_kimi):
  path, _ = synthetic_kimi
  assert tokenizer_lib.read_tiktoken_ranks(path) == tiktoken.load.load_tiktoken_bpe(str(path))


def test_tiktoken_kimi_special_token_layout(synthetic_kimi):
  path, num_ranks = synthetic_kimi
  tok = TiktokenTokenizer.from_file(path)
  assert tok.vocab_size == num_ranks + 256
  expected = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
              "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11, "<|tool_call_end|>": 15,
              "<|im_middle|>": 17, "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255}
  for name, offset in expected.items():
    assert tok.special_id(name) == num_ranks + offset
    assert tok.decode([num_ranks + offset]) == name
  unnamed = num_ranks + 5
  assert tok.special_id(f"<|reserved_token_{unnamed}|>") == unnamed
  assert tok.missing_special_tokens() == []


def test_tiktoken_uses_kimi_pretokenizer(synthetic_kimi):
  path, _ = synthetic_kimi
  tok = TiktokenTokenizer.from_file(path)
  rank = tokenizer_lib.read_tiktoken_ranks(path)
  assert tok.encode("1234") == [rank[b"123"], rank[b"4"]]  # digits grouped 1-3
  assert tok.encode("a中") == [rank[b"a"], rank["中".encode()]]  # Han runs split from letters
  assert tok.encode(" the") == [rank[b" the"]]
  assert tok.encode("<|im_end|>") != [tok.special_id("<|im_end|>")]


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(synthetic_kimi, text):
  tok = TiktokenTokenizer.from_file(synthetic_kimi[0])
  assert tok.decode(tok.encode(text)) == text


def test_tiktoken_matches_hf_on_the_same_vocabulary(small_tokenizer, tmp_path):
  """The default vocabulary exported to Kimi's format gives the same ids through tiktoken."""
  ranks = default_tokenizer.to_tiktoken_ranks(small_tokenizer.backend)
  tokenizer_lib.write_tiktoken_ranks(ranks, tmp_path / "tiktoken.model")
  tok = TiktokenTokenizer.from_file(tmp_path / "tiktoken.model")
  for text in TEXTS:
    assert tok.encode(text) == small_tokenizer.encode(text)


def test_tiktoken_cuts_very_long_inputs_losslessly(synthetic_kimi):
  tok = TiktokenTokenizer.from_file(synthetic_kimi[0])
  text = "x" * 60_000 + " " * 30_000 + "the end"
  assert tok.decode(tok.encode(text)) == text
