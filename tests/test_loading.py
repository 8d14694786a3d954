"""Model cache publishing: a converted checkpoint goes into place whole, and concurrent first loads agree."""

from pathlib import Path

import pytest

from byblock.models.loading import _gguf_cache_dir, prune_model_cache, publish_dir
from byblock.models.registry import BUILTIN_MODELS, resolve_builtin


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


def test_cache_key_follows_the_bytes_not_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same GGUF in two virtualenvs shares one conversion; a changed file gets its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b, c = (tmp_path / d / "m.gguf" for d in ("venv1", "venv2", "venv3"))
    for path, data in ((a, b"GGUF same"), (b, b"GGUF same"), (c, b"GGUF other")):
        path.parent.mkdir()
        path.write_bytes(data)
    assert _gguf_cache_dir(a) == _gguf_cache_dir(b)
    assert _gguf_cache_dir(a) != _gguf_cache_dir(c)
    assert _gguf_cache_dir(a).parent == tmp_path / "cache" / "byblock" / "models"


def test_prune_keeps_only_the_installed_builtins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale conversions (an old key, a half-written temporary) go; an installed built-in's current one stays."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    installed = [n for n, m in BUILTIN_MODELS.items() if m.installed()]
    models = tmp_path / "cache" / "byblock" / "models"
    models.mkdir(parents=True)
    keep = [_gguf_cache_dir(resolve_builtin(n)) for n in installed]
    for d in keep:
        _checkpoint(d, "current")
        (d.with_name(d.name + ".quant")).mkdir()
    stale = [_checkpoint(models / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef", "old"), models / ".tmp-xyz"]
    stale[1].mkdir()
    (stale[1] / "model.safetensors").write_bytes(b"x" * 1000)
    gone, freed = prune_model_cache()
    assert sorted(gone) == sorted(stale)
    assert freed == len("old") + 1000
    assert all(d.is_dir() and d.with_name(d.name + ".quant").is_dir() for d in keep)
    assert prune_model_cache() == ([], 0)
