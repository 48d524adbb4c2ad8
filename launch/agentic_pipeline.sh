#!/usr/bin/env bash
# The tiny agentic pipeline on this machine, in one command: pretrain -> oracle transcripts ->
# copy drills -> tool-use SFT -> RL on the level-1 coding tasks (CPU, embedded corpus, no
# download). Each phase writes under runs/ (the paths the experiment files name) and is skipped
# or resumed when rerun: c2.main resumes a workdir from its last checkpoint and returns at once
# when it is finished; transcript files that exist are kept. The minutes each phase took go to
# runs/pipeline-times.tsv and are printed at the end.
#
# usage: launch/agentic_pipeline.sh [--sft-rounds N] [--dry-run] [-- --config.key=value ...]
#   everything after `--` goes to the RL run, e.g. -- --config.train.steps=30
# Options:
#   --sft-rounds N   tool-use SFT runs of 140 steps, each from the last (default 5). The first
#                    (first two, when N >= 3) on the oracle transcripts; every later one on
#                    recovery transcripts (--slip-fraction 0.5) of the next task seed: 0 (the
#                    oracle rounds' tasks), 1, 2, ... Held-out greedy pass rate after 3 / 5
#                    rounds 0.055 / 0.289 (128 tasks; 0.266 with rounds 4-5 on round 3's data:
#                    README "Agentic RL"). One lucky draw: with the SFT's data order changed
#                    (data.seed 1 / 2) the five rounds passed 0.008 / 0.055
#   --dry-run        print the commands instead of running them
# Uses $C2_PYTHON (default python3); runs in the repo root.

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"
source "$here/lib.sh"

TOKENIZER=runs/tiny/tokenizer.json
TIMES=runs/pipeline-times.tsv

# phase NAME CMD...: run one phase and append its wall time (minutes) to $TIMES.
phase() {
  local name=$1 start
  shift
  start=$(date +%s)
  execute "$@"
  if ! dry; then
    awk -v name="$name" -v s=$(($(date +%s) - start)) 'BEGIN { printf "%s\t%.1f\n", name, s / 60 }' \
      >> "$TIMES"
  fi
}

# train NAME EXPERIMENT WORKDIR [OVERRIDES...]: one c2.main run as a phase.
train() {
  local name=$1 experiment=$2 workdir=$3
  shift 3
  phase "$name" "$PY" -m c2.main --config="$experiment" --workdir="$workdir" "$@"
}

# transcripts NAME DIR [FLAGS...]: oracle transcripts of level-1 tasks, unless DIR has them.
transcripts() {
  local name=$1 dir=$2
  shift 2
  if [[ -s $dir/train-00000.jsonl && -s $dir/heldout-00000.jsonl ]] && ! dry; then
    note "$dir has its transcripts: kept"
    return
  fi
  phase "$name" "$PY" -m c2.envs.transcripts --out "$dir" --levels 1 \
    --tools read_file,edit_file,finish --tool-declaration compact "$@"
}

main() {
  parse_args "sft-rounds" "$@"
  expect_args 0 "no positional arguments"
  local rounds=${C2_SFT_ROUNDS:-5} init tok="--config.data.tokenizer=$TOKENIZER"
  [[ $rounds =~ ^[1-9][0-9]*$ ]] || die "--sft-rounds must be a positive integer, got $rounds"
  PY=${C2_PYTHON:-python3}
  cd "$REPO_ROOT"
  dry || mkdir -p runs
  dry || printf 'phase\tminutes\n' > "$TIMES"

  train pretrain experiments/pretrain.py:tiny runs/tiny
  transcripts transcripts runs/agentic-data --count 1200
  train drills-48 experiments/pretrain.py:copy_drills runs/copy-drills \
    --config.train.init_from=runs/tiny/ckpt "$tok"
  train drills-128 experiments/pretrain.py:copy_drills_128 runs/copy-128 \
    --config.train.init_from=runs/copy-drills/ckpt "$tok"
  train drills-512 experiments/pretrain.py:copy_drills_512 runs/copy-512 \
    --config.train.init_from=runs/copy-128/ckpt "$tok"

  init=runs/copy-512/ckpt
  local round workdir data_source slip_dir oracle_rounds=2 seed
  ((rounds >= 3)) || oracle_rounds=1
  for ((round = 1; round <= rounds; round++)); do
    workdir=runs/sft-agentic; ((round == 1)) || workdir=runs/sft-agentic-$round
    data_source=()
    if ((round > oracle_rounds)); then
      # A fresh task seed per round (0.8 minutes of transcripts each): RL rose from this policy
      # (+0.043, +0.023, +0.043 over three seeds), not from the one trained on seed 0 thrice
      # (+0.004; README "Agentic RL"); one SFT draw each, and SFT draws vary widely (the help
      # above). Seed 0 keeps the three-round pipeline's directory name.
      seed=$((round - oracle_rounds - 1))
      slip_dir=runs/agentic-slip; ((seed == 0)) || slip_dir=runs/agentic-slip-s$seed
      transcripts "transcripts-slip-$seed" "$slip_dir" --count 1200 --heldout-count 300 \
        --slip-fraction 0.5 --seed "$seed"
      data_source=("--config.data.source=jsonl:$slip_dir/{split}-*.jsonl")
    fi
    train "sft-$round" experiments/sft.py:agentic "$workdir" \
      --config.train.init_from="$init" "$tok" "${data_source[@]}"
    init=$workdir/ckpt
  done

  train rl experiments/rl.py:tiny runs/rl-tiny --config.train.init_from="$init" "$tok" \
    "${OVERRIDES[@]}"
  if ! dry; then
    note "minutes per phase ($TIMES):"
    column -t "$TIMES" >&2
    note "RL curves: tensorboard --logdir runs/rl-tiny/tb"
  fi
}

main "$@"
