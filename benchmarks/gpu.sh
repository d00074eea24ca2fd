#!/usr/bin/env bash
# The GPU figures in one go, on a machine with one CUDA device, in under 8 minutes:
#   1. the card, torch and the CPUs;
#   2. the CUDA tests (every test file marked `gpu`);
#   3. `unickpt bench --device cuda --world 1`: the ~100M model (unickpt and DCP, sync and
#      async, up to 3 runs each) and the ~1B model (as many systems as fit, once each), with
#      the machine's disk, memcpy and GPU<->pinned host bandwidth measured in the same run.
#      `--time-budget` keeps each benchmark inside its time box: runs that would not fit are
#      reported as skipped, and the rest keep their figures.
# Every part is time-boxed and runs even when an earlier one failed. Without a CUDA device the
# tests are skipped and the benchmark runs on CPU with a tiny model (a check of this script).
#
#   bash benchmarks/gpu.sh [RESULTS_DIR]      # default: $OUT if set, else /tmp/gpu-out
#
# RESULTS_DIR receives console.log, bench-<size>.json/.md per model and bench-logs.tar.gz (every
# job's log), at most 8 files. unickpt runs from this checkout's src/ (PYTHONPATH), with
# $PYTHON (default python3). Checkpoints go to $GPU_BENCH_WORK (default: a folder under /tmp, or
# under this checkout when /tmp is in memory), removed afterwards.
set -u

cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-/tmp/gpu-out}}"
PYTHON="${PYTHON:-python3}"
TOTAL_S="${GPU_TOTAL_S:-470}" # the whole script; the last benchmark gets what is left
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/console.log") 2>&1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

part() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }
left_s() { echo $((TOTAL_S - SECONDS)); }

part "1. machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
timeout 60 "$PYTHON" - <<'EOF' || echo "python/torch check failed"
import os, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs")
print(f"cuda available: {torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
MISSING=$("$PYTHON" - <<'EOF'
import importlib.util
need = ["torch", "xxhash", "numpy", "tqdm"]  # pyproject.toml's dependencies
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
[ -n "$MISSING" ] && echo "missing dependencies of unickpt: $MISSING (the benchmark is skipped)"
for opt in pytest pytest_timeout matplotlib; do
    "$PYTHON" -c "import $opt" 2>/dev/null || echo "not installed: $opt"
done

WORK="${GPU_BENCH_WORK:-}"
if [ -z "$WORK" ]; then
    WORK=/tmp/unickpt-gpu-work
    if [ "$(df --output=fstype /tmp 2>/dev/null | tail -1)" = tmpfs ]; then
        WORK="$PWD/.gpu-work" # checkpoints on disk, not in memory
    fi
fi
mkdir -p "$WORK"
df -h "$WORK" | tail -1 | awk -v w="$WORK" '{print "checkpoints in " w ": " $1 ", " $4 " free"}'
findmnt -no FSTYPE,SOURCE -T "$WORK" 2>/dev/null | sed 's/^/filesystem: /'

part "2. CUDA tests"
mapfile -t GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu" tests/ | sort)
echo "files with gpu tests: ${GPU_TESTS[*]}"
if [ "$CUDA" = 1 ]; then TESTS_S=170; else TESTS_S=60; fi
# Only these files are collected, so the conftests of other folders (moto, S3) are not loaded.
timeout "$TESTS_S" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider --timeout=160 \
    "${GPU_TESTS[@]}" || echo "CUDA tests: exit $? (124: time box of ${TESTS_S}s)"

# bench NAME BOX_S ARGS...: one `unickpt bench` run; its json and markdown into RESULTS.
bench() {
    local name=$1 box=$2
    shift 2
    local out="$WORK/out-$name"
    if [ -n "$MISSING" ]; then echo "skipped: missing $MISSING"; return; fi
    if [ "$box" -lt 60 ]; then echo "skipped: ${box}s left"; return; fi
    timeout --kill-after=10 "$box" "$PYTHON" -m unickpt.cli.main bench --world 1 \
        --out "$out" --workdir "$WORK/ckpt-$name" --time-budget $((box - 30)) "$@" \
        || echo "bench $name: exit $? (124: time box of ${box}s)"
    cp "$out/bench.json" "$RESULTS/bench-$name.json" 2>/dev/null
    cp "$out/bench.md" "$RESULTS/bench-$name.md" 2>/dev/null
    rm -rf "$WORK/ckpt-$name"
}

if [ "$CUDA" = 1 ]; then
    part "3. benchmark, ~100M parameters, CUDA"
    bench 100m 220 --device cuda --params 100M --repeats 3 \
        --systems unickpt,unickpt-async,dcp,dcp-async-thread
    part "4. benchmark, ~1B parameters, CUDA"
    # On an H100 a 1B job takes about 100 s (its hardware job about 60 s): the async rows come
    # first (stall and time until durable), the sync ones if time allows.
    bench 1b $(($(left_s) - 10)) --device cuda --params 1B --repeats 1 \
        --systems unickpt-async,dcp-async-thread,unickpt,dcp
else
    part "3. no CUDA device: the benchmark on CPU with a tiny model (a check of this script)"
    bench tiny 120 --params 1M --repeats 1 --seq-len 16 --systems unickpt,dcp
fi

part "5. results"
tar -czf "$RESULTS/bench-logs.tar.gz" -C "$WORK" --exclude='ckpt-*' . 2>/dev/null \
    || echo "no logs to pack"
[ -z "${GPU_BENCH_WORK:-}" ] && rm -rf "$WORK"
for md in "$RESULTS"/bench-*.md; do
    [ -e "$md" ] && { echo "--- $md"; cat "$md"; }
done
ls -la "$RESULTS"
echo "done in ${SECONDS}s"
