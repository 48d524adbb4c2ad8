#!/usr/bin/env bash
# AOT-compile the training step for a TPU topology on this CPU host, before anyone books the
# pod: `python -m c2.aot --config=EXPERIMENT --topology=TOPOLOGY`. It reports HBM use and fails
# with the same out-of-memory or sharding error the pod would hit. No TPU needed, but libtpu
# is (pip install -e '.[tpu]').
#
# usage: launch/aot.sh EXPERIMENT TOPOLOGY [-- more c2.aot flags / --config.key=value ...]
#   e.g. launch/aot.sh experiments/pretrain.py:full v5p-8192
#        launch/aot.sh experiments/pretrain.py:proxy tpu7x-128 -- --config.mesh.expert=8
# options: --dry-run (print the command instead of running it)
# TOPOLOGY takes the accelerator-type names of `gcloud compute tpus` (v5p-256, v6e-256,
# tpu7x-128); c2.aot maps each to its device layout (v5p names count TensorCores, so v5p-256
# is 128 chips, one device per chip in megacore mode).
# The compile sees the production TPU flags (LIBTPU_INIT_ARGS from launch/env.sh); the local
# backend is CPU (JAX_PLATFORMS=cpu) and libtpu does not query the GCE metadata server
# (TPU_SKIP_MDS_QUERY=1), as in MaxText's CPU compile tests.

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

main() {
  parse_args "" "$@"
  expect_args 2 "EXPERIMENT TOPOLOGY"
  cd "$REPO_ROOT"
  execute env JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 "${C2_PYTHON:-python3}" -m c2.aot \
    --config="${ARGS[0]}" --topology="${ARGS[1]}" "${OVERRIDES[@]}"
}

main "$@"
