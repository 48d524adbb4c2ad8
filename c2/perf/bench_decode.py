"""Decoding throughput of the inference engine (c2/infer) against references, side by side.

  python -m c2.bench decode --workdir runs/tiny     # the trained tiny model (experiments/pretrain.py)
  python -m c2.bench decode                         # random init of --preset: throughput only

Every figure is a ratio of two runs in this process on the same weights (CPU timings are noisy:
read the ratios; each side is the best of --repeats timed runs, the two sides' runs interleaved,
after an untimed warm-up, so compile time is excluded). Every engine runs --decode-steps (4)
decode steps per device call (Engine(decode_steps=)). Batch 1 serves --serial-prompts (8)
prompts one after another; batch 16 one batch of 16. Computation is float32 throughout. Prompts are windows of held-out
code (stdlib files of the `heldout` split, c2/data/stdlib_corpus.py: never trained on).
  1. c2 vs transformers: Engine greedy decoding vs `DeepseekV3ForCausalLM.generate` (greedy,
     float32 torch, the weights exported by c2.hf) at batch 1 and 16. The token sequences must
     be identical. Targets: >= 3x at batch 1, >= 5x at batch 16.
  2. Speculative vs plain: Engine(draft_depth=1 and 2, the MTP drafter) vs Engine(), greedy and
     temperature 1. Acceptance = accepted first drafts / decode rows. Targets at batch 1:
     acceptance >= 0.6 and speedup >= 1.3x (batch 16 reported). Meaningless on random weights.
  3. Continuous vs static batching on requests of mixed lengths (max_new_tokens drawn from
     8..128): static waits for a group of `slots` requests to finish before submitting the next;
     continuous submits them all. Sequences must match between the two.
Exits 1 when sequences differ, a step recompiled, or (with trained weights) a target is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Optional, Sequence

import jax
import numpy as np

from c2 import config as config_lib
from c2 import model
from c2.infer.engine import Engine, Request, SamplingParams
from c2.model.config import ModelConfig, get_preset

_COMPILES = [0]  # XLA compilations in this process (a listener counts them)
TARGETS = {"hf_ratio_b1": 3.0, "hf_ratio_b16": 5.0, "acceptance_b1": 0.6, "spec_speedup_b1": 1.3}


# ------------------------------------------------------------------------------ model and data


def load_workdir(workdir: str) -> tuple[ModelConfig, dict, object]:
  """(float32 ModelConfig, params of the latest checkpoint, tokenizer) of a training workdir."""
  from c2.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  from c2.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, "tb", "config.json")) as f:
    raw = json.load(f)
  # The saved config holds every resolved ModelConfig field; the preset only fills absent ones.
  raw["model"].setdefault("preset", "tiny")
  cfg = config_lib.from_config_dict(raw).model.replace(dtype="float32")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                          model.abstract_params(cfg))
  params, missing = ckpt_lib.restore_params_subset(
      os.path.abspath(os.path.join(workdir, "ckpt")), abstract)
  if missing:
    raise ValueError(f"{workdir}: checkpoint lacks {missing}")
  return cfg, params, load_tokenizer(os.path.join(workdir, "tokenizer.json"))


def heldout_prompts(tokenizer, count: int, length: int, vocab_size: int,
                    seed: int = 0) -> list[list[int]]:
  """`count` windows of `length` tokens spread evenly over the held-out stdlib files (random ids
  when there is no tokenizer)."""
  if tokenizer is None:
    return np.random.default_rng(seed).integers(2, vocab_size, (count, length)).tolist()
  from c2.data import stdlib_corpus  # pylint: disable=import-outside-toplevel
  stream = [t for text in stdlib_corpus.stdlib_corpus("heldout") for t in tokenizer.encode(text)]
  starts = np.linspace(0, len(stream) - length, count).astype(int)
  return [stream[s:s + length] for s in starts]


# ------------------------------------------------------------------------------------- timing


def _requests(prompts, new_tokens, temperature=0.0) -> list[Request]:
  news = [new_tokens] * len(prompts) if isinstance(new_tokens, int) else new_tokens
  return [Request(p, SamplingParams(max_new_tokens=n, temperature=temperature, seed=i))
          for i, (p, n) in enumerate(zip(prompts, news))]


def _count_compiles(event: str, *args, **kwargs) -> None:
  del args, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
RECOMPILES = [0]  # compilations inside timed runs (after their warm-up): must stay 0


def _timed_pair(fn_a, fn_b, repeats: int):
  """([best seconds of fn_a, of fn_b], [their last results]) over `repeats` timed calls each,
  after one untimed warm-up call of each. The runs are interleaved (a, b, a, b, ...), so that a
  slow stretch of a shared machine lands on both sides of the ratio."""
  fn_a(), fn_b()
  best, results, before = [float("inf")] * 2, [None, None], _COMPILES[0]
  for _ in range(repeats):
    for i, fn in enumerate((fn_a, fn_b)):
      start = time.perf_counter()
      results[i] = fn()
      best[i] = min(best[i], time.perf_counter() - start)
  RECOMPILES[0] += _COMPILES[0] - before
  return best, results


def make_engine(cfg: ModelConfig, params, slots: int, capacity: int, draft_depth: int = 0,
                prefill_rows: Optional[int] = None, decode_steps: int = 4):
  """prefill_rows (default: all slots, one prefill step for a static batch) is a fixed shape:
  with continuous batching each admission pays for all of its rows, so use 1 there."""
  return Engine(cfg, params, slots=slots, capacity=capacity, prefill_rows=prefill_rows or slots,
                draft_depth=draft_depth, decode_steps=decode_steps)


# ---------------------------------------------------------------------------------- 1. vs HF


def load_hf(cfg: ModelConfig, params, directory: str):
  """The same weights as transformers' DeepseekV3ForCausalLM in float32 torch."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from c2.hf import checkpoint as hf  # pylint: disable=import-outside-toplevel
  hf.export_checkpoint(cfg, params, directory, dtype="float32")
  transformers.logging.set_verbosity_error()  # MTP layers are unused there, and listed
  return transformers.DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def vs_transformers(engine: Engine, hf_model, prompts: Sequence[Sequence[int]], new_tokens: int,
                    repeats: int = 1) -> dict:
  """Greedy decoding of the prompts (equal lengths) in batches of engine.slots rows, one batch
  after another, by both; tokens/s of each and the number of identical sequences."""
  import torch  # pylint: disable=import-outside-toplevel
  b = engine.slots
  batches = [torch.tensor(np.asarray(prompts[i:i + b], np.int64))
             for i in range(0, len(prompts), b)]

  def hf_generate(n=new_tokens):
    outs = []
    with torch.no_grad():
      for ids in batches:
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        outs += out[:, ids.shape[1]:].tolist()
    return outs

  # Requests beyond the slots queue: the engine serves them as slots free (b rows at a time).
  c2_generate = lambda: [r.token_ids for r in engine.generate(_requests(prompts, new_tokens))]
  hf_generate(2)  # loads and warms torch's kernels on a short run
  (hf_seconds, c2_seconds), (hf_tokens, c2_tokens) = _timed_pair(hf_generate, c2_generate,
                                                                 repeats)
  total = len(prompts) * new_tokens
  return {"c2_tps": total / c2_seconds, "hf_tps": total / hf_seconds,
          "ratio": hf_seconds / c2_seconds, "total": len(prompts),
          "matching": sum(list(a) == b for a, b in zip(hf_tokens, c2_tokens))}


