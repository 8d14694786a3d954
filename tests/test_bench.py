"""`byblock bench`: end to end on a tiny model, report schema, the lossless check, dataset errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny import make_dflash

from byblock.bench.datasets import Prompt, load_jsonl
from byblock.bench.methods import Engine, MethodSpec, TurnResult
from byblock.bench.peers import stats_from_histogram
from byblock.bench.runner import run_dataset
from byblock.drafters.dflash_format import save_dflash
from byblock.errors import ByblockError
from byblock.sampling.params import SamplingParams

CLI = [sys.executable, "-m", "byblock.cli.main", "bench"]


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory, tiny_llama_dir):
    from byblock.models.loading import load_model

    target = load_model(str(tiny_llama_dir))
    return save_dflash(make_dflash(target, block=4), tmp_path_factory.mktemp("d") / "dflash", torch.float32)


def test_method_names_parse_once():
    assert MethodSpec.parse("dflash@8").drafter.block_size == 8
    assert MethodSpec.parse("ddtree:/x@16").drafter.tree_budget == 16
    assert MethodSpec.parse("adaptive").drafter.adaptive
    assert MethodSpec.parse("hf").drafter is None
    peer = MethodSpec.parse("vllm-dflash:/x@8")
    assert peer.engine is Engine.VLLM and peer.drafter.block_size == 8 and peer.drafter.model == "/x"
    assert MethodSpec.parse("vllm").engine is Engine.VLLM and MethodSpec.parse("vllm").drafter is None
    e3 = MethodSpec.parse("llamacpp-eagle3:/h@6")
    assert e3.engine is Engine.LLAMACPP and e3.drafter.kind.value == "eagle3" and e3.drafter.model == "/h"
    lookup = MethodSpec.parse("llamacpp-lookup@12")
    assert lookup.engine is Engine.LLAMACPP and lookup.lookup and lookup.drafter is None and lookup.size == 12
    for bad in ("warp", "hf@4", "dflash@1", "ngram:x", "vllm@4"):
        with pytest.raises(ByblockError):
            MethodSpec.parse(bad)


def test_bench_end_to_end(tmp_path, tiny_llama_dir, tiny_drafter):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"turns": ["hello world", "print(x)"]}, {"prompt": "a b c", "chat": False}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\nkept text\n")
    methods = f"ar,ngram,dflash:{tiny_drafter}@3,dflash:{tiny_drafter}@4,ddtree:{tiny_drafter}@6,hf,hf-lookup"
    cmd = [*CLI, "--model", str(tiny_llama_dir), "--methods", methods, "--dataset", str(data), "--limit", "3"]
    cmd += ["--max-new-tokens", "12", "--out", str(tmp_path / "out"), "--quiet"]
    cmd += ["--update-results", str(results), "--section", "tiny"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report) >= {"command", "machine", "date", "model", "params", "baseline", "datasets", "files"}
    block = report["datasets"]["prompts"]
    assert block["prompts"] == 3 and block["turns"] == 4  # the conversation counts two turns
    for name, row in block["methods"].items():
        assert row["tokens"] > 0 and row["tok_s"] > 0 and row["speedup"] is not None
        assert row["mismatched_turns"] == 0, name  # every method token-identical to ar
        assert (row["tau"] is None) == name.startswith("hf")  # τ is byblock's; plain decoding has τ = 1
        assert name != "ar" or row["tau"] == 1.0
        if row["tau"] is not None:  # τ pools rounds over turns, so it lies within the per-turn values
            assert len(row["per_turn_tau"]) == 4
            assert min(row["per_turn_tau"]) - 1e-3 <= row["tau"] <= max(row["per_turn_tau"]) + 1e-3
        assert last["results"]["prompts"][name]["lossless"] in (True, None)
    for f in ("speedup.png", "tau_hist.png", "speedup_vs_size.png", "report.md"):
        assert (tmp_path / "out" / f).is_file(), f
    md = results.read_text()
    assert "kept text" in md and "<!-- bench:tiny -->" in md and "| prompts | ddtree:" in md
    assert "dflash" in r.stdout  # the terminal table


class _Fake:
    def __init__(self, corrupt: bool) -> None:
        self.corrupt = corrupt

    def run(self, ids, params):
        toks = [1, 2, 3, 4] if not self.corrupt or len(ids) % 2 else [1, 2, 9, 4]
        return TurnResult(toks, 0.01, 0.1, None)

    def run_batch(self, prompts, params):
        self.batches = [*getattr(self, "batches", []), len(prompts)]
        return [self.run(ids, params) for ids in prompts], 0.15  # as if the batch ran in parallel


def test_lossless_check_flags_a_broken_method(tiny_targets):
    target = tiny_targets["llama"]
    prompts = [Prompt(id=str(i), text=t) for i, t in enumerate(["a", "b b", "c c c", "dd"])]
    runners = {"ar": _Fake(False), "good": _Fake(False), "broken": _Fake(True)}
    totals = run_dataset(target, prompts, runners, SamplingParams(max_new_tokens=4), reference="ar")
    assert totals["good"].mismatched_turns == 0 and totals["broken"].mismatched_turns > 0


def test_batches_are_timed_by_their_wall_clock(tiny_targets):
    target = tiny_targets["llama"]
    prompts = [Prompt(id=str(i), text=t) for i, t in enumerate(["a", "b b", "c c c", "dd", "e"])]
    prompts.append(Prompt(id="conv", text="x", turns=("x", "y")))
    runners = {"ar": _Fake(False), "peer": _Fake(False)}
    totals = run_dataset(target, prompts, runners, SamplingParams(max_new_tokens=4), reference="ar", batch=4)
    assert runners["peer"].batches == [4, 2, 1]  # 4 prompts, then the last 2 (turn 1), then the conversation's turn 2
    t = totals["peer"]
    assert t.tokens == 7 * 4 and t.turns == 7 and t.seconds == pytest.approx(3 * 0.15)
    assert t.mismatched_turns == 0


def test_a_batch_warm_up_runs_the_first_batch_untimed(tiny_targets):
    """With batch > 1 every method first decodes the first batch once (the memory a batch's prefill touches),
    and none of that run enters the totals."""
    target = tiny_targets["llama"]
    prompts = [Prompt(id=str(i), text=t) for i, t in enumerate(["a", "b b", "c c c", "dd", "e"])]
    runners = {"ar": _Fake(False), "peer": _Fake(False)}
    warm = SamplingParams(max_new_tokens=2)
    totals = run_dataset(target, prompts, runners, SamplingParams(max_new_tokens=4), reference="ar", batch=4, warm=warm)
    assert runners["peer"].batches == [4, 4, 1]  # the warm-up's first batch, then the timed ones
    assert totals["peer"].turns == 5 and totals["peer"].seconds == pytest.approx(2 * 0.15)
    run_dataset(target, prompts, {"ar": (one := _Fake(False))}, SamplingParams(), reference="ar", warm=warm)
    assert not hasattr(one, "batches") or one.batches == [1] * 5  # batch 1: no extra run


def test_vllm_histograms_become_byblock_counters():
    s = stats_from_histogram([1, 0, 2], k=3)  # one step accepted nothing, two accepted two drafts
    assert s.rounds == 3 and s.emitted_by_rounds == 1 + 3 + 3 and s.accept_counts == [1, 0, 2]
    assert s.position_drafted == [3, 3, 3] and s.position_accepted == [2, 2, 0]


def test_vllm_method_without_vllm_is_a_one_line_error(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("BYBLOCK_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    cmd = [*CLI, "--model", str(tiny_llama_dir), "--methods", "ar,vllm", "--limit", "1", "--no-plots", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "no vLLM interpreter" in r.stderr and "Traceback" not in r.stderr
    cmd = [*CLI, "--model", str(tiny_llama_dir), "--methods", "ar,llamacpp-dflash:/nope", "--limit", "1"]
    cmd += ["--llama-server", sys.executable, "--llamacpp-gguf", str(tmp_path / "t.gguf"), "--no-plots", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "/nope is not a DFlash checkpoint" in r.stderr and "Traceback" not in r.stderr
    cmd = [*CLI, "--model", str(tiny_llama_dir), "--methods", "ar,vllm", "--vllm-kv-cache-gib", "0", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "--vllm-kv-cache-gib must be >= 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{not json\n', ":2: not valid JSON"),
        ('{"prompt": ""}\n', ":1: expected a non-empty string 'prompt'"),
        ('{"turns": []}\n', ":1: 'turns' must be a non-empty list"),
        ("[1, 2]\n", ":1: expected a JSON object"),
    ],
)
def test_malformed_datasets_are_one_line_errors(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(ByblockError, match=message.replace("[", r"\[")):
        load_jsonl(bad)


def test_cli_malformed_dataset_exit_2(tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = subprocess.run([*CLI, "--model", str(tiny_llama_dir), "--dataset", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr


def test_a_paused_vllm_peer_is_stopped_with_its_children_until_resumed():
    """`VllmPeer.pause` stops the engine's whole process group (a child stands in for vLLM's engine core), and
    `resume` (which `generate` calls first) lets it run again."""
    import time

    from byblock.handoff.vllm_peer import VllmPeer

    peer = VllmPeer.__new__(VllmPeer)  # the process handling alone: no vLLM needed
    child = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    peer.proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    peer.paused = False

    def states() -> set[str]:
        out = subprocess.run(["ps", "-o", "stat=", "-g", str(peer.proc.pid)], capture_output=True, text=True)
        return {line.strip()[0] for line in out.stdout.splitlines() if line.strip()}

    try:
        time.sleep(0.5)  # the child has started
        peer.pause()
        time.sleep(0.2)
        assert peer.paused and states() == {"T"}
        peer.resume()
        time.sleep(0.2)
        assert not peer.paused and "T" not in states()
    finally:
        os.killpg(peer.proc.pid, 9)
        peer.proc.wait()
