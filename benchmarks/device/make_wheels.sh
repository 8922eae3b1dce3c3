#!/usr/bin/env bash
# Rebuild .whl/ from scratch: the wheels (and libaio .debs) the nvidia-h200 machine lacks to run
# the workflow (it has Python 3.12, torch, transformers, numpy/pandas/matplotlib/seaborn/jinja2/
# pyyaml/psutil/requests/packaging..., but no deepspeed, snakemake, pydantic, jsonschema, and no
# network). benchmarks/device/run_h200.sh installs them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Usage (repo root, a machine with pip access):  bash benchmarks/device/make_wheels.sh
# Needs: python3.12 (or PY312=/path/to/python3.12) for the sdist-only builds, apt-get for the .debs.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIST=benchmarks/device/wheels.txt
OUT=.whl
if [ -z "${PY312:-}" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
  done
fi
: "${PY312:?no python3.12 found; set PY312=/path/to/python3.12}"
PIP=(python3 -m pip)

rm -rf "$OUT"
mkdir -p "$OUT/debs"

# name==version lines of wheels.txt (comments and the sdist-built ones handled below)
mapfile -t BINARY < <(grep -v '^\s*#' "$LIST" | grep -v '^\s*$' | grep -viE '^(deepspeed|connection[-_]pool)==' | awk '{print $1}')
mapfile -t SDIST < <(grep -v '^\s*#' "$LIST" | grep -iE '^(deepspeed|connection[-_]pool)==' | awk '{print $1}')

# Published wheels for CPython 3.12 on manylinux x86_64 (pure-Python ones are py3-none-any).
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$OUT" "${BINARY[@]}"

# sdist only on PyPI: build pure-Python wheels. DeepSpeed without its C++ ops (they are compiled
# at run time on the GPU machine with its nvcc: python3 -m offload_study.admission.ops ...).
DS_BUILD_OPS=0 "$PY312" -m pip wheel -q --no-deps -w "$OUT" "${SDIST[@]}"

# libaio for DeepSpeed's async_io op (NVMe offload); unpacked with dpkg -x on the GPU machine.
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libaio1 libaio-dev >/dev/null 2>&1 || apt-get download libaio1t64 libaio-dev)
cp "$tmp"/*.deb "$OUT/debs/"
rm -rf "$tmp"

# one version per package, nothing missing
n_list=$(( ${#BINARY[@]} + ${#SDIST[@]} ))
n_whl=$(ls "$OUT"/*.whl | wc -l)
echo "wheels: $n_whl (listed: $n_list), debs: $(ls "$OUT"/debs | wc -l), size: $(du -sh "$OUT" | cut -f1)"
[ "$n_whl" -eq "$n_list" ] || { echo "wheel count differs from $LIST" >&2; exit 1; }
