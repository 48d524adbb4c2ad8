#!/usr/bin/env bash
# Bootstrap THIS host: a virtualenv ($C2_VENV) holding this repo as `pip install -e .[tpu]`.
# Runs on every TPU VM worker (launch/setup.sh) and in every xpk pod (launch/xpk.sh).
# Idempotent: the venv is created only when missing, and pip runs only when setup.py differs
# from the copy saved at the last successful install, so a rerun costs a second.
#
# usage: launch/bootstrap.sh [--dry-run]

set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/env.sh"   # TPU flags and defaults
source "$here/lib.sh"   # flag parsing, --dry-run

# setup.py wants Python >= 3.11; TPU VM images before Ubuntu 24.04 ship 3.10, so fetch 3.11
# with uv there.
ensure_venv() {
  if [[ -x $C2_VENV/bin/python ]]; then
    note "venv $C2_VENV exists"
    return
  fi
  if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    execute python3 -m venv "$C2_VENV"
  else
    execute python3 -m pip install --user --quiet uv
    execute "$HOME/.local/bin/uv" venv --seed --python 3.11 "$C2_VENV"
  fi
}

install_repo() {
  local stamp=$C2_VENV/c2-installed-setup.py
  if cmp -s setup.py "$stamp"; then
    note "c2 already installed from this setup.py"
    return
  fi
  execute "$C2_VENV/bin/pip" install --quiet --upgrade pip
  execute "$C2_VENV/bin/pip" install --quiet -e '.[tpu]'
  execute cp setup.py "$stamp"   # only after pip succeeded
}

main() {
  parse_args "" "$@"
  expect_args 0 "no positional arguments"
  cd "$REPO_ROOT"
  ensure_venv
  install_repo
}

main "$@"
