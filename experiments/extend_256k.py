"""Phase 2 of Composer 2: long-context extension of the phase-1 checkpoint to 256k tokens.

A short continued-pretraining run on rows 8x longer than phase 1's, from its checkpoint, with
the RoPE range stretched by YaRN (c2/model/rope.py), documents long enough to fill the rows, and
a short schedule at the end-of-pretraining learning rate (DeepSeek-V3: 1000 steps per YaRN
stage at its final pretraining lr, 7.3e-6). Same step and loss library as pretraining (the
`long_context` phase is the LM step, c2/steps). Evaluated during the run (train.eval_suites) by
held-out loss per position bucket and RULER-style retrieval at lengths up to the new maximum
(c2/evals/long_context.py, c2/evals/ruler.py), and after it:
  python -m c2.eval --checkpoint /tmp/ext-tiny --suite long_context,ruler --lengths 512,1024,2048

Launch (CPU, after `python -m c2.main --config experiments/pretrain.py:tiny --workdir runs/tiny`):
  python -m c2.main --config experiments/extend_256k.py:tiny --workdir /tmp/ext-tiny
tiny goes from the tiny pretraining checkpoint (seq_len 256) to 8x its context, 2048: its params
and AdamW moments (train.init_from_optimizer; the lr schedule restarts), 60 steps of 2 x 2048
tokens from stdlib files of >= 2048 tokens, then the long_context and ruler suites (measured:
17 min of steps + 7 min of suites on 2 CPU cores shared with other jobs, 5-60 s/step).
RoPE: YaRN factor 8 over the 256 positions phase 1 trained, range 2048. (The tiny preset
nominally carries factor 4 over 2048 positions, as Kimi K2.5 carries 64 over 4096, but trained
only 256. Measured on the start checkpoint at 2048 tokens, held-out NLL at positions 1024-2047:
its own RoPE 3.17, this YaRN 2.66, the preset's design with the factor x8 (32 over 2048) 3.29;
so the ramp is placed at the length actually trained.)
Expected (measured from runs/tiny at step 221, where its time budget stopped it; held-out NLL of
16 rows x 2048 tokens by position, start with its own RoPE / start with this YaRN / end):
  positions 1024-2047: 3.17 / 2.66 / 2.48    512-1023: 3.10 / 2.35 / 2.38
  positions  128-255:  2.25 / 2.30 / 2.48    (short range pays ~0.2 nats for 60 steps at 1e-3)
Retrieval (RULER niah single / multikey / variable tracking at 512, 1024, 2048): exact match 0
for all three models, and retrieval_nats (what the needle is worth) within noise of 0 (|x| <
0.7 nats) for all three; the start checkpoint reads no needle at its own 128 or 256 tokens either
(retrieval_nats 0.02, -0.04), so this tiny model has no retrieval to extend: the teacher-forced
answer nats fall (niah_single at 2048: 28.9 / 28.2 / 26.2) from better digit statistics, not from
reading the needle. A retrieval result needs a model that retrieves at its trained length first.
The copy-drilled checkpoint of the agentic pipeline (runs/copy-512, launch/agentic_pipeline.sh:
runs/tiny plus copy drills on rows of 48, 128 and 512 tokens) retrieves at its trained lengths
(RULER retrieval_nats 15.4 / 14.2 at 256 / 512 tokens vs ~0 for runs/tiny) but is no language
model any more (held-out CE 10.8: the drills train copies only). Extended from it (YaRN 4 over
its 512 positions) its retrieval fell while it relearned the corpus, with or without needles in
the extension's documents (mean retrieval_nats at 1024 / 2048: 10.5 / 4.5 -> 7.2 / 2.8, and 7.4
/ 2.8 with half the documents carrying needles; 8 examples per task). A checkpoint that is both
is experiments/pretrain.py:needles (runs/copy-512 back on the corpus with needles at 256 tokens:
CE 3.70, retrieval_nats 3.6 at 256). Its extension (this tiny config, from it, with needles in
half the documents), measured 2026-12-05:
  python -m c2.main --config experiments/pretrain.py:needles --workdir runs/lm-needles
  python -m c2.main --config experiments/extend_256k.py:tiny --workdir runs/ext-lmneedles \
    --config.train.init_from=runs/lm-needles/ckpt --config.data.repeat_fraction=0.5 \
    --config.data.copy_drill_span=64 --config.train.eval_at_start=true
  python -m c2.eval --checkpoint runs/lm-needles --positions-from runs/ext-lmneedles \
    --suite ruler --lengths 1024,2048 --long-examples 32     # the start, under this YaRN
  held-out NLL (start under this YaRN -> end): positions 1024-2047 2.23 -> 1.89, 512-1023 2.25
    -> 1.91, 128-255 2.00 -> 1.88 (16 rows of 2048; steps 5-8 s beside other jobs)
  RULER retrieval_nats, 32 examples per task, mean of four tasks +- standard error: 1024 tokens
    3.25 +- 0.35 -> 2.97 +- 0.34, 2048 tokens 1.50 +- 0.27 -> 1.77 +- 0.26 (niah_single 4.25 /
    1.95 -> 3.59 / 1.84, niah_code 6.87 / 2.74 -> 6.60 / 3.82); exact match 0 throughout.
So YaRN alone carries the start checkpoint's retrieval to 8x its length (positive at 1024 and
2048 beyond noise), and 60 steps of extension improve the loss at late positions but leave
retrieval where it was (changes -0.28 +- 0.95 and +0.26 +- 0.74 at 95%). 240 steps (the same
command with --config.train.steps=240 --config.train.eval_suites_every=240, workdir
runs/ext-long; 28 min beside an evaluation; then c2.eval with 32 examples per task) improve both:
  held-out NLL (start -> end): positions 1024-2047 2.23 -> 1.56, 512-1023 2.25 -> 1.48, 128-255
    2.00 -> 1.49
  RULER retrieval_nats, 32 examples per task: 1024 tokens 3.25 +- 0.35 -> 4.28 +- 0.40 (change
    +1.03, 95% CI -0.01 to +2.07), 2048 tokens 1.50 +- 0.27 -> 2.90 +- 0.36 (+1.40, +0.52 to
    +2.28; unpaired intervals over the same examples, so conservative); at the end, 1024 / 2048:
    niah_single 5.61 / 3.18, niah_multikey 3.01 / 2.33, niah_code 8.49 / 6.10, variable_tracking
    ~0; exact match 0.

Full scale (a pod; the AOT check first proves it fits):
  python -m c2.aot --config experiments/extend_256k.py:full
  launch/run.sh --tpu NAME --zone ZONE --config experiments/extend_256k.py:full \
    --workdir gs://B/runs/long_context
full: Kimi K2.5 already carries YaRN factor 64 from 4096 with a 262144-position range (its own
mid-training went 32k -> 262k); those are kept and the rows become 262144 tokens, phase 1's
tokens per step (128 x 256k = 1024 x 32k) on the layout of experiments/layouts.py:full_256k.
Variants: tiny | proxy | full. Override anything, e.g. --config.train.init_from_optimizer=false
(model only: fresh AdamW moments) or --config.data.min_doc_tokens=0 (every document).
"""
import ml_collections

