"""Matmul FLOPs of a compiled (optimized) HLO module, loops multiplied by their trip counts.

Why not `compiled.cost_analysis()["flops"]`: XLA's cost analysis counts a while-loop body once, so
a model whose layers run under `nn.scan` reports roughly 1/L of its matmul work, and it also adds
every elementwise op, which the analytic "6 x active params" count does not. This module walks
the optimized HLO text from ENTRY through fusions, calls, conditionals and while loops and counts
only the multiply-accumulate work:

  dot          2 x (result elements) x (contracted elements)
  convolution  XLA's own formula (HloCostAnalysis::GetConvolutionFlops): 2 x batch x in-features /
               feature groups x out-features x valid (output, kernel) position pairs per spatial
               dim, so dilated / padded "convolutions" that implement transposed matmuls count
               exactly the taps the hardware computes
  Mosaic kernel (custom_call_target="tpu_custom_call") its `cost_estimate` flops (the
               `pl.CostEstimate` a Pallas kernel declares, or the one XLA attaches to its own
               kernels); a kernel without one is counted by a rule its owner registered with
               `register_kernel_rule`, else reported in `uncounted_kernels`
  while        body x trip count, read from the loop's induction variable (init, bound, step);
               a loop whose trip count cannot be read is counted once and listed in
               `unknown_trip_count_loops` (callers should treat a non-empty list as an error)
  conditional  the most expensive branch (an upper bound)
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Callable, Optional

Shape = tuple[str, tuple[int, ...]]  # (element type, dims)
# rule(kernel name, operand shapes, result shapes, attributes text) -> flops of one call
KernelRule = Callable[[str, list[Shape], list[Shape], str], float]
_KERNEL_RULES: dict[str, KernelRule] = {}


def register_kernel_rule(name_prefix: str, rule: KernelRule) -> None:
  """Counts Mosaic kernels whose instruction name starts with `name_prefix` (no cost_estimate)."""
  _KERNEL_RULES[name_prefix] = rule


@dataclasses.dataclass
class FlopCount:
  total: float
  by_kind: dict  # "xla dot/convolution", "kernel <name>" -> flops
  by_op_name: dict  # the jax op_name (metadata) of each counted instruction -> flops
  unknown_trip_count_loops: list
  uncounted_kernels: list


@dataclasses.dataclass
class _Instruction:
  name: str
  types: list  # [Shape]: one entry, or the elements of a tuple
  opcode: str
  operands: list  # operand instruction names
  args: str  # the text inside the opcode's parentheses
  attrs: str


_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


def _matching_paren(text: str, start: int) -> int:
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "({[":
      depth += 1
    elif text[i] in ")}]":
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _shapes(type_text: str) -> list:
  """Array shapes in a type string (layouts like {1,0:T(8,128)} skipped)."""
  no_layouts = re.sub(r"\{[^{}]*\}", "", type_text)
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(no_layouts)]


def _parse_instruction(line: str) -> Optional[_Instruction]:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  rest = _COMMENT.sub("", rest)
  if rest.startswith("("):  # tuple type
    end = _matching_paren(rest, 0)
    type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  opcode_match = re.match(r"([a-z][a-z0-9-]*)\(", rest)
  if not opcode_match:
    return None
  opcode = opcode_match.group(1)
  open_at = opcode_match.end() - 1
  close_at = _matching_paren(rest, open_at)
  args = rest[open_at + 1:close_at]
  operands = re.findall(r"%([^\s,()]+)", args)
  return _Instruction(name, _shapes(type_text), opcode, operands, args, rest[close_at + 1:])


def parse_module(hlo_text: str) -> tuple[dict, str]:
  """{computation: [instructions]} and the ENTRY computation's name.

  An instruction may span lines (multi-line frontend attributes); a computation ends at a line
  holding only "}".
  """
  computations, entry, current, pending = {}, None, None, []

  def flush():
    if pending and current is not None:
      inst = _parse_instruction(" ".join(pending))
      if inst is not None:
        computations[current].append(inst)
    pending.clear()

  for line in hlo_text.splitlines():
    header = _HEADER.match(line) if current is None else None
    if header:
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None and line.strip() == "}":
      flush()
      current = None
    elif current is not None and _INSTRUCTION.match(line):
      flush()
      pending.append(line)
    elif pending:
      pending.append(line.strip())
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _dims(inst: _Instruction) -> tuple[int, ...]:
  return inst.types[0][1]


def _dot_flops(inst: _Instruction, table: dict) -> float:
  lhs = _dims(table[inst.operands[0]])
  contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.attrs)
  contracted = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) \
      if contracting else 1
  return 2.0 * math.prod(_dims(inst)) * contracted


def _window_field(window: str, key: str, count: int, default: int) -> list:
  match = re.search(rf"\b{key}=([0-9x_-]+)", window)
  if not match:
    return [(default, default)] * count if key == "pad" else [default] * count
  if key == "pad":
    return [tuple(int(v) for v in p.split("_")) for p in match.group(1).split("x")]
  return [int(v) for v in match.group(1).split("x")]


def _conv_flops(inst: _Instruction, table: dict) -> float:
  """XLA's GetConvolutionFlops: FMAs over valid (output, kernel) position pairs, times 2."""
  lhs, rhs = _dims(table[inst.operands[0]]), _dims(table[inst.operands[1]])
  out = _dims(inst)
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", inst.attrs)
  lhs_l, rhs_l, out_l = labels.groups()
  batch, in_feat, out_feat = lhs[lhs_l.index("b")], lhs[lhs_l.index("f")], out[out_l.index("f")]
  spatial = sorted(c for c in lhs_l if c.isdigit())
  window = re.search(r"window=\{([^}]*)\}", inst.attrs)
  window = window.group(1) if window else ""
  n = len(spatial)
  strides = _window_field(window, "stride", n, 1)
  pads = _window_field(window, "pad", n, 0)
  base_dil = _window_field(window, "lhs_dilate", n, 1)
  win_dil = _window_field(window, "rhs_dilate", n, 1)
  positions = 1
  for s, c in enumerate(spatial):
    k_lim, o_lim, i_lim = rhs[rhs_l.index(c)], out[out_l.index(c)], lhs[lhs_l.index(c)]
    valid = 0
    for k in range(k_lim):
      for o in range(o_lim):
        undilated = o * strides[s] - pads[s][0] + k * win_dil[s]
        if undilated % base_dil[s] == 0 and 0 <= undilated // base_dil[s] < i_lim:
          valid += 1
    positions *= valid
  groups = re.search(r"feature_group_count=(\d+)", inst.attrs)
  batch_groups = re.search(r"batch_group_count=(\d+)", inst.attrs)
  fmas = (in_feat // (int(groups.group(1)) if groups else 1)) * out_feat * \
      (batch // (int(batch_groups.group(1)) if batch_groups else 1)) * positions
  return 2.0 * fmas


def _kernel_flops(inst: _Instruction, table: dict) -> tuple[str, Optional[float]]:
  kernel = re.sub(r"\.\d+$", "", inst.name)
  estimate = re.search(r'"cost_estimate":\{"flops":"(\d+)"', inst.attrs)
  if estimate:
    return kernel, float(estimate.group(1))
  for prefix, rule in _KERNEL_RULES.items():
    if kernel.startswith(prefix):
      operand_shapes = [table[o].types[0] for o in inst.operands if o in table]
      return kernel, float(rule(kernel, operand_shapes, inst.types, inst.attrs))
  return kernel, None


_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape", "copy-start", "copy-done")


def _source(name: str, table: dict) -> Optional[_Instruction]:
  """The instruction a value comes from, looking through copies and bitcasts."""
  inst = table.get(name)
  while inst is not None and inst.opcode in _PASS_THROUGH and inst.operands:
    inst = table.get(inst.operands[0])
  return inst


def _constant_value(inst: Optional[_Instruction]) -> Optional[int]:
  if inst is None or inst.opcode != "constant":
    return None
  return int(inst.args) if re.fullmatch(r"-?\d+", inst.args.strip()) else None


def _tuple_index(inst: Optional[_Instruction]) -> Optional[int]:
  if inst is None or inst.opcode != "get-tuple-element":
    return None
  return int(re.search(r"index=(\d+)", inst.attrs).group(1))


def _trip_count(while_inst: _Instruction, caller: dict, computations: dict) -> Optional[int]:
  """Trip count of a counted loop `for (i = init; i < bound; i += step)`, else None."""
  cond = re.search(r"condition=%([^\s,]+)", while_inst.attrs).group(1)
  body = re.search(r"body=%([^\s,]+)", while_inst.attrs).group(1)
  cond_table = {i.name: i for i in computations[cond]}
  root = computations[cond][-1]
  if root.opcode != "compare" or "direction=LT" not in root.attrs:
    return None
  index = _tuple_index(_source(root.operands[0], cond_table))
  bound = _constant_value(_source(root.operands[1], cond_table))
  if index is None or bound is None:
    return None
  # init: element `index` of the tuple the loop starts from
  init_tuple = _source(while_inst.operands[0], caller)
  if init_tuple is None or init_tuple.opcode != "tuple":
    return None
  init = _constant_value(_source(init_tuple.operands[index], caller))
  # step: the body's root tuple element `index` = add(get-tuple-element(index), constant)
  body_table = {i.name: i for i in computations[body]}
  body_root = computations[body][-1]
  if body_root.opcode != "tuple" or init is None:
    return None
  update = _source(body_root.operands[index], body_table)
  if update is None or update.opcode != "add":
    return None
  terms = [_source(o, body_table) for o in update.operands]
  steps = [_constant_value(t) for t in terms]
  counters = [_tuple_index(t) for t in terms]
  if sorted(steps, key=lambda v: v is None)[1:] != [None] or index not in counters:
    return None
  step = next(v for v in steps if v is not None)
  if step <= 0:
    return None
  return max(0, -(-(bound - init) // step))


def count_flops(hlo_text: str) -> FlopCount:
  computations, entry = parse_module(hlo_text)
  memo: dict[str, tuple[collections.Counter, collections.Counter]] = {}
  unknown_loops, uncounted = [], []

  def visit(name: str) -> tuple[collections.Counter, collections.Counter]:
    if name in memo:
      return memo[name]
    table = {i.name: i for i in computations[name]}
    kinds: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()

    def add(kind: str, inst: _Instruction, value: float):
      kinds[kind] += value
      op_name = re.search(r'op_name="([^"]*)"', inst.attrs)
      ops[op_name.group(1) if op_name else inst.name] += value

    def add_called(called: tuple, times: int = 1):
      for target, source in zip((kinds, ops), called):
        for key, value in source.items():
          target[key] += times * value

    for inst in computations[name]:
      if inst.opcode == "dot":
        add("xla dot/convolution", inst, _dot_flops(inst, table))
      elif inst.opcode == "convolution":
        add("xla dot/convolution", inst, _conv_flops(inst, table))
      elif inst.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in inst.attrs:
        kernel, kernel_flops = _kernel_flops(inst, table)
        if kernel_flops is None:
          uncounted.append(kernel)
        else:
          add(f"kernel {kernel}", inst, kernel_flops)
      if inst.opcode == "while":
        trips = _trip_count(inst, table, computations)
        if trips is None:
          unknown_loops.append(inst.name)
          trips = 1
        add_called(visit(re.search(r"body=%([^\s,]+)", inst.attrs).group(1)), trips)
        continue
      if inst.opcode == "conditional":
        branches = re.findall(r"%([^\s,{}]+)", re.sub(r".*?(branch_computations|true_computation)",
                                                      "", inst.attrs, count=1))
        branch_costs = [visit(b) for b in branches if b in computations]
        if branch_costs:
          add_called(max(branch_costs, key=lambda c: sum(c[0].values())))
        continue
      for called in re.findall(r"(?:calls|to_apply)=\{?%([^\s,}]+)", inst.attrs):
        if called in computations:
          add_called(visit(called))
    memo[name] = (kinds, ops)
    return memo[name]

  by_kind, by_op_name = visit(entry)
  return FlopCount(total=float(sum(by_kind.values())), by_kind=dict(by_kind),
                   by_op_name=dict(by_op_name),
                   unknown_trip_count_loops=unknown_loops,
                   uncounted_kernels=sorted(set(uncounted)))
