"""Raw code-completion prompts derived from regenerated answers, and training on a second regen dir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny import make_tokenizer

from byblock.errors import ByblockError
from byblock.training.code_prompts import derive, derive_from_regen, write_jsonl
from byblock.training.dflash_train import DFlashTrainer, TrainConfig
from byblock.training.regenerate import RegenConfig, pack_shard, regenerate, shard_path

PY_ANSWER = (
    "Here is a solution:\n\n```python\nimport math\nfrom typing import List\n\ndef area(r: float) -> float:\n"
    "    return math.pi * r * r\n```\nIt uses the formula."
)
JS_ANSWER = "Sure.\n```javascript\nconst a = [1, 2];\nconst b = a.map(x => x * 2);\nconsole.log(b);\n```"


def test_docstring_shape_keeps_imports_and_signature():
    cp = derive("Compute the  area of a\ncircle.", PY_ANSWER, "p7")
    assert cp is not None and cp.shape == "docstring" and cp.id == "p7-doc"
    assert cp.prompt == (
        "import math\nfrom typing import List\n\n\ndef area(r: float) -> float:\n"
        '    """ Compute the area of a circle.\n    """\n'
    )
    assert cp.row()["chat"] is False


def test_prefix_shape_for_other_languages_and_no_code():
    cp = derive("Double an array in JS", JS_ANSWER, "p8")
    assert cp is not None and cp.shape == "prefix"
    assert cp.prompt == "const a = [1, 2];\nconst b = a.map(x => x * 2);\n"
    assert derive("Say hi", "Hello! No code here.", "p9") is None
    assert derive("Tiny", "```python\nx = 1\n```", "p10") is None  # too short to continue
    # A python block without a top-level def falls back to its first lines.
    cp = derive("Loop", "```python\nfor i in range(3):\n    print(i)\n    print(i * 2)\n```", "p11")
    assert cp is not None and cp.shape == "prefix"


def _fake_regen(tmp_path, tokenizer, rows, answers):
    """A regen dir with one shard whose responses are `answers` (hidden states and top-k are zeros)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs, plens = [], []
    for row, answer in zip(rows, answers, strict=True):
        p = tokenizer(row["prompt"])["input_ids"]
        a = tokenizer(answer)["input_ids"]
        n = len(p) + len(a)
        seqs.append(
            {
                "tokens": torch.tensor(p + a, dtype=torch.int32),
                "hidden": torch.zeros(n - 1, 4, dtype=torch.bfloat16),
                "topk_ids": torch.zeros(len(a), 2, dtype=torch.int32),
                "topk_logp": torch.zeros(len(a), 2, dtype=torch.float16),
            }
        )
        plens.append(len(p))
    from safetensors.torch import save_file

    regen = tmp_path / "regen"
    regen.mkdir()
    save_file(pack_shard(seqs, plens, list(range(len(rows)))), str(shard_path(regen, 0)))
    return prompts, regen


def test_derive_from_regen_reads_answers_of_coding_prompts_only(tmp_path):
    tok = make_tokenizer()
    rows = [
        {"id": "a", "source": "codealpaca", "prompt": "Area of a circle"},
        {"id": "b", "source": "gsm8k-train", "prompt": "What is 2+2?"},
        {"id": "c", "source": "codealpaca", "prompt": "Double an array"},
        {"id": "d", "source": "codealpaca", "prompt": "Area of a circle"},  # same derived prompt: dropped
    ]
    answers = [PY_ANSWER, "```python\ndef f():\n    return 4\n```", JS_ANSWER, PY_ANSWER]
    prompts, regen = _fake_regen(tmp_path, tok, rows, answers)
    derived = derive_from_regen(regen, prompts, tok)
    assert [(d.id, d.shape) for d in derived] == [("a-doc", "docstring"), ("c-pre", "prefix")]
    out = write_jsonl(derived, tmp_path / "code.jsonl")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["prompt"].startswith("import math") and all(x["chat"] is False for x in lines)
    with pytest.raises(ByblockError, match="no regenerated shards"):
        derive_from_regen(tmp_path / "empty", prompts, tok)


def _cfg(**kw) -> TrainConfig:
    base = dict(num_layers=1, block_size=4, draft_vocab_size=0, steps=4, seqs_per_step=2, anchors_per_seq=3)
    return TrainConfig(**{**base, "val_blocks": 8, "eval_every": 2, "ckpt_every": 1, **kw})


