#!/usr/bin/env bash
# Train on THIS host; the one command every host of a run executes, identically (launch/run.sh
# starts it on all TPU VM workers, launch/xpk.sh in every pod):
#   python -m c2.main --config=EXPERIMENT --workdir=WORKDIR [overrides]
# with the TPU flags of launch/env.sh and the venv of launch/bootstrap.sh. Output is teed to
# $C2_LOGS/<run>-<host>.log and, when training ends, copied to WORKDIR/logs/<host>.log, so the
# logs of all workers sit next to the run's checkpoints and curves.
#
# usage: launch/worker.sh [--dry-run] EXPERIMENT WORKDIR [-- --config.key=value ...]

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

# save_log LOG DEST: copy the host's log into the workdir (gs:// needs gcloud, as on TPU VMs;
# in pods without it the log stays in the pod's stdout, which GKE already keeps per worker).
save_log() {
  if [[ $2 != gs://* ]]; then
    execute mkdir -p "$(dirname "$2")"
    execute cp "$1" "$2"
  elif command -v gcloud >/dev/null || dry; then
    execute gcloud storage cp "$1" "$2"
  else
    note "no gcloud here; log kept at $1"
  fi
}

main() {
  parse_args "" "$@"
  expect_args 2 "EXPERIMENT WORKDIR"
  local experiment=${ARGS[0]} workdir=${ARGS[1]%/} python=python3 host log rc
  [[ -x $C2_VENV/bin/python ]] && python=$C2_VENV/bin/python
  host=$(hostname)
  log=$C2_LOGS/$(basename "$workdir")-$host.log
  cd "$REPO_ROOT"
  local train=("$python" -m c2.main --config="$experiment" --workdir="$workdir" "${OVERRIDES[@]}")
  if dry; then
    echo "$(shell_quote "${train[@]}") 2>&1 | tee -a $(shell_quote "$log")"
  else
    mkdir -p "$C2_LOGS"
    note "$(shell_quote "${train[@]}") (log: $log)"
    set +e
    "${train[@]}" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
  fi
  save_log "$log" "$workdir/logs/$host.log"
  return "${rc:-0}"
}

main "$@"