# -------------------------------------------------------------------------- 2. speculative


def speculative(plain: Engine, spec: Engine, prompts, new_tokens: int, temperature: float,
                repeats: int = 1) -> dict:
  """Tokens/s of `spec` over `plain` on the same requests, and the first draft's acceptance."""
  requests = lambda: _requests(prompts, new_tokens, temperature)
  spec.stats.clear()
  (plain_seconds, spec_seconds), (_, results) = _timed_pair(
      lambda: plain.generate(requests()), lambda: spec.generate(requests()), repeats)
  runs = repeats + 1  # the stats also count the warm-up run
  tokens = sum(len(r.token_ids) for r in results)
  stats = {k: v / runs for k, v in spec.stats.items()}
  return {"plain_tps": tokens / plain_seconds, "spec_tps": tokens / spec_seconds,
          "speedup": plain_seconds / spec_seconds,
          "acceptance": stats["accepted_depth_1"] / stats["decode_rows"],
          "acceptance_2": stats.get("accepted_depth_2", 0.0) / stats["decode_rows"]}


# ----------------------------------------------------------------------- 3. batching policy


def batching(engine: Engine, prompts, new_tokens: Sequence[int], repeats: int = 1) -> dict:
  """Tokens/s of all requests submitted at once over groups of `engine.slots` run in turn."""
  requests = lambda: _requests(prompts, new_tokens, temperature=1.0)
  groups = lambda r: [r[i:i + engine.slots] for i in range(0, len(r), engine.slots)]
  (static_seconds, continuous_seconds), (static, continuous) = _timed_pair(
      lambda: [x for g in groups(requests()) for x in engine.generate(g)],
      lambda: engine.generate(requests()), repeats)
  tokens = sum(len(r.token_ids) for r in continuous)
  return {"static_tps": tokens / static_seconds, "continuous_tps": tokens / continuous_seconds,
          "ratio": static_seconds / continuous_seconds, "total": len(prompts),
          "matching": sum(a.token_ids == b.token_ids for a, b in zip(static, continuous))}


