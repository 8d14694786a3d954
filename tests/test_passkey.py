"""The passkey probe: deterministic prompts of the asked length with the key where it was asked."""

from __future__ import annotations

from tiny import make_tokenizer

from byblock.bench.passkey import correct, make_prompt


def test_prompts_hide_the_key_at_the_depth_and_length():
    tok = make_tokenizer()
    for keys in (1, 3):
        a = make_prompt(tok, 600, 0.25, keys)
        assert a == make_prompt(tok, 600, 0.25, keys)  # deterministic
        n = len(tok(a.text, add_special_tokens=False)["input_ids"])
        assert 0.7 * 600 < n < 1.3 * 600
        where = a.text.index(a.answer) / len(a.text)
        assert 0.1 < where < 0.45
        assert correct(a, f" {a.answer}.") and not correct(a, " 12")
    multi = make_prompt(tok, 600, 0.9, 3)
    assert multi.text.count("The pass key") == 3 and "What is the pass key" in multi.text


def test_bench_runs_every_setting_on_the_passkey_probe(tiny_llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    from cli_runs import run_all

    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, "-m", "byblock.cli.main", "bench", "--model", str(tiny_llama_dir), "--dataset", "passkey"]
    settings = "dense,stem:0.5,stem:0.5/2,decode:2+32,int8,int4,window:4+64,snapkv:32,h2o:16+16"
    cmd += ["--settings", settings, "--methods", "ar,ngram"]
    cmd += ["--passkey-lengths", "200,300", "--passkey-depths", "0.5", "--passkey-keys", "1,2"]
    cmd += ["--sparse-min-tokens", "64", "--sparse-block", "16", "--sparse-dense-layers", "0", "--quiet"]
    cmd += ["--out", str(tmp_path / "out"), "--update-results", str(results), "--section", "pk"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out/report.json").read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1])["report"].endswith("report.json")
    rows = report["rows"]
    assert len(rows) == 9 * 2 * 2 and all(row["n"] == 2 and 0 <= row["accuracy"] <= 1 for row in rows)
    kv = {(row["setting"], row["length"]): row["kv_mb"] for row in rows if row["method"] == "ar"}
    assert kv[("int8", 300)] < kv[("dense", 300)] / 3 and kv[("int4", 300)] < kv[("int8", 300)]
    assert kv[("h2o:16+16", 300)] < kv[("dense", 300)] / 5 and kv[("snapkv:32", 300)] < kv[("dense", 300)]
    greedy = {}
    for row in rows:  # the same answers through ngram: lossless under every setting, so equal accuracy
        greedy.setdefault((row["setting"], row["length"]), set()).add(row["correct"])
    assert all(len(v) == 1 for v in greedy.values())
    text = results.read_text()
    assert "<!-- bench:pk -->" in text and "h2o:16+16" in text and "byblock bench" in text
    bads = (
        ["--settings", "h2o:16"],
        ["--settings", "stem:0.5/0"],
        ["--settings", "decode:0"],
        ["--settings", "dense,dense"],
    )
    bads += (["--passkey-lengths", "x"], ["--kv-h2o", "8"])
    for b in run_all([[*cmd[:6], *bad] for bad in bads]):
        assert b.returncode == 2 and len(b.stderr.strip().splitlines()) == 1, b.stderr
