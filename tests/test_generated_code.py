"""The committed protobuf code is exactly what scripts/gen_proto.py generates."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_proto_files_use_package_paths() -> None:
    protos = [p.relative_to(ROOT / "proto") for p in (ROOT / "proto").rglob("*.proto")]
    assert protos, "no .proto files"
    assert all(len(p.parts) >= 2 for p in protos), f"bare proto file names: {protos}"
    from kvpool_proto.kvpool.v1 import meta_pb2

    assert meta_pb2.DESCRIPTOR.name == "kvpool/v1/meta.proto"
