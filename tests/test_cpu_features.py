"""CPU feature detection behind the bf16 defaults (kernels/cpu_features.py)."""

from __future__ import annotations

from tiny import save_checkpoint

from byblock.kernels.cpu_features import cpu_flags, native_bf16


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t: x\n")
    return path


def test_native_bf16_reads_the_cpu_flags(tmp_path):
    assert native_bf16(_cpuinfo(tmp_path, "fpu sse2 avx2 fma avx512f avx512_bf16"))
    assert native_bf16(_cpuinfo(tmp_path, "fpu avx2 amx_tile amx_bf16 amx_int8"))
    # AVX512 without its bf16 extension (and AVX2-only CPUs, e.g. AMD Zen 3) emulate bf16.
    assert not native_bf16(_cpuinfo(tmp_path, "fpu sse2 avx2 fma avx512f avx512bw avx512vl"))
    assert cpu_flags(_cpuinfo(tmp_path, "a b")) == frozenset({"a", "b"})


def test_unreadable_cpuinfo_falls_back_to_torch(tmp_path):
    assert cpu_flags(tmp_path / "missing") is None
    assert isinstance(native_bf16(tmp_path / "missing"), bool)


def test_load_model_warns_about_emulated_bf16(monkeypatch, tmp_path, caplog):
    from byblock.models import loading

    save_checkpoint("llama", tmp_path / "ckpt")
    monkeypatch.setattr(loading, "native_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="byblock.models.loading"):
        loading.load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert "no native bf16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="byblock.models.loading"):
        loading.load_model(str(tmp_path / "ckpt"), dtype="float32")
    assert "no native bf16" not in caplog.text


def test_train_cli_defaults_autocast_to_the_device(monkeypatch):
    import argparse

    import torch

    from byblock.cli import train

    parser = argparse.ArgumentParser()
    train.add_args(parser)
    assert parser.parse_args(["dflash", "--out", "x"]).bf16 is None  # resolved for the device at run time
    assert parser.parse_args(["dflash", "--out", "x", "--bf16", "true"]).bf16 is True
    for native in (True, False):
        monkeypatch.setattr(train, "native_bf16", lambda native=native: native)
        assert train.default_bf16(torch.device("cpu")) is native
        assert train.default_bf16(torch.device("cuda")) is True
