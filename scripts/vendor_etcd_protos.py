"""Copy etcd's own v3 API protos (Debian golang-etcd-server-dev) into proto/etcd/, stripped.

The gogoproto and google.api annotations only matter to Go and the HTTP gateway; without
them the files compile with plain grpcio-tools. Run once when updating etcd's API;
the stripped copies are committed, so building never needs the Debian package.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

SRC = Path("/usr/share/gocode/src/go.etcd.io/etcd")
DST = Path(__file__).resolve().parent.parent / "proto" / "etcd"
FILES = {
    "etcdserver/etcdserverpb/rpc.proto": "etcdserverpb/rpc.proto",
    "mvcc/mvccpb/kv.proto": "mvccpb/kv.proto",
    "auth/authpb/auth.proto": "authpb/auth.proto",
}


def strip(text: str) -> str:
    text = re.sub(r"\s*option \(google\.api\.http\) = \{.*?\};", "", text, flags=re.S)
    text = re.sub(r"^.*gogoproto.*\n", "", text, flags=re.M)
    text = re.sub(r'^import "google/api/annotations.proto";\n', "", text, flags=re.M)
    # Imports are rooted at proto/: etcd/<pkg>/<file>.proto.
    text = text.replace('import "etcd/mvcc/mvccpb/kv.proto"', 'import "etcd/mvccpb/kv.proto"')
    text = text.replace('import "etcd/auth/authpb/auth.proto"', 'import "etcd/authpb/auth.proto"')
    # An rpc whose options block was removed keeps an empty body: `{ }` -> `{}`.
    text = re.sub(r"\{\s*\}", "{}", text)
    return "// Vendored from etcd v3.4 (stripped of gogoproto/google.api options).\n" + text


def main() -> int:
    if not SRC.is_dir():
        print(f"error: {SRC} missing; apt-get install golang-etcd-server-dev", file=sys.stderr)
        return 1
    for src, dst in FILES.items():
        out = DST / dst
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(strip((SRC / src).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
