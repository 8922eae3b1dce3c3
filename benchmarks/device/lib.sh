#!/usr/bin/env bash
# Shared by the device drivers (run_h200.sh, run_study.sh, run_x2.sh): their preamble, time
# boxing against a deadline, installing the carried wheels and libaio, versions, op builds, a
# one-line-per-record table. The caller sets NAME, sources it, then calls device_preamble.

# device_preamble DEFAULT_DEADLINE_S: the start of every driver. Starts the clock (T0), sets
# DEADLINE_S (from the environment, else the default), moves to the repository root (REPO),
# makes $OUT (the run tool's, else .device-out) and sends everything printed from here on to
# $OUT/$NAME.log too; sets CORES, SITE (where the carried wheels go), LOGS (small logs that come
# back in $OUT/extra.tar.gz) and SUMMARY=() (stage_rc's lines), and exports what children use.
device_preamble() {
  T0=$(date +%s)
  DEADLINE_S=${DEADLINE_S:-$1}
  REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  cd "$REPO" || exit 1
  OUT=${OUT:-$REPO/.device-out}
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/${NAME:?set NAME before device_preamble}.log") 2>&1
  CORES=$(nproc)
  SITE=/tmp/site
  LOGS=/tmp/logs
  mkdir -p "$LOGS"
  SUMMARY=()
  export T0 DEADLINE_S CORES SITE LOGS OUT
}

elapsed() { echo $(($(date +%s) - T0)); }
say() { echo "[${NAME:-device} +$(elapsed)s] $*"; }
# left BUDGET [reserve]: seconds this stage may use (capped by its own budget), >= 5
left() {
  local rest=$((DEADLINE_S - $(elapsed) - ${2:-25}))
  ((rest > $1)) && rest=$1
  ((rest < 5)) && rest=5
  echo "$rest"
}
stage_rc() { SUMMARY+=("$(printf '%-28s rc=%-4s %4ss' "$1" "$2" "$3")"); }
# A signalled runner writes its cancelled record after Snakemake has already exited, and the
# call's end kills what is still running: without this wait a cut run leaves a half folder and
# no record. Its ranks get a second and a SIGKILL's reap (supervise.py), so 20 s is ample.
wait_for_runners() { # wait_for_runners MAX_S
  local waited=0
  while pgrep -f offload_study.training.runner >/dev/null && ((waited < $1)); do
    sleep 1
    waited=$((waited + 1))
  done
  if pgrep -f offload_study.training.runner >/dev/null; then
    say "!! a runner still runs ${waited}s after the deadline: its record may be cut"
  else
    say "runners done ${waited}s after the deadline"
  fi
}
timed() { # timed NAME BUDGET cmd...   (SIGTERM at the limit, SIGKILL 10 s later)
  local name=$1 budget; budget=$(left "$2"); shift 2
  say "== $name (limit ${budget}s): $*"
  local t=$(date +%s)
  timeout -k 10 "$budget" bash -c '"$@"' _ "$@"
  local rc=$?
  stage_rc "$name" "$rc" $(($(date +%s) - t))
  if ((rc == 124 || rc == 137)); then
    say "!! $name timed out after ${budget}s"
    wait_for_runners 20
    find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null # killed op builds
  fi
  return $rc
}

