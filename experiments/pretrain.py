"""Phase 1 of Composer 2: continued pretraining of the Kimi-K2.5 MoE at 32k tokens, with MTP.

Launch (CPU, the embedded stdlib corpus, no download; ends by itself in about 10 minutes):
  python -m c2.main --config experiments/pretrain.py:tiny --workdir runs/tiny
Expected (measured on 2 CPU cores, ~2 s/step): held-out CE falls from ~8.3 (ln 4096) to ~4.0
nats/token, far below the held-out unigram entropy (6.14 nats/token); MTP top-1 agreement with
the main head rises. Rerunning the command resumes from the last checkpoint.

Full scale (a pod; the AOT check first proves it fits):
  python -m c2.aot --config experiments/pretrain.py:full
  launch/run.sh --tpu NAME --zone ZONE --config experiments/pretrain.py:full --workdir gs://B/runs/cpt
Variants: tiny | proxy | full (shapes and layouts: experiments/layouts.py). Override anything:
--config.optim.peak_lr=1e-4.
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
    raise ValueError(f"unknown variant {variant!r}; choose tiny, proxy or full")
  return c


def get_sweep():
  """Peak learning-rate sweep of the tiny preset (see launch/sweep.py)."""
  return [{"optim.peak_lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
