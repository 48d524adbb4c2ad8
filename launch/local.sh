#!/usr/bin/env bash
# Train on this machine alone: the same `python -m c2.main --config=EXPERIMENT
# --workdir=WORKDIR` that every pod host runs, without ssh, venv or log shipping. For a laptop
# or CPU box (tiny configs on CPU devices) and for single-host TPU VMs.
#
# usage: launch/local.sh EXPERIMENT WORKDIR [-- --config.key=value ...] [--dry-run]
#   e.g. launch/local.sh experiments/pretrain.py:tiny /tmp/c2-runs/tiny
#        launch/local.sh experiments/pretrain.py:tiny /tmp/c2-runs/tiny -- --config.optim.peak_lr=3e-4
# Options:
#   --cpu-devices N   run on the CPU backend with N fake devices (like the tests), so the
#                     sharding code runs for real on a machine without accelerators
#   --dry-run         print the command instead of running it
# Uses $C2_PYTHON (default python3) from the current environment; paths are relative to the
# repo root, where the command runs. TPU flags come from launch/env.sh as everywhere else.

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

main() {
  parse_args "cpu-devices" "$@"
  expect_args 2 "EXPERIMENT WORKDIR"
  local run=()
  if [[ -n ${C2_CPU_DEVICES:-} ]]; then
    run=(env JAX_PLATFORMS=cpu
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$C2_CPU_DEVICES")
  fi
  cd "$REPO_ROOT"
  execute "${run[@]}" "${C2_PYTHON:-python3}" -m c2.main --config="${ARGS[0]}" \
    --workdir="${ARGS[1]}" "${OVERRIDES[@]}"
}

main "$@"