# ---------------------------------------------------------------- environment
setup() {
  local t=$(date +%s)
  # Reinstalling rewrites every file with a new mtime, and ninja then rebuilds the JIT ops
  # (~45 s a call on a warm machine): install only when the carried wheels changed.
  local stamp wheels
  stamp="$SITE/.installed-wheels"
  wheels=$(ls -l --time-style=+ .whl/*.whl | awk '{print $5, $NF}')
  if [ "$(cat "$stamp" 2>/dev/null)" != "$wheels" ]; then
    say "install .whl -> $SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl 2>&1 | grep -v "WARNING: Target directory" || true
    printf '%s' "$wheels" >"$stamp"
  else
    say "wheels already installed in $SITE"
  fi
  # rules call `python`: a wrapper (a symlink would lose the image's venv)
  mkdir -p /tmp/pybin
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >/tmp/pybin/python
  chmod +x /tmp/pybin/python
  export PATH=/tmp/pybin:$SITE/bin:$PATH
  export PYTHONPATH=$SITE:$REPO/workflow
  export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ts_ext
  # torchao's CUDA kernels are built for another torch; its CPUOffloadOptimizer is Python alone
  export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
  # libaio (async_io op, NVMe offload): Debian's .debs unpacked privately
  local aio=/tmp/libaio
  if [ ! -e $aio/usr/include/libaio.h ]; then
    mkdir -p $aio
    for d in .whl/debs/*.deb; do
      dpkg -x "$d" $aio 2>/dev/null || python3 - "$d" $aio <<'EOF'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
pos = 8  # ar archive: "!<arch>\n", then 60-byte headers
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip(), int(data[pos + 48:pos + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[pos + 60:pos + 60 + size])).extractall(sys.argv[2])
    pos += 60 + size + (size % 2)
EOF
    done
  fi
  local lib=$aio/usr/lib/x86_64-linux-gnu
  [ -e $lib/libaio.so ] || ln -sf "$(ls $lib/libaio.so.1* | head -1)" $lib/libaio.so
  export CFLAGS="-I$aio/usr/include ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
  export CPATH=$aio/usr/include${CPATH:+:$CPATH} LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mkdir -p /tmp/offload-study-nvme
  stage_rc setup 0 $(($(date +%s) - t))
}

versions() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  echo "cores $CORES; $(free -g | awk '/Mem:/{print "RAM " $2 " GiB"}'); disk $(df -h /tmp | awk 'NR==2{print $4 " free"}')"
  timeout 120 python3 - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for n in ["torch", "deepspeed", "transformers", "snakemake", "pydantic", "jsonschema", "pandas",
          "matplotlib", "seaborn", "packaging", "typing_extensions", "nvidia-ml-py"]:
    try:
        print(f"  {n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"  {n} MISSING")
import torch
print("torch.cuda", torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
}

# cpu_adam / fused_adam / async_io compile in parallel (one process each; ninja -j per op)
build_ops() {
  local pids=() op rc=0
  # a build killed earlier leaves its lock file and every later load would wait on it forever
  find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null
  for op in "$@"; do
    python3 -m offload_study.admission.ops "$op" >"$LOGS/ops_$op.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  for op in "$@"; do tail -1 "$LOGS/ops_$op.log"; done
  return $rc
}

table() { # table RESULTS_DIR: one line per run record
  python3 - "$1" <<'EOF'
import json, pathlib, sys
print(f"{'scenario':28s} {'outcome':9s} {'tok/s':>9s} {'step s':>7s} {'TFLOP/s':>8s} {'GPU GiB':>8s} {'host GiB':>8s} {'tree GiB':>8s} {'wall s':>7s}")
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/rep*/metrics.json")):
    m = json.loads(p.read_text())
    f = lambda k, fmt: format(m[k], fmt) if isinstance(m.get(k), (int, float)) else "-"
    print(f"{m['scenario']:28s} {m['outcome']:9s} {f('tokens_per_s', '9.0f')} {f('step_time_s', '7.3f')} "
          f"{f('tflops_per_gpu', '8.1f')} {f('peak_gpu_reserved_gib', '8.1f')} "
          f"{f('host_peak_rss_gib', '8.1f')} {f('host_peak_tree_gib', '8.1f')} {f('wall_time_s', '7.1f')}")
EOF
}


# ---------------------------------------------------------------- fp16 overflow log
overflow_fixture() { # overflow_fixture CLUSTER: fp16 with an initial loss scale of 2^32, so that
  # DeepSpeed skips steps on purpose; the log is the fixture of tests/test_logparse.py
  local cluster=$1
  python3 -m snakemake plan --cores "$CORES" --scheduler greedy \
    --config study_file=config/studies/default-gpu.yaml cluster=$cluster >"$LOGS/overflow_plan.log" 2>&1
  python3 - "$cluster" <<'PY'
import json
import sys
base = f"results/{sys.argv[1]}/default-gpu/configs/zero3"
spec, ds = json.load(open(base + ".run.json")), json.load(open(base + ".json"))
ds.pop("bf16", None)
ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 32}
json.dump(ds, open("/tmp/overflow.json", "w"), indent=1)
spec.update(dtype="fp16", steps=6, warmup_steps=0, scenario="fp16-overflow", ds_config="/tmp/overflow.json")
if isinstance(spec.get("measure"), dict):
    spec["measure"]["mode"] = "fixed"  # 6 steps, every one of them skipped
json.dump(spec, open("/tmp/overflow.run.json", "w"), indent=1)
PY
  python3 -m offload_study.training.runner --spec /tmp/overflow.run.json --repeat 0 --outdir /tmp/overflow/rep0
  grep -h "OVERFLOW\|loss scale" /tmp/overflow/rep0/logs/rank0.log | head -20
}

