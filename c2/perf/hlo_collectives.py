"""Bytes each device sends into collectives per step, from a compiled (optimized) HLO module.

  count_collective_bytes(compiled.as_text()) -> {"all-gather": bytes, "all-to-all": bytes, ...}

Walks the module from ENTRY like c2.perf.hlo_flops (fusions, calls, async wrappers, while loops
times their trip counts, the most expensive conditional branch) and, for every collective, adds
the size of its per-device buffer: the larger of its operands and its result, so an all-gather
counts the gathered array, a reduce-scatter its full input, an all-reduce / all-to-all /
collective-permute their operand. For ragged-all-to-all that is the send or receive buffer
(capacity-sized, an upper bound of the rows actually sent). Async pairs count once (the -start).
The figure is a per-device buffer size, not link traffic: a ring all-gather over N devices moves
(N - 1) / N of it through each link.
"""
from __future__ import annotations

import collections
import math
import re

from c2.perf import hlo_flops

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute")
_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "f8e8m0fnu": 1, "f4e2m1fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def _nbytes(shapes: list) -> int:
  return sum(_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in shapes)


def _collective_bytes(inst, table: dict) -> int:
  operands = [table[o].types[0] for o in inst.operands if o in table]
  if inst.opcode.startswith("ragged-all-to-all"):
    operands = operands[:1]  # the rest are offsets and sizes
  result = inst.types
  if inst.opcode.endswith("-start") and len(result) > len(operands):
    result = result[len(operands):]  # (operands..., results..., contexts)
  return max(_nbytes(operands), _nbytes(result))


def count_collective_bytes(hlo_text: str) -> dict:
  """{kind: bytes per device per step} for each kind in KINDS (0 when absent)."""
  computations, entry = hlo_flops.parse_module(hlo_text)
  memo: dict[str, collections.Counter] = {}

  def visit(name: str) -> collections.Counter:
    if name in memo:
      return memo[name]
    table = {i.name: i for i in computations[name]}
    total: collections.Counter = collections.Counter()
    for inst in computations[name]:
      kind = re.sub(r"-start$", "", inst.opcode)
      if kind in KINDS:
        total[kind] += _collective_bytes(inst, table)
      if inst.opcode == "while":
        # pylint: disable-next=protected-access
        trips = hlo_flops._trip_count(inst, table, computations) or 1
        body = re.search(r"body=%([^\s,]+)", inst.attrs).group(1)
        for key, value in visit(body).items():
          total[key] += trips * value
        continue
      if inst.opcode == "conditional":
        branches = [b for b in re.findall(r"%([^\s,{}]+)", inst.attrs) if b in computations]
        if branches:
          total.update(max((visit(b) for b in branches), key=lambda c: sum(c.values())))
        continue
      for called in re.findall(r"(?:calls|to_apply)=\{?%([^\s,}]+)", inst.attrs):
        if called in computations:
          total.update(visit(called))
    memo[name] = total
    return total

  counted = visit(entry)
  return {kind: int(counted.get(kind, 0)) for kind in KINDS}
