"""Model cache publishing: a converted checkpoint goes into place whole, and concurrent first loads agree."""

from pathlib import Path

import pytest

from byblock.models.loading import publish_dir


def _checkpoint(path: Path, marker: str) -> Path:
    path.mkdir()
    (path / "config.json").write_text(marker)
    return path


def test_publish_renames_into_place(tmp_path: Path) -> None:
    tmp = _checkpoint(tmp_path / ".tmp-a", "mine")
    publish_dir(tmp, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == "mine"
    assert not tmp.exists()


def test_publish_keeps_a_concurrent_winner(tmp_path: Path) -> None:
    """Two processes converting the same GGUF: the loser's rename fails; it keeps the winner's directory."""
    winner = _checkpoint(tmp_path / "model", "theirs")
    (winner / "model.safetensors").write_text("weights")  # a non-empty directory: rename raises on Linux
    tmp = _checkpoint(tmp_path / ".tmp-b", "mine")
    publish_dir(tmp, winner)
    assert (winner / "config.json").read_text() == "theirs"
    assert not tmp.exists()


def test_publish_reraises_without_a_winner(tmp_path: Path) -> None:
    """A target that is not a finished checkpoint is a real error, not a race to paper over."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "junk").write_text("x")
    tmp = _checkpoint(tmp_path / ".tmp-c", "mine")
    with pytest.raises(OSError):
        publish_dir(tmp, tmp_path / "model")
    assert tmp.exists()