# --------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.bench decode", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", help="a training workdir (else random init of --preset)")
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--prompt-tokens", type=int, default=48)
  parser.add_argument("--new-tokens", type=int, default=96)
  parser.add_argument("--batches", default="1,16")
  parser.add_argument("--depths", default="1,2")
  parser.add_argument("--requests", type=int, default=32, help="for continuous vs static")
  parser.add_argument("--slots", type=int, default=8, help="for continuous vs static")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--decode-steps", type=int, default=4,
                      help="decode steps per device call (Engine(decode_steps=)), every engine")
  parser.add_argument("--serial-prompts", type=int, default=8, help=(
      "prompts served one after another at batch 1 (acceptance over one 96-token sequence is "
      "too noisy to read)"))
  parser.add_argument("--skip", default="", help="comma-separated: hf,speculative,batching")
  args = parser.parse_args(argv)
  RECOMPILES[0] = 0
  skip = set(filter(None, args.skip.split(",")))
  batches = [int(b) for b in args.batches.split(",")]
  depths = [int(d) for d in args.depths.split(",")]

  if args.workdir:
    cfg, params, tokenizer = load_workdir(args.workdir)
    source = f"{args.workdir} (trained)"
  else:
    cfg = get_preset(args.preset, dtype="float32", remat_policy="none")
    params, tokenizer = model.init_params(cfg, jax.random.key(0)), None
    source = f"random init of {args.preset}: acceptance figures are meaningless"
  print(f"backend {jax.default_backend()}  model {source}  float32  prompts "
        f"{args.prompt_tokens} tokens of held-out code  new tokens {args.new_tokens}  "
        f"decode steps per call {args.decode_steps}")
  prompts = heldout_prompts(tokenizer, max(batches + [args.requests, args.serial_prompts]),
                            args.prompt_tokens, cfg.vocab_size)
  # Batch 1 serves --serial-prompts requests in turn; a larger batch serves one batch of them.
  batch_prompts = lambda b: prompts[:args.serial_prompts if b == 1 else b]
  capacity = args.prompt_tokens + max(args.new_tokens, 128) + max(depths + [0]) + 1
  failed = []

  def check(name: str, value: float, target: Optional[float], enforce: bool = True) -> str:
    if target is None:
      return ""
    if value < target and enforce:
      failed.append(f"{name} {value:.2f} < {target}")
    return f"   target >= {target}" + ("  BELOW" if value < target else "")

  engines = {}

  def engine(slots: int, depth: int = 0) -> Engine:
    if (slots, depth) not in engines:
      engines[slots, depth] = make_engine(cfg, params, slots, capacity, depth,
                                          decode_steps=args.decode_steps)
    return engines[slots, depth]

  if "hf" not in skip:
    print(f"\n1. c2 Engine vs transformers generate (greedy; best of {args.repeats})")
    print(f"{'batch':>6}{'c2 tok/s':>11}{'hf tok/s':>11}{'c2/hf':>8}{'identical':>11}")
    with tempfile.TemporaryDirectory() as directory:
      hf_model = load_hf(cfg, params, directory)
      for b in batches:
        r = vs_transformers(engine(b), hf_model, batch_prompts(b), args.new_tokens,
                            args.repeats)
        if r["matching"] != r["total"]:
          failed.append(f"batch {b}: {r['total'] - r['matching']} sequences differ from transformers")
        print(f"{b:>6}{r['c2_tps']:>11.1f}{r['hf_tps']:>11.1f}{r['ratio']:>8.2f}"
              f"{r['matching']:>6}/{r['total']:<4}" + check(
                  f"c2/hf at batch {b}", r["ratio"], TARGETS.get(f"hf_ratio_b{b}")))

  if "speculative" not in skip:
    print(f"\n2. speculative (MTP drafter) vs plain decoding (best of {args.repeats})")
    print(f"{'batch':>6}{'depth':>6}{'temp':>6}{'accept d1':>10}{'accept d2':>10}"
          f"{'plain tok/s':>12}{'spec tok/s':>11}{'speedup':>9}")
    for b in batches:
      for d in depths:
        for temperature in (0.0, 1.0):
          r = speculative(engine(b), engine(b, d), batch_prompts(b), args.new_tokens,
                          temperature, args.repeats)
          second = f"{r['acceptance_2']:>10.2f}" if d > 1 else f"{'-':>10}"
          targets = (check(f"acceptance b{b} d{d} t{temperature:g}", r["acceptance"],
                           TARGETS.get(f"acceptance_b{b}"), bool(args.workdir)) +
                     check(f"speedup b{b} d{d} t{temperature:g}", r["speedup"],
                           TARGETS.get(f"spec_speedup_b{b}"), bool(args.workdir)))
          print(f"{b:>6}{d:>6}{temperature:>6g}{r['acceptance']:>10.2f}{second}"
                f"{r['plain_tps']:>12.1f}{r['spec_tps']:>11.1f}{r['speedup']:>9.2f}{targets}")

  if "batching" not in skip:
    lengths = np.random.default_rng(1).integers(8, 129, args.requests).tolist()
    print(f"\n3. continuous vs static batching: {args.requests} requests, max_new_tokens "
          f"{min(lengths)}..{max(lengths)}, {args.slots} slots, temperature 1")
    r = batching(make_engine(cfg, params, args.slots, capacity, prefill_rows=1,
                             decode_steps=args.decode_steps),
                 prompts[:args.requests], lengths, args.repeats)
    if r["matching"] != r["total"]:
      failed.append(f"batching: {r['total'] - r['matching']} sequences differ between policies")
    print(f"static {r['static_tps']:.1f} tok/s  continuous {r['continuous_tps']:.1f} tok/s  "
          f"continuous/static {r['ratio']:.2f}  identical {r['matching']}/{r['total']}")

  print(f"\nXLA compilations during timed runs: {RECOMPILES[0]} (in all: {_COMPILES[0]})")
  if RECOMPILES[0]:
    failed.append(f"{RECOMPILES[0]} compilations during timed runs")
  if failed:
    print("FAILED: " + "; ".join(failed))
  return 1 if failed else 0
