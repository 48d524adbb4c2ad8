#!/usr/bin/env bash
# Train on every host of a TPU VM slice. In order, each step safe to repeat:
#   1. stop any c2 training still on the workers (so a rerun restarts; c2.main resumes from
#      the latest checkpoint in WORKDIR),
#   2. sync + bootstrap the repo on all workers (launch/setup.sh),
#   3. start launch/worker.sh, i.e. the same `python -m c2.main --config=EXPERIMENT
#      --workdir=WORKDIR`, on all workers at once (--worker=all). Every worker's log ends up in
#      WORKDIR/logs/<host>.log (and in ~/c2-logs on the worker while it runs).
#
# usage: launch/run.sh --tpu NAME --zone ZONE EXPERIMENT WORKDIR [-- --config.key=value ...]
#   e.g. launch/run.sh --tpu c2-v5p --zone us-east5-a \
#          experiments/pretrain.py:proxy gs://my-bucket/runs/pretrain_proxy
# options: --project P
#          --no-setup   skip step 2 (code and venv already in place)
#          --detach     return once started; follow with launch/tpu.sh ssh ... -- 'tail c2-logs/*'
#          --repo-url URL [--ref REF]   clone on the workers instead of copying (see setup.sh)
#          --dry-run    print the commands instead of running them
# EXPERIMENT is a path relative to the repo root, with its arg after the colon.

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

main() {
  parse_args "tpu zone project no-setup detach repo-url ref" "$@"
  expect_args 2 "EXPERIMENT WORKDIR"
  require C2_TPU C2_ZONE
  on_all_workers "$STOP_TRAINING"
  [[ -n ${C2_NO_SETUP:-} ]] || "$LAUNCH_DIR/setup.sh"
  local train
  train=$(shell_quote bash launch/worker.sh "${ARGS[@]}" -- "${OVERRIDES[@]}")
  if [[ -n ${C2_DETACH:-} ]]; then
    # setsid + nohup + no open stdout: training outlives the ssh session.
    train="setsid nohup $train >/dev/null 2>&1 < /dev/null &"
  fi
  on_all_workers "cd $C2_REMOTE_DIR && $train"
}

main "$@"
