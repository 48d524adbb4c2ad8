"""Phase 1 of Composer 2: continued pretraining of the Kimi-K2.5 MoE at 32k tokens, with MTP.

Launch (CPU, the embedded stdlib corpus, no download; ends by itself in about 10 minutes):
  python -m c2.main --config experiments/pretrain.py:tiny --workdir runs/tiny
Expected (measured on 2 CPU cores, ~2 s/step): held-out CE falls from ~8.3 (ln 4096) to ~4.0
nats/token, far below the held-out unigram entropy (6.14 nats/token); MTP top-1 agreement with
the main head rises. Rerunning the command resumes from the last checkpoint.

Full scale (a pod; the AOT check first proves it fits):
  python -m c2.aot --config experiments/pretrain.py:full
  launch/run.sh --tpu NAME --zone ZONE --config experiments/pretrain.py:full --workdir gs://B/runs/cpt
Variants: tiny | copy_drills, copy_drills_128, copy_drills_512 (the RL pipeline's phase 1b,
experiments/rl.py) | needles (from copy_drills_512: a language model that retrieves, the start of
experiments/extend_256k.py's retrieval result) | proxy | full (shapes and layouts:
experiments/layouts.py). Override anything: --config.optim.peak_lr=1e-4.
MTP attached from a mid-run checkpoint: --config.train.init_from=gs://B/runs/cpt/ckpt (the MTP
modules the checkpoint lacks are freshly initialised, everything else restored).
"""
import ml_collections

from c2.config import default_config
from experiments import layouts


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  variant = arg or "tiny"
  c = default_config("pretrain", preset="tiny")  # every field, at its dataclass default
  c.name = f"pretrain-{variant}"
  # tiny: sized so the schedule completes in ~8 minutes on 2 CPU cores.
  c.optim.update(peak_lr=3e-3, warmup_steps=20)
  c.train.update(steps=240, max_minutes=9.5, eval_every=60, eval_batches=4, ce_chunk_size=1024,
                 z_loss_weight=1e-4, balance_loss_weight=1e-4)
  c.checkpoint.update(every_steps=60)

  if variant == "tiny":
    pass
  elif variant in ("copy_drills", "copy_drills_128", "copy_drills_512"):
    # Phase 1b of the tiny RL pipeline (experiments/rl.py): copy drills over the tokens of the
    # oracle's tool-call arguments, until an induction circuit forms on them and reaches as far
    # back as tool calls copy from (c2/data/copy_drills.py). Three runs, each from the previous
    # one's checkpoint; the loss is on copies only, so MTP (it would distil the main head on random
    # tokens) is off. Held-out copy loss, measured 2026-12-05 (alphabet entropy 5.58 nats):
    #   copy_drills (from runs/tiny): rows of 48, each span copied right after itself. The
    #     circuit formed between steps 1,500 and 1,750 (4.60 -> 1.02; 0.10 at 2,000), ~11 min.
    #     It copies only nearby spans: copied up to 128 / 512 tokens away, 7.9 / 10.6 nats.
    #   copy_drills_128: rows of 128, spans of up to 23 tokens copied anywhere later. 0.25 at
    #     step 100 (the circuit stretches at once), ~1 minute.
    #   copy_drills_512: rows of 512, the same. 0.34 / 0.28 / 0.31 at steps 100 / 200 / 300.
    #   Going from rows of 48 straight to 512 did not work: 5.61 after 1,400 steps.
    c.data.update(source="copy_drills:runs/agentic-data/train-*.jsonl", seq_len=48,
                  global_batch_size=32)
    c.optim.update(peak_lr=1e-3, schedule="cosine", warmup_steps=10, min_lr_ratio=1.0)
    c.train.update(steps=2000, max_minutes=None, eval_every=250, eval_batches=2,
                   mtp_weight=0.0, z_loss_weight=0.0, balance_loss_weight=0.0)
    c.checkpoint.update(every_steps=250, keep=2)
    far = {"copy_drills_128": (128, 12, 200), "copy_drills_512": (512, 4, 300)}  # rows, batch, steps
    if variant in far:
      rows, batch, steps = far[variant]
      # float32 compute: faster than bfloat16 on CPU at these shapes (2.0 vs 1.7 steps/s at 512).
      c.model.dtype = "float32"
      c.data.update(seq_len=rows, global_batch_size=batch, copy_drill_span=23)
      c.train.update(steps=steps, eval_every=100)
      c.checkpoint.update(every_steps=100)
  elif variant == "needles":
    # Phase 1c, a language model that retrieves: the copy-drilled checkpoint (runs/copy-512, whose
    # drills cost it its language modelling: held-out CE 10.96) back on the code corpus at 256
    # tokens, with half the documents carrying a needle (a span of up to 64 of its tokens copied
    # over a later part of it, loss on the copy; c2/data/examples.py). Measured 2026-12-05, 240
    # steps (~17 min beside other jobs): held-out CE 10.96 -> 3.70 (runs/tiny: ~4.0); RULER
    # retrieval_nats (8 examples per task) at 64 / 128 / 256 tokens 27.9 / 24.8 / 15.2 -> 10.5 /
    # 7.1 / 3.6: it keeps some of the drills' retrieval while it relearns the corpus. The start
    # checkpoint of the long-context extension's retrieval result (experiments/extend_256k.py).
    c.data.update(repeat_fraction=0.5, copy_drill_span=64, tokenizer="runs/tiny/tokenizer.json")
    c.optim.update(peak_lr=1e-3)
    c.train.update(init_from="runs/copy-512/ckpt", max_minutes=60.0, eval_suites="ruler",
                   eval_suites_every=240, eval_at_start=True)
  elif variant == "proxy":
    layouts.proxy(c)
    c.data.update(source="arrayrecord:gs://BUCKET/cpt/{split}-*.arrayrecord")
    c.optim.update(peak_lr=3e-4, warmup_steps=500)
    c.train.update(steps=20000, eval_every=1000)
    c.checkpoint.update(every_steps=500)
  elif variant == "full":
    layouts.full(c)
    c.data.update(source="arrayrecord:gs://BUCKET/cpt/{split}-*.arrayrecord")
    c.optim.update(peak_lr=2e-5, warmup_steps=200, min_lr_ratio=0.35)
    c.train.update(steps=50000, eval_every=1000)
    c.checkpoint.update(every_steps=250)
  else:
    raise ValueError(f"unknown variant {variant!r}; choose tiny, copy_drills, copy_drills_128, "
                     "copy_drills_512, needles, proxy or full")
  return c


def get_sweep():
  """Peak learning-rate sweep of the tiny preset (see launch/sweep.py)."""
  return [{"optim.peak_lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
