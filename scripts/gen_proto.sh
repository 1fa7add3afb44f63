#!/usr/bin/env bash
# Regenerates the committed Python stubs in proto/pdserve/v1 and proto/externalscaler (run from anywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/pdserve/v1/*.proto
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/externalscaler/*.proto
