"""The committed stubs under proto/pdserve/v1 are exactly what grpc_tools.protoc generates from the .proto files."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PROTO_DIR = Path("proto/pdserve/v1")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path):
    (tmp_path / PROTO_DIR).mkdir(parents=True)
    protos = sorted((REPO / PROTO_DIR).glob("*.proto"))
    assert protos, "no .proto files found"
    for proto in protos:
        shutil.copy(proto, tmp_path / PROTO_DIR / proto.name)
    rel = [str(PROTO_DIR / p.name) for p in protos]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *rel],
        cwd=tmp_path, check=True, timeout=60,
    )
    generated = sorted(p.name for p in (tmp_path / PROTO_DIR).iterdir() if p.name.endswith(SUFFIXES))
    committed = sorted(p.name for p in (REPO / PROTO_DIR).iterdir() if p.name.endswith(SUFFIXES))
    assert generated == committed, "stub file set differs: run scripts/gen_proto.sh"
    stale = [n for n in generated if (tmp_path / PROTO_DIR / n).read_bytes() != (REPO / PROTO_DIR / n).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run scripts/gen_proto.sh"


def test_every_rpc_and_field_has_a_comment():
    for proto in sorted((REPO / PROTO_DIR).glob("*.proto")):
        lines = proto.read_text().splitlines()
        for index, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "//"))
            is_field = is_field and not stripped.startswith(("syntax", "package"))
            if stripped.startswith("rpc ") or is_field:
                assert lines[index - 1].strip().startswith("//"), f"{proto.name}:{index + 1} lacks a // comment"
