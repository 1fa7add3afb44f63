"""The committed stubs under proto/pdserve/v1 and proto/externalscaler (KEDA's protocol) are exactly what grpc_tools.protoc generates from the .proto files."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PROTO_DIRS = (Path("proto/pdserve/v1"), Path("proto/externalscaler"))
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


@pytest.mark.parametrize("proto_dir", PROTO_DIRS, ids=str)
def test_generated_stubs_are_fresh(tmp_path, proto_dir):
    (tmp_path / proto_dir).mkdir(parents=True)
    protos = sorted((REPO / proto_dir).glob("*.proto"))
    assert protos, "no .proto files found"
    for proto in protos:
        shutil.copy(proto, tmp_path / proto_dir / proto.name)
    rel = [str(proto_dir / p.name) for p in protos]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *rel],
        cwd=tmp_path, check=True, timeout=60,
    )
    generated = sorted(p.name for p in (tmp_path / proto_dir).iterdir() if p.name.endswith(SUFFIXES))
    committed = sorted(p.name for p in (REPO / proto_dir).iterdir() if p.name.endswith(SUFFIXES))
    assert generated == committed, "stub file set differs: run scripts/gen_proto.sh"
    stale = [n for n in generated if (tmp_path / proto_dir / n).read_bytes() != (REPO / proto_dir / n).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run scripts/gen_proto.sh"


@pytest.mark.parametrize("proto_dir", PROTO_DIRS, ids=str)
def test_every_rpc_and_field_has_a_comment(proto_dir):
    for proto in sorted((REPO / proto_dir).glob("*.proto")):
        lines = proto.read_text().splitlines()
        for index, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "//"))
            is_field = is_field and not stripped.startswith(("syntax", "package"))
            if stripped.startswith("rpc ") or is_field:
                assert lines[index - 1].strip().startswith("//"), f"{proto.name}:{index + 1} lacks a // comment"
