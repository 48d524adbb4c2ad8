"""Phase 4 of Composer 2: asynchronous agentic RL on coding tasks (c2/rl, the step c2/steps/rl.py).

Each step trains on rl.groups_per_step groups of rl.group_size rollouts of one task each, run by
the inference engine (c2/infer) in the sandboxed coding environment (c2/envs) and graded by hidden
tests; advantages are group-relative (Dr. GRPO), the router replays the sampler's experts, and
tokens lag the learner by at most rl.max_staleness versions. Weights go to the engines as
snapshots and bf16 deltas (c2/rl/publication.py) while rollouts continue.

The tiny pipeline (CPU, no download): pretrain -> copy drills on the tokens the tasks copy (the
induction circuit the tiny pretraining lacks, c2/data/copy_drills.py) -> tool-use SFT on oracle
transcripts -> RL on the level-1 generated tasks (what was measured, and what is not reached yet,
in the README section "Agentic RL"). One command runs all of it, resumable, and writes the minutes
per phase to runs/pipeline-times.tsv: `launch/agentic_pipeline.sh` (five SFT rounds, the last
three on recovery transcripts of task seeds 0, 1 and 2). Its steps with `--sft-rounds 1`, one by
one:
  python -m c2.main --config experiments/pretrain.py:tiny --workdir runs/tiny
  python -m c2.envs.transcripts --out runs/agentic-data --count 1200 --levels 1 \
    --tools read_file,edit_file,finish --tool-declaration compact
  python -m c2.main --config experiments/pretrain.py:copy_drills --workdir runs/copy-drills \
    --config.train.init_from=runs/tiny/ckpt --config.data.tokenizer=runs/tiny/tokenizer.json
  python -m c2.main --config experiments/pretrain.py:copy_drills_128 --workdir runs/copy-128 \
    --config.train.init_from=runs/copy-drills/ckpt --config.data.tokenizer=runs/tiny/tokenizer.json
  python -m c2.main --config experiments/pretrain.py:copy_drills_512 --workdir runs/copy-512 \
    --config.train.init_from=runs/copy-128/ckpt --config.data.tokenizer=runs/tiny/tokenizer.json
  python -m c2.main --config experiments/sft.py:agentic --workdir runs/sft-agentic \
    --config.train.init_from=runs/copy-512/ckpt --config.data.tokenizer=runs/tiny/tokenizer.json
  python -m c2.main --config experiments/rl.py:tiny --workdir runs/rl-tiny \
    --config.train.init_from=runs/sft-agentic/ckpt --config.data.tokenizer=runs/tiny/tokenizer.json
The RL run prints the held-out pass rate (with a 95% confidence interval over tasks) at the start
and every rl.eval_every steps, with its change since the start paired over the same tasks, and
where its TensorBoard curves are. Rerunning resumes. The pipeline's start policy is stronger
(README, "Agentic RL"): the SFT run four more times from its own checkpoint, once more on the
same transcripts, then on recovery transcripts (`python -m c2.envs.transcripts ... --slip-fraction
0.5`) of tasks of seeds 0, 1 and 2: held-out pass rate 0.289 greedy, 0.219 sampled (after the
first three rounds: 0.055 / 0.047). That policy is a lucky draw: the same rounds with the SFT's
data order changed (data.seed 1 / 2) pass 0.008 / 0.055 greedy (README, "Agentic RL").

Full scale (AOT fit check from a CPU host, then a pod):
  python -m c2.aot --config experiments/rl.py:full
Variants: tiny | full.
"""
import ml_collections

from c2.config import default_config
from c2.envs.config import env_section
from c2.envs.environment import EnvConfig
from c2.envs.tools import ToolConfig
from experiments import layouts

