#!/usr/bin/env bash
# The fp16 overflow check's host rate beside CPU Adam's on the device machine:
#   run(command="bash benchmarks/device/run_fp16_check.sh", carry=[".whl"])      ~3 min
# SIZES (elements, default the half-7B's partition and two smaller) and THREADS (default: the
# machine's cores, as one rank of the 1-GPU machine uses them) override.
set -uo pipefail
NAME=run_fp16_check
# shellcheck source=benchmarks/device/lib.sh
source "$(dirname "$0")/lib.sh"
device_preamble 500
export -f versions build_ops
trap 'printf "%s\n" "${SUMMARY[@]}"' EXIT
setup
timed versions 60 versions
timed ops 240 build_ops cpu_adam
timed fp16_check 400 python3 benchmarks/fp16_check.py --threads "${THREADS:-$CORES}" \
  --sizes ${SIZES:-1e8 1e9 3.5e9}