@pytest.fixture(scope="module")
def two_regen_dirs(tmp_path_factory, tiny_llama_dir):
    """A chat regen dir and a raw-completion one (`chat: false`) for the same tiny target and layers."""
    root = tmp_path_factory.mktemp("two")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello", "a b c", "x = 1", "the cat", "1 2"]))
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps({"prompt": p, "chat": False}) + "\n" for p in ["def f(x):", "for i in", "y ="]))
    for name, path in (("regen", chat), ("regen-code", raw)):
        cfg = RegenConfig(target=str(tiny_llama_dir), prompts=str(path), layer_ids=(0, 1), max_new_tokens=12)
        regenerate(RegenConfig(**{**cfg.__dict__, "batch_size": 2}), root / name, progress=False)
    return root


def test_training_on_extra_data_holds_each_dir_out_and_resumes(tmp_path, two_regen_dirs, tiny_llama_dir):
    extra = str(two_regen_dirs / "regen-code")
    trainer = DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "t", _cfg(extra_data=extra))
    assert "regen-code/shard_00000.safetensors" in trainer.train_names
    assert set(trainer.val_seqs) == {"main", "regen-code"}
    assert not {p.resolve() for p in trainer.train_paths} & {p.resolve() for p in trainer.val_sets["regen-code"]}
    result = trainer.run(progress=False, stop_after=2)
    assert result["tau"] >= 1.0 and result["tau_regen-code"] >= 1.0
    resumed = DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "t", _cfg(extra_data=extra))
    assert resumed.step == 2
    with pytest.raises(ByblockError, match="another recipe or data"):
        DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "t", _cfg())


def test_extra_data_must_share_target_and_layers(tmp_path, two_regen_dirs, tiny_llama_dir):
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((two_regen_dirs / "regen-code" / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "layer_ids": [0]}))
    with pytest.raises(ByblockError, match="another target or feature layers"):
        DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "t", _cfg(extra_data=str(other)))
    twice = f"{two_regen_dirs / 'regen-code'},{two_regen_dirs / 'regen-code'}"
    with pytest.raises(ByblockError, match="distinct names"):
        DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "t", _cfg(extra_data=twice))


def test_cli_code_prompts_stage(tmp_path, tiny_llama_dir):
    cli = [sys.executable, "-m", "byblock.cli.main", "train", "dflash", "--target", str(tiny_llama_dir)]
    r = subprocess.run([*cli, "--out", str(tmp_path), "--stage", "code-prompts"], capture_output=True, text=True)
    assert r.returncode == 2 and "--prompts" in r.stderr and "Traceback" not in r.stderr
    tok = make_tokenizer()
    rows = [{"id": "a", "source": "codealpaca", "prompt": "Area of a circle"}]
    prompts, _ = _fake_regen(tmp_path, tok, rows, [PY_ANSWER])
    r = subprocess.run(
        [*cli, "--out", str(tmp_path), "--stage", "code-prompts", "--prompts", str(prompts), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "code_prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["shape"] == "docstring"
    # Chat answers regenerated into another --regen-dir are read from there.
    (tmp_path / "code_prompts.jsonl").unlink()
    (tmp_path / "regen").rename(tmp_path / "regen-chat2")
    cmd = [*cli, "--out", str(tmp_path), "--stage", "code-prompts", "--prompts", str(prompts), "--quiet"]
    r = subprocess.run([*cmd, "--regen-dir", "regen-chat2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len((tmp_path / "code_prompts.jsonl").read_text().splitlines()) == 1


def test_continued_run_grows_the_draft_vocabulary_but_domino_keeps_it(tmp_path, two_regen_dirs, tiny_llama_dir):
    small = DFlashTrainer(str(tiny_llama_dir), two_regen_dirs / "regen", tmp_path / "s", _cfg(draft_vocab_size=12))
    small.run(progress=False, stop_after=1)
    start = small.export(tmp_path / "start")
    extra = str(two_regen_dirs / "regen-code")
    grown = DFlashTrainer(
        str(tiny_llama_dir),
        two_regen_dirs / "regen",
        tmp_path / "g",
        _cfg(draft_vocab_size=64, init_from=str(start), extra_data=extra),
    )
    assert len(grown.vocab) > len(small.vocab) and set(small.vocab.tolist()) <= set(grown.vocab.tolist())
    labels = torch.cat([s.tokens[s.prompt_len :] for s in grown.train])
    old_share = torch.isin(labels, small.vocab).float().mean().item()
    assert grown.coverage > old_share  # the grown vocabulary covers more of the new data's labels
    dom = DFlashTrainer(
        str(tiny_llama_dir),
        two_regen_dirs / "regen",
        tmp_path / "d",
        _cfg(draft_vocab_size=64, init_from=str(start), domino=True, freeze_backbone=True),
    )
    assert torch.equal(dom.vocab, small.vocab)