from c2.config import default_config
from experiments import layouts


def _yarn(factor: float, original: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"factor": factor, "original_max_position_embeddings": original,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0})


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  variant = arg or "tiny"
  c = default_config("long_context", preset="tiny")  # every field, at its dataclass default
  c.name = f"extend_256k-{variant}"
  # Continue phase 1: its params and optimizer moments, its tokenizer (the same ids).
  c.train.update(init_from="runs/tiny/ckpt", init_from_optimizer=True)
  c.data.update(tokenizer="runs/tiny/tokenizer.json")
  # Rows of one document each where possible: a document shorter than a row brings no
  # long-range dependency, and packing several into a row only teaches the model to ignore
  # earlier segments (attention is masked per document anyway).
  c.data.update(seq_len=2048, global_batch_size=2, min_doc_tokens=2048)
  # YaRN over the 256 positions phase 1 trained, 8x (docstring: measured against the others).
  c.model.rope_scaling = _yarn(8.0, 256)
  c.model.max_position_embeddings = 2048
  # tiny: phase 1 ended at 3e-4 (peak 3e-3, decayed to 0.1x); the extension runs at that lr
  # after a short warmup (the moments are warm), decaying over its last 20%.
  c.optim.update(peak_lr=1e-3, warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.3)
  c.train.update(steps=60, max_minutes=None, eval_every=30, eval_batches=2, ce_chunk_size=1024,
                 z_loss_weight=1e-4, balance_loss_weight=1e-4,
                 eval_suites="long_context,ruler", eval_suites_every=60)
  c.checkpoint.update(every_steps=30)

  if variant == "tiny":
    pass
  elif variant == "proxy":
    layouts.proxy_256k(c)  # proxy-30b carries Kimi K2.5's YaRN (64 from 4096, 262144): kept
    c.model.rope_scaling = None  # None: the preset's own
    c.model.max_position_embeddings = None
    c.data.update(source="arrayrecord:gs://BUCKET/long/{split}-*.arrayrecord",
                  min_doc_tokens=32768)
    c.train.update(init_from="gs://BUCKET/runs/cpt-proxy/ckpt", steps=1000, eval_every=100,
                   eval_suites_every=500)
    c.optim.update(peak_lr=3e-5, warmup_steps=20, min_lr_ratio=1.0)  # proxy phase 1's final lr
    c.checkpoint.update(every_steps=100)
  elif variant == "full":
    layouts.full_256k(c)  # keeps kimi-k2.5's YaRN (factor 64 from 4096, 262144 positions)
    c.model.rope_scaling = None  # None: the preset's own
    c.model.max_position_embeddings = None
    # Documents shorter than phase 1's rows add nothing phase 1 did not teach.
    c.data.update(source="arrayrecord:gs://BUCKET/long/{split}-*.arrayrecord",
                  min_doc_tokens=32768)
    c.train.update(init_from="gs://BUCKET/runs/cpt/ckpt", steps=1000, eval_every=100,
                   eval_suites_every=500)
    # experiments/pretrain.py:full ends at 2e-5 x 0.35 = 7e-6 (DeepSeek-V3's stage lr: 7.3e-6).
    c.optim.update(peak_lr=7e-6, warmup_steps=20, min_lr_ratio=1.0)
    c.checkpoint.update(every_steps=100)
  else:
    raise ValueError(f"unknown variant {variant!r}; choose tiny, proxy or full")
  return c
