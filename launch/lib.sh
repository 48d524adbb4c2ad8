# shellcheck shell=bash
# launch/lib.sh: helpers shared by the launch scripts: flag parsing, --dry-run, gcloud wrappers.
#
# Flags map onto C2_* variables (--num-slices N sets C2_NUM_SLICES=N and exports it), so a flag
# and an exported variable are interchangeable, and a script called by another inherits them.
# With C2_DRY_RUN=1 (--dry-run), `execute` prints each command as one copy-pasteable shell
# line on stdout instead of running it; notes go to stderr, so stdout stays a valid script.

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034  # used by the scripts that source this file
REPO_ROOT=$(dirname "$LAUNCH_DIR")
BOOL_FLAGS=" dry-run queued spot detach no-setup "   # every other flag takes a value
ARGS=()        # positional arguments
OVERRIDES=()   # everything after `--`, passed through untouched (e.g. --config.optim.peak_lr=1e-4)

die() { echo "error: $*" >&2; exit 1; }
note() { echo "[c2] $*" >&2; }
dry() { [[ ${C2_DRY_RUN:-} == 1 ]]; }

# The calling script's header comment (from line 2 to the first non-comment line) is its usage.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

# parse_args "FLAG NAMES THIS SCRIPT ACCEPTS" "$@": fills C2_*, ARGS and OVERRIDES.
parse_args() {
  local allowed=" $1 dry-run " name value var
  shift
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --) shift; OVERRIDES+=("$@"); break ;;
      --*=*) name=${1%%=*}; name=${name#--}; value=${1#*=} ;;
      --*) name=${1#--}; value=1
        if [[ $BOOL_FLAGS != *" $name "* ]]; then
          (($# >= 2)) || die "--$name needs a value"
          value=$2; shift
        fi ;;
      -?*) die "unknown flag $1 (see $0 -h)" ;;
      *) ARGS+=("$1"); shift; continue ;;
    esac
    [[ $allowed == *" $name "* ]] || die "unknown flag --$name (see $0 -h)"
    var=${name^^}
    declare -gx "C2_${var//-/_}=$value"
    shift
  done
}

# require C2_TPU C2_ZONE ...: fail with the flag to pass when one is unset.
require() {
  local var flag
  for var in "$@"; do
    flag=${var#C2_}; flag=${flag,,}; flag=${flag//_/-}
    [[ -n ${!var:-} ]] || die "missing --$flag (or export $var); see $0 -h"
  done
}

# expect_args N "NAME ...": exactly N positional arguments.
expect_args() {
  ((${#ARGS[@]} == $1)) || die "expected $2, got ${#ARGS[@]} argument(s); see $0 -h"
}

# shell_quote ARGS...: one line that a shell parses back into exactly these arguments.
shell_quote() {
  local out=() arg q="'\\''"
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$arg"); else out+=("'${arg//\'/$q}'"); fi
  done
  echo "${out[*]}"
}

# execute CMD...: run it (echoing it to stderr) or, in a dry run, print it.
execute() {
  if dry; then shell_quote "$@"; return; fi
  note "+ $(shell_quote "$@")"
  "$@"
}

# gcloud compute tpus ... with the zone and (optional) project every such call needs.
gcloud_tpus() {
  execute gcloud compute tpus "$@" --zone="$C2_ZONE" ${C2_PROJECT:+"--project=$C2_PROJECT"}
}

# on_all_workers 'SHELL COMMAND': run it on every host of the slice at once.
on_all_workers() { gcloud_tpus tpu-vm ssh "$C2_TPU" --worker=all --command "$1"; }

# Remote command: stop c2 training on a worker (TERM, up to 30 s grace, then KILL) and drop the
# libtpu lock a killed process leaves behind. The bracketed pattern matches `-m c2.main` but
# not this command line itself.
# shellcheck disable=SC2016  # $(seq 30) is for the worker's shell
STOP_TRAINING='pkill -TERM -f "[-]m c2[.]main" || true; for _ in $(seq 30); do
pgrep -f "[-]m c2[.]main" >/dev/null || break; sleep 1; done;
pkill -KILL -f "[-]m c2[.]main" || true; rm -f /tmp/libtpu_lockfile'
STOP_TRAINING=${STOP_TRAINING//$'\n'/ }
