"""Codebase loss: total nats of a code corpus under the model, over a rolling window.

Composer 2 compared base models by the summed negative log-likelihood of Cursor's monorepo, files
concatenated alphabetically, scored with a rolling window (report section 1.3, Table 2). A total
over the *text* does not depend on how a tokenizer cuts it: a model that spends fewer tokens
spends more nats on each, and the sum is the text's log-likelihood either way. So checkpoints
with different tokenizers compare on nats, and on nats per UTF-8 byte (the total over the byte
count, which is fixed by the text).

Rolling window over the token stream [BOS] t_1 ... t_n (BOS as the training documents start):
window W, stride S < W. The first row is the stream's first W tokens and scores t_1..; every later
row ends S tokens further and scores only its last S tokens, so each token is scored exactly once
and with at least W - S tokens of context (up to W - 1). S = W / 2 is the usual trade: twice the
compute of disjoint windows, every token with at least half a window of context.

    text = stdlib_text(max_bytes=65536)        # the embedded corpus's held-out split, sorted
    out = rolling_nats(tokenizer.encode(text), score_rows, window=256, stride=128, bos_id=...)
    out["nats"] / len(text.encode())           # nats per byte
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from c2.data import stdlib_corpus

# rows of token ids -> per-row float log-probs, logp[t] = log p(row[t] | row[:t]) (ProbeModel)
ScoreRows = Callable[[Sequence[Sequence[int]]], list]


def stdlib_text(max_bytes: Optional[int] = None, split: str = "heldout") -> str:
  """The embedded corpus's `split` files, sorted by path and concatenated, each preceded by a
  `# file: <path>` line (the report's "files concatenated alphabetically"), cut to the first
  `max_bytes` UTF-8 bytes (at a character boundary)."""
  root = stdlib_corpus.stdlib_root()
  parts, size = [], 0
  for path in stdlib_corpus.stdlib_files(split):
    part = f"# file: {path.relative_to(root).as_posix()}\n{stdlib_corpus.read_source(path)}\n"
    parts.append(part)
    size += len(part.encode("utf-8"))
    if max_bytes is not None and size >= max_bytes:
      break
  text = "".join(parts)
  if max_bytes is not None:
    text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
  return text


def rolling_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
  """(start, first_scored, end) rows over a stream of num_tokens tokens whose token 0 is never
  scored (BOS): rows [start, end) score positions [first_scored, end); together they score
  1..num_tokens-1 exactly once, each with at least min(t, window - stride) tokens of context."""
  if not 1 <= stride < window:
    raise ValueError(f"need 1 <= stride < window (a scored token needs context), got "
                     f"stride={stride}, window={window}")
  end = min(window, num_tokens)
  rows = [(0, 1, end)] if num_tokens > 1 else []
  while end < num_tokens:
    new_end = min(end + stride, num_tokens)
    rows.append((max(0, new_end - window), end, new_end))
    end = new_end
  return rows


def rolling_nats(token_ids: Sequence[int], score_rows: ScoreRows, *, window: int, stride: int,
                 bos_id: int, batch: int = 64) -> dict[str, float]:
  """Total nats of token_ids (every token, the first included, given BOS) under the rolling
  window. Returns nats, tokens and the number of rows scored."""
  stream = [bos_id] + list(token_ids)
  rows = rolling_windows(len(stream), window, stride)
  total = 0.0
  for first in range(0, len(rows), batch):
    chunk = rows[first:first + batch]
    logps = score_rows([stream[start:end] for start, _, end in chunk])
    for (start, scored, _), logp in zip(chunk, logps):
      total -= float(np.sum(np.asarray(logp, np.float64)[scored - start:]))
  return {"nats": total, "tokens": float(len(token_ids)), "rows": float(len(rows))}


def codebase_loss(text: str, encode: Callable[[str], list[int]], score_rows: ScoreRows, *,
                  window: int, stride: int, bos_id: int) -> dict[str, float]:
  """Suite scalars of one text: total nats, nats per byte (tokenizer-free), nats per token."""
  ids = encode(text)
  out = rolling_nats(ids, score_rows, window=window, stride=stride, bos_id=bos_id)
  num_bytes = len(text.encode("utf-8"))
  return {"nats": out["nats"], "nats_per_byte": out["nats"] / max(num_bytes, 1),
          "nats_per_token": out["nats"] / max(out["tokens"], 1.0), "tokens": out["tokens"],
          "bytes": float(num_bytes), "bytes_per_token": num_bytes / max(out["tokens"], 1.0)}
