#!/usr/bin/env bash
# PyPI vllm-router 0.1.17 (a Rust router; the binary ships in the wheel) in its own virtualenv,
# $VLLM_ROUTER_VENV (default .venv-vllm-router): the reference `kvpool bench cross-node
# --fronts vllm-router:POLICY` measures our router against. Idempotent: fast once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_ROUTER_VENV:-.venv-vllm-router}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.vllm-router-installed"
[ -f "$stamp" ] && exit 0
echo "bootstrap: vllm-router 0.1.17 into $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "vllm-router==0.1.17"
"$VENV/bin/vllm-router" --help >/dev/null
touch "$stamp"