TINY_TOOLS = ("read_file", "edit_file", "finish")  # the oracle transcripts' tools (a short prompt)


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  variant = arg or "tiny"
  c = default_config("rl", preset="tiny")
  c.name = f"rl-{variant}"
  c.env = env_section(EnvConfig(tools=ToolConfig(enabled=TINY_TOOLS), max_turns=6,
                                tool_declaration="compact"))
  # A constant learning rate (cosine to min_lr_ratio 1.0) after a short warmup; no decay of the
  # weights toward zero (they start from the SFT checkpoint); the router biases keep adapting.
  c.optim.update(peak_lr=1e-4, schedule="cosine", warmup_steps=2, min_lr_ratio=1.0,
                 weight_decay=0.0, clip_norm=1.0)
  c.train.update(steps=40, max_minutes=None, log_every=1, ce_chunk_size=1024,
                 mtp_weight=0.0, balance_loss_weight=0.0)
  c.checkpoint.update(every_steps=10, keep=2)
  c.data.update(seq_len=1536, global_batch_size=16)
  c.rl.update(group_size=4, groups_per_step=4, max_staleness=1, env_workers=8,
              engine_slots=8, max_new_tokens=160, temperature=1.0, task_levels="1",
              heldout_tasks=64, eval_samples=2, eval_every=20, publish_dtype="float32",
              kl_coef=0.0)

  if variant == "tiny":
    # While few rollouts pass, penalties on failed rollouts are most of the reward's variance: with
    # the defaults the tiny policy learned to call no tool at all (1.3 calls per rollout at step 5,
    # none from step 30; measured 2026-12-05). Failed rollouts are therefore not charged for their
    # length, and malformed calls cost nothing beyond the tests they fail.
    c.env.reward.length.apply_to_failed = False
    c.env.reward.penalty_weights.malformed_tool_calls = 0.0
    # lr 3e-4 walked the policy into never calling a tool at step 29; lr 1.5e-4 with a k1 KL
    # anchor to the SFT policy did not collapse in 30 steps (0.039 -> 0.055 held out) nor in 50
    # from a rerun pipeline, where it did not rise either (0.047 -> 0.047, paired change 0.000
    # +- 0.019; measured 2026-12-05, README "Agentic RL"). 60% of those groups had equal rewards
    # (zero advantages): dropping them and sampling other tasks in their place (drop_uniform_
    # groups, 53% dropped) trains 4 groups with signal per step instead of ~1.6; 30 such steps
    # from the same SFT checkpoint: 0.047 -> 0.066, paired change +0.020 (-0.010 to +0.049);
    # that run resumed to 60 steps: 0.082 at 45, 0.090 (0.042 to 0.138) at 60, paired change
    # +0.043 (+0.009 to +0.077), pass@4 0.109 -> 0.219: beyond noise (README "Agentic RL").
    # The whole pipeline rerun from scratch with this setting (2026-12-06, new numerics): 0.047 ->
    # 0.043 at step 60, paired change -0.004 (-0.024 to +0.016): the rise is not reproducible yet.
    # A third run from that SFT checkpoint with data.seed=1 (2026-12-07): 0.074 -> 0.090, paired
    # +0.016 (-0.020 to +0.052); the three pooled: +0.010 (-0.006 to +0.025). From the stronger
    # five-round SFT policy (2026-12-07): 0.219 -> 0.262, paired +0.043 (+0.006 to +0.080), and
    # with data.seed=3 0.180 -> 0.203, +0.023 (-0.014 to +0.061), with data.seed=1 0.266 -> 0.309,
    # +0.043 (+0.006 to +0.080); pooled +0.037 (+0.015 to +0.058). From the control SFT policy
    # (rounds 4-5 on seed 0's transcripts again): 0.152 -> 0.156, +0.004 (-0.035 to +0.042).
    # lr 3e-4 (30 steps from that SFT checkpoint) made it worse beyond noise (0.047 -> 0.008): the
    # sure format tokens were pushed down until no tool call parsed; rl.min_token_entropy=0.3
    # kept them (NLL 0.053 vs 0.137) but gave no rise either (0.047 -> 0.027), so it stays off.
    # Four samples per held-out task, not two, narrow the interval's sampling part by sqrt(2);
    # evaluations at the start and the end only: dropping the one at step 30 took the phase from
    # 23.7 to ~18 min (2026-12-07); the sampled pass rate is on TensorBoard at every step.
    c.optim.peak_lr = 1.5e-4
    c.train.steps = 60
    # Engines compute in float32 (XLA:CPU's bf16 dots are slow; the learner stays bf16): 6 steps
    # from the same SFT checkpoint sampled 216 rollouts in 298 s vs 188 in 347 s in bf16 (1.34x
    # rollouts/s); sampler vs learner log-prob mismatch mean 0.002 vs 0.001, p99 0.045 vs 0.036.
    c.rl.engine_dtype = "float32"
    c.rl.update(kl_coef=0.05, eval_samples=4, eval_every=60, drop_uniform_groups="reward")
    c.train.ce_weighted_only = True  # the head projects only the sampled tokens
  elif variant == "full":
    layouts.full(c)
    # Rollout contexts up to 64k tokens, packed 2 rows x 32k per (fsdp, expert) shard pair; the
    # report's layout is EP=8 / CP=8 (see the README's RL AOT table for what was measured).
    c.data.update(seq_len=65536, global_batch_size=512)
    c.mesh.update(fsdp=-1, expert=8, context=8)
    # Splash's fused backward holds dq per kv block (T^2 / block_kv): at 64k rows in one call
    # the step needs 98.0 of 95 GiB (measured 2026-12-04); in 4 query chunks 64.0 GiB, FLOP
    # ratio 1.399 against 63.8 GiB and 1.72 with the separate kernels (2026-12-06, README);
    # with splash's heads unpadded 63.8 GiB, FLOP ratio 1.252 (2026-12-06).
    c.model.update(splash_fused_backward=True, splash_query_chunks=4)
    c.rl.update(group_size=16, groups_per_step=64, max_staleness=2, env_workers=4096,
                engines=64, engine_slots=512, draft_depth=2, max_new_tokens=16384,
                task_levels="1,2,3,4,5", train_tasks=200000, heldout_tasks=512,
                publish_dtype="bfloat16", kl_coef=1e-3, is_cap=2.0, eval_every=50)
    c.optim.update(peak_lr=1e-6, warmup_steps=10)
    # ce_chunk_size stays layouts.full's 2,048 tokens per device per loss chunk: 8,192 for the
    # whole pod made a 4,096-step chunk loop gathering the output head at every step.
    c.train.update(steps=2000)
    c.checkpoint.update(every_steps=20, keep=3)
  else:
    raise ValueError(f"unknown variant {variant!r}; choose tiny or full")
  return c
