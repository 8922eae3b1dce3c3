#!/usr/bin/env bash
# The Debian packages behind `make study` and `make test` (the Makefile then builds .venv and
# DeepSpeed's ops). Idempotent: when everything is there it only checks (well under a second).
#
#   scripts/setup.sh study   what the default study needs: a C++ compiler and libaio-dev for
#                            DeepSpeed's ops (async_io = NVMe offload), python3-venv/-dev if missing
#   scripts/setup.sh test    + a real SLURM (slurm-wlm, munge; the tests start their own daemons),
#                            numactl, and Chromium for the report's browser test
#
# As root on Debian/Ubuntu it installs what is missing with apt-get; otherwise it stops with one
# message that gives the exact command (as root, `make setup` does all of `make test`'s set-up).
# SKIP_DEBIAN_PACKAGES=1 skips the check (you installed the equivalents yourself, e.g. on another
# distribution).
set -euo pipefail

PYTHON=${PYTHON:-python3}
STUDY_PACKAGES=(g++ libaio-dev)
TEST_PACKAGES=("${STUDY_PACKAGES[@]}" slurm-wlm munge numactl chromium)

case "${1:-}" in
  study) wanted=("${STUDY_PACKAGES[@]}") ;;
  test) wanted=("${TEST_PACKAGES[@]}") ;;
  *) echo "usage: $0 study|test" >&2; exit 2 ;;
esac

# Debian's own python3 needs python3-venv to make .venv and python3-dev to compile the ops.
python_packages() {
  "$PYTHON" -c 'import ensurepip' 2>/dev/null || echo python3-venv
  "$PYTHON" -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    echo python3-dev
}

missing_packages() {
  local pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' ||
      echo "$pkg"
  done
}

main() {
  local here=${BASH_SOURCE[0]%/*}
  [[ $here == "${BASH_SOURCE[0]}" ]] && here=.
  bash "$here/warn-slurm-without-controller.sh"
  [[ ${SKIP_DEBIAN_PACKAGES:-0} == 1 ]] && return 0
  if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
    echo "Not a Debian/Ubuntu machine: install the equivalents of the Debian packages" \
      "${wanted[*]} and Python's venv module and headers, then run again with" \
      "SKIP_DEBIAN_PACKAGES=1." >&2
    exit 1
  fi
  local missing
  mapfile -t missing < <(missing_packages "${wanted[@]}" $(python_packages))
  ((${#missing[@]})) || return 0
  if ((EUID != 0)); then
    echo "Missing Debian packages: ${missing[*]}. Run as root:" \
      "apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  echo "Installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/offload-study-apt.log 2>&1 ||
    { tail -30 /tmp/offload-study-apt.log >&2; exit 1; }
}

main
