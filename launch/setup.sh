#!/usr/bin/env bash
# Put this repo on every worker of a TPU VM slice and bootstrap it (launch/bootstrap.sh: a venv
# with `pip install -e .[tpu]`). Idempotent: a rerun re-syncs the code, reuses the venv and only
# reinstalls when setup.py changed. launch/run.sh calls it before every run.
#
# usage: launch/setup.sh --tpu NAME --zone ZONE [--project P] [--repo-url URL [--ref REF]]
#   default     copy: tar this working tree (no .git, caches or run outputs), scp it to all
#               workers and swap it in for ~/c2 (files deleted here disappear there too)
#   --repo-url  clone URL on each worker instead; later runs fetch --ref (default main) and
#               check it out
#   --dry-run   print the commands instead of running them

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

copy_tree() {
  local tarball=${TMPDIR:-/tmp}/c2-sync.tar.gz dir=$C2_REMOTE_DIR
  execute tar -czf "$tarball" --exclude-vcs --exclude-vcs-ignores --exclude=.venv \
    --exclude=__pycache__ --exclude='*.egg-info' --exclude=runs -C "$REPO_ROOT" .
  gcloud_tpus tpu-vm scp "$tarball" "$C2_TPU:c2-sync.tar.gz" --worker=all
  # Unpack beside the old tree, then swap, so a rerun leaves exactly this tree behind.
  on_all_workers "rm -rf $dir.new && mkdir -p $dir.new && tar -xzf c2-sync.tar.gz -C $dir.new \
&& rm -rf $dir && mv $dir.new $dir"
}

clone_tree() {
  local url ref dir=$C2_REMOTE_DIR
  url=$(shell_quote "$C2_REPO_URL")
  ref=$(shell_quote "${C2_REF:-main}")
  on_all_workers "{ test -d $dir/.git || git clone -q $url $dir; } \
&& git -C $dir fetch -q origin $ref && git -C $dir checkout -q --force FETCH_HEAD"
}

main() {
  parse_args "tpu zone project repo-url ref" "$@"
  expect_args 0 "no positional arguments"
  require C2_TPU C2_ZONE
  if [[ -n ${C2_REPO_URL:-} ]]; then clone_tree; else copy_tree; fi
  on_all_workers "bash $C2_REMOTE_DIR/launch/bootstrap.sh"
}

main "$@"
