"""The Dockerfile (which this machine cannot build: no base image can be pulled) checked as text: every
package pyproject.toml ships is copied into the build stage, the runtime stage installs no compiler and
runs as the manifests' non-root uid, and dependencies are pinned by the constraints file."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _stages() -> dict[str, str]:
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\w+)\s*$", DOCKERFILE, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_shipped_package_is_copied() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    build = _stages()["build"]
    for package in packages:
        assert re.search(rf"^COPY {package}/ {package}/$", build, flags=re.M), f"{package} is not copied"
    assert "COPY pyproject.toml setup.py ./" in build


def test_the_runtime_stage_has_no_compiler_and_runs_as_uid_10001() -> None:
    stages = _stages()
    assert set(stages) == {"build", "runtime"}
    assert "g++" in stages["build"] and "--no-build-isolation" in stages["build"]
    runtime = stages["runtime"]
    # A C compiler only when the build asks for one (GPU images: Triton's launchers); never C++.
    assert "g++" not in runtime and 'ARG RUNTIME_C_COMPILER=""' in runtime
    assert re.search(r'if \[ -n "\$RUNTIME_C_COMPILER" \]; then\s*\\\s*apt-get update', runtime)
    assert "TRITON_CACHE_DIR=/home/pdserve/.cache/triton" in runtime  # a writable emptyDir
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert re.search(r"^USER 10001:10001$", runtime, flags=re.M)
    assert "! command -v c++" in runtime  # the build fails if a compiler ever sneaks in


def test_dependencies_are_pinned_by_the_constraints_file() -> None:
    assert DOCKERFILE.count("-c constraints.txt") + DOCKERFILE.count("-c /src/constraints.txt") >= 2
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in pyproject["project"]["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", requirement)[0]).lower()
        assert name == "torch" or name in pinned, f"{name} is not pinned in constraints.txt"


def test_the_base_is_a_build_argument_pinned_by_digest() -> None:
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, flags=re.M).group(1)
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", default), default
    assert DOCKERFILE.count("FROM ${PYTHON_IMAGE} AS") == 2
    # Debian's own python3 (the CI base, scripts/image_check.sh) has no `python` command before the venv.
    assert "RUN python3 -m venv /opt/venv" in DOCKERFILE


def test_the_router_http_port_is_exposed_and_build_only_packages_are_left_out() -> None:
    exposed = re.search(r"^EXPOSE (.+)$", _stages()["runtime"], flags=re.M).group(1).split()
    assert {"8000", "50051", "50061", "50071", "9400", "20000-20099"} <= set(exposed)
    build = _stages()["build"]
    assert "pip uninstall -y setuptools ninja" in build
    assert "/nixl_ep_cu12" in build
