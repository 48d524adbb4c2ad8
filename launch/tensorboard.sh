#!/usr/bin/env bash
# Start TensorBoard on the runs bucket. Every run writes its event files to WORKDIR/tb (process
# 0 only), so pointing TensorBoard at the parent of the workdirs shows each run as one curve
# set named after its workdir; sweep points (launch/sweep.py) appear side by side.
#
# usage: launch/tensorboard.sh [LOGDIR] [--port PORT] [--dry-run]
#   LOGDIR defaults to $C2_RUNS (launch/env.sh), e.g. gs://my-bucket/runs
#   e.g. launch/tensorboard.sh gs://my-bucket/runs --port 6006
#        launch/tensorboard.sh gs://my-bucket/runs/lr_sweep   # one sweep only
# Reading gs:// needs Google credentials on this machine (gcloud auth application-default
# login). It serves on localhost only; from a remote VM, tunnel the port:
#   gcloud compute ssh VM -- -L 6006:localhost:6006

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

# TensorBoard finds event files recursively, so LOGDIR can be one run, a sweep or all runs.
main() {
  parse_args "port" "$@"
  ((${#ARGS[@]} <= 1)) || die "expected at most one LOGDIR; see $0 -h"
  local logdir=${ARGS[0]:-$C2_RUNS}
  [[ -n $logdir ]] || die "no LOGDIR given and C2_RUNS is unset; see $0 -h"
  # A resumed run appends a second event file to WORKDIR/tb; by default TensorBoard only polls
  # the newest file of a directory, so ask it to keep reading all of them.
  execute tensorboard --logdir="$logdir" --port="${C2_PORT:-6006}" --reload_multifile=true
}

main "$@"
