#!/usr/bin/env bash
# Train through xpk on a GKE cluster with TPU node pools: one JobSet whose pods each run
# launch/bootstrap.sh and then launch/worker.sh, the same `python -m c2.main` as on TPU VMs
# with the same flags (launch/env.sh). xpk builds the image: this repo on $C2_XPK_BASE_IMAGE.
#
# usage: launch/xpk.sh create --cluster C --zone Z --type T EXPERIMENT WORKDIR [-- overrides]
#        launch/xpk.sh delete --cluster C --zone Z WORKDIR
#        launch/xpk.sh list   --cluster C --zone Z
#   e.g. launch/xpk.sh create --cluster c2-gke --zone us-east5 --type v5p-4096 --num-slices 2 \
#          experiments/pretrain.py:full gs://my-bucket/runs/pretrain_full -- --config.mesh.data=2
# options: --project P, --num-slices N (multislice over DCN, default 1; adds
#          --config.mesh.num_slices=N, and the mesh's data axis must be a multiple of N), --spot,
#          --dry-run (print the xpk commands instead of running them)
# The workload is named after WORKDIR (see workload_name); delete it before creating it again.

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

# workload_name WORKDIR: a Kubernetes-safe name for the run (lower-case, [a-z0-9-], <= 40
# chars): its last path component plus a hash of the whole path, so that sweep points such as
# runs/a/00_lr=0.1 and runs/b/00_lr=0.1 get different names, and `delete` finds them again.
workload_name() {
  local base=${1%/} crc
  base=${base##*/}
  base=${base,,}
  base=${base//[^a-z0-9-]/-}
  crc=$(printf %s "${1%/}" | cksum)
  printf 'c2-%s-%06x\n' "${base:0:27}" "$((${crc%% *} % 16777216))"
}

xpk() {
  execute xpk "$@" --cluster="$C2_CLUSTER" --zone="$C2_ZONE" \
    ${C2_PROJECT:+"--project=$C2_PROJECT"}
}

create() {
  expect_args 3 "create EXPERIMENT WORKDIR"
  require C2_TYPE
  local train overrides=("${OVERRIDES[@]}")
  # Multislice: the run's mesh must span the slices (its data axis goes over DCN).
  if ((${C2_NUM_SLICES:-1} > 1)); then overrides+=("--config.mesh.num_slices=$C2_NUM_SLICES"); fi
  train=$(shell_quote bash launch/worker.sh "${ARGS[1]}" "${ARGS[2]}" -- "${overrides[@]}")
  xpk workload create --workload="$(workload_name "${ARGS[2]}")" --tpu-type="$C2_TYPE" \
    --num-slices="${C2_NUM_SLICES:-1}" ${C2_SPOT:+--spot} \
    --base-docker-image="$C2_XPK_BASE_IMAGE" --script-dir="$REPO_ROOT" \
    --command="bash launch/bootstrap.sh && $train"
}

main() {
  parse_args "cluster zone project type num-slices spot" "$@"
  ((${#ARGS[@]})) || die "missing COMMAND (create, delete, list); see $0 -h"
  require C2_CLUSTER C2_ZONE
  case ${ARGS[0]} in
    create) create ;;
    delete) expect_args 2 "delete WORKDIR"
      xpk workload delete --workload="$(workload_name "${ARGS[1]}")" --force ;;
    list) xpk workload list ;;
    *) die "unknown command ${ARGS[0]}; see $0 -h" ;;
  esac
}

main "$@"
