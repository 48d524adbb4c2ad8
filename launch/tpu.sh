#!/usr/bin/env bash
# Create, delete or inspect a TPU VM slice, directly or through a queued resource.
#
# usage: launch/tpu.sh COMMAND --tpu NAME --zone ZONE [options] [-- REMOTE COMMAND]
#   create   create the slice unless it exists (needs --type); rerunning is a no-op
#            --queued: ask for it as a queued resource (waits for capacity; see `status`)
#            --spot:   spot capacity
#   delete   delete the slice, or its queued resource (which takes the slice with it)
#   status   describe the slice (or the queued resource with --queued)
#   ssh      run the command after `--` on every worker, e.g. -- 'tail -n 20 c2-logs/*.log'
#   stop     stop c2 training on every worker (frees the TPU; launch/run.sh does this first)
# options: --type TYPE (v5p-128, v6e-256, tpu7x-128, ...), --project P,
#          --dry-run (print the gcloud commands instead of running them)
# The TPU software image comes from the type; C2_RUNTIME overrides it.
#
#   launch/tpu.sh create --tpu c2-v5p --zone us-east5-a --type v5p-128 --queued --spot

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

# TPU VM software image for an accelerator type (https://cloud.google.com/tpu/docs/runtimes).
runtime_for() {
  if [[ -n ${C2_RUNTIME:-} ]]; then echo "$C2_RUNTIME"; return; fi
  case $1 in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    tpu7x-*) echo v2-alpha-tpu7-ubuntu2404 ;;
    *) die "no default TPU runtime for '$1'; set C2_RUNTIME" ;;
  esac
}

# exists KIND DRY_ANSWER: does the tpu-vm / queued-resources named $C2_TPU exist? A dry run
# cannot ask gcloud, so it says what it assumes in a comment and answers DRY_ANSWER (yes/no).
exists() {
  if dry; then
    echo "# dry run: assuming $1 $C2_TPU $([[ $2 == yes ]] && echo exists || echo is absent)"
    [[ $2 == yes ]]
    return
  fi
  gcloud compute tpus "$1" describe "$C2_TPU" --zone="$C2_ZONE" \
    ${C2_PROJECT:+"--project=$C2_PROJECT"} >/dev/null 2>&1
}

create() {
  require C2_TYPE
  local runtime
  runtime=$(runtime_for "$C2_TYPE")
  if [[ -n ${C2_QUEUED:-} ]]; then
    exists queued-resources no && { note "queued resource $C2_TPU exists"; return; }
    gcloud_tpus queued-resources create "$C2_TPU" --node-id="$C2_TPU" \
      --accelerator-type="$C2_TYPE" --runtime-version="$runtime" ${C2_SPOT:+--spot}
  else
    exists tpu-vm no && { note "TPU VM $C2_TPU exists"; return; }
    gcloud_tpus tpu-vm create "$C2_TPU" --accelerator-type="$C2_TYPE" \
      --version="$runtime" ${C2_SPOT:+--spot}
  fi
}

delete() {
  if exists queued-resources "${C2_QUEUED:+yes}"; then
    gcloud_tpus queued-resources delete "$C2_TPU" --force --quiet
  elif exists tpu-vm yes; then
    gcloud_tpus tpu-vm delete "$C2_TPU" --quiet
  else
    note "nothing named $C2_TPU in $C2_ZONE"
  fi
}

main() {
  parse_args "tpu zone type project queued spot" "$@"
  expect_args 1 "COMMAND (create, delete, status, ssh, stop)"
  require C2_TPU C2_ZONE
  case ${ARGS[0]} in
    create) create ;;
    delete) delete ;;
    status) gcloud_tpus "$([[ -n ${C2_QUEUED:-} ]] && echo queued-resources || echo tpu-vm)" \
      describe "$C2_TPU" ;;
    ssh) ((${#OVERRIDES[@]})) || die "ssh needs a command after --"
      on_all_workers "${OVERRIDES[*]}" ;;
    stop) on_all_workers "$STOP_TRAINING" ;;
    *) die "unknown command ${ARGS[0]}; see $0 -h" ;;
  esac
}

main "$@"
