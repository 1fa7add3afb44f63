"""A package index on 127.0.0.1 for an image build that cannot reach the Dockerfile's own indexes: this
machine's pip (its own config: find-links, mirrors, certificates) downloads what the image installs
(torch==TORCH_VERSION, setuptools and ninja for the build, pyproject's dependencies, at constraints.txt's
versions), and a PEP 503 tree of those files is served until the process is stopped.
    python scripts/image_index.py --dest DIR     # prints {"url": ..., "torch": ...} once serving
"""
from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torch_version() -> str:
    return re.search(r"^ARG TORCH_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), flags=re.M).group(1)


def requirements() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dependencies = [d for d in pyproject["project"]["dependencies"] if not re.match(r"torch\b", d)]
    return [f"torch=={torch_version()}", "setuptools", "ninja", *dependencies]


def download(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(folder),
                    "-c", str(REPO / "constraints.txt"), *requirements()], check=True)


def write_index(files: Path, root: Path) -> None:
    """simple/<normalized name>/index.html linking each file (PEP 503)."""
    for path in sorted(files.iterdir()):
        name = re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()
        project = root / "simple" / name
        project.mkdir(parents=True, exist_ok=True)
        link = project / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
        with open(project / "index.html", "a") as page:
            page.write(f'<a href="{html.escape(path.name)}">{html.escape(path.name)}</a>\n')


def find_links() -> list[Path]:
    """The folders pip's config names in find-links (`pip config list`), where a local torch wheel lies."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = []
    for line in listing.splitlines():
        if line.split("=", 1)[0].endswith(".find-links"):
            folders += [Path(p) for p in line.split("=", 1)[1].strip("'\"").split()]
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, required=True, help="folder for the files and the index")
    args = parser.parse_args()
    files, root = args.dest / "files", args.dest / "index"
    files.mkdir(parents=True, exist_ok=True)
    download(files)
    write_index(files, root)
    wheel = next(files.glob("torch-*.whl")).name
    origin = next((str(folder / wheel) for folder in find_links() if (folder / wheel).is_file()), "an index")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]  # quiet: the build log says enough
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    print(json.dumps({"url": f"http://127.0.0.1:{server.server_port}/simple", "torch": wheel, "from": origin,
                      "files": len(list(files.iterdir()))}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
