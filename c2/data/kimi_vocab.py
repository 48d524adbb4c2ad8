"""Kimi's tokenizer conventions: the pre-tokenizer regex and the special-token layout.

Kimi (K2 / K2.5) ships `tiktoken.model` with 163,584 BPE ranks and appends 256 reserved special
slots, so a special token's id is `num_ranks + offset`. The named slots below are the ones in
research/kimi_config.md; every other slot is `<|reserved_token_{id}|>`.

The chat template (c2/data/chat.py) refers to special tokens by *name* only, and every tokenizer in
c2/data/tokenizers.py resolves these names, so one template serves Kimi's real tokenizer, a Hugging
Face `tokenizer.json` and the small default tokenizer trained on the Python standard library.
"""
from __future__ import annotations

BOS = "[BOS]"
EOS = "[EOS]"
PAD = "[PAD]"
UNK = "[UNK]"
IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
TOOL_CALLS_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi's pre-tokenizer (`pat_str` of tokenization_kimi.py): like cl100k, but runs of Han characters
# form their own pieces (Han is subtracted from the letter classes via `&&`) and digits are grouped
# 1-3 at a time. Both tiktoken's regex engine and the `tokenizers` (Oniguruma) engine accept it, so
# the default tokenizer is trained with the very same split.
KIMI_PRETOKENIZER_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Offset of each named token from the first special id (= number of BPE ranks). Values from the
# K2 tokenizer_config.json and the K2.5 special-token tables (research/kimi_config.md).
KIMI_SPECIAL_TOKEN_OFFSETS: dict[str, int] = {
    BOS: 0,
    EOS: 1,
    IM_END: 2,
    IM_USER: 3,
    IM_ASSISTANT: 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    IM_SYSTEM: 10,
    TOOL_CALLS_SECTION_BEGIN: 11,
    TOOL_CALLS_SECTION_END: 12,
    TOOL_CALL_BEGIN: 13,
    TOOL_CALL_ARGUMENT_BEGIN: 14,
    TOOL_CALL_END: 15,
    IM_MIDDLE: 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    THINK_BEGIN: 22,
    THINK_END: 23,
    UNK: 254,
    PAD: 255,
}

# What the chat template and the packer need from any tokenizer. A tokenizer that lacks one of
# these cannot render Kimi chats, so loaders check for them up front.
REQUIRED_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE,
    TOOL_CALLS_SECTION_BEGIN, TOOL_CALLS_SECTION_END, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_END, THINK_BEGIN, THINK_END,
)

# The default (stdlib-trained) tokenizer appends all of Kimi's *named* tokens, in Kimi's id order,
# but not the unnamed reserved slots: its vocabulary is only a few thousand entries.
DEFAULT_TOKENIZER_SPECIAL_TOKENS: tuple[str, ...] = tuple(
    sorted(KIMI_SPECIAL_TOKEN_OFFSETS, key=KIMI_SPECIAL_TOKEN_OFFSETS.__getitem__))


def reserved_token_name(token_id: int) -> str:
  """Name Kimi gives an unnamed special slot."""
  return f"<|reserved_token_{token_id}|>"


def kimi_special_token_ids(num_ranks: int) -> dict[str, int]:
  """All 256 special tokens of a Kimi-layout vocabulary, name -> id, ids num_ranks..num_ranks+255."""
  by_offset = {offset: name for name, offset in KIMI_SPECIAL_TOKEN_OFFSETS.items()}
  return {by_offset.get(offset, reserved_token_name(num_ranks + offset)): num_ranks + offset
          for offset in range(NUM_RESERVED_SPECIAL_TOKENS)}
