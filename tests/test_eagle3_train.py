"""EAGLE-3 training (training/eagle3_train.py): the unrolled training forward is the drafter's inference,
training lowers the loss, resumes bit-exactly, and exports a head that drafts losslessly; the CLI pipeline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from lossless import greedy_outputs_match
from tiny import make_eagle3

from byblock import SamplingParams
from byblock.drafters.eagle3 import Eagle3Drafter
from byblock.drafters.eagle3_format import load_eagle3
from byblock.errors import ByblockError
from byblock.models.loading import load_model
from byblock.training.dflash_data import target_to_draft
from byblock.training.eagle3_train import Eagle3TrainConfig, Eagle3Trainer, pick_layers, ttt_forward


def test_training_forward_is_the_drafters_inference(tiny_targets):
    """Unrolled on the drafter's own greedy chain, step j's output at row i equals the drafter's depth-(j+1)
    state: the training masks and positions are the ones drafting uses."""
    target = tiny_targets["llama"]
    vocab = torch.arange(0, target.vocab_size, 2)
    model = make_eagle3(target, vocab)
    depth = 4
    drafter = Eagle3Drafter(model, target, depth=depth)
    committed = [5, 17, 33, 9, 40, 2, 11]
    layers = drafter.hidden_layers
    out = target.forward(torch.tensor([committed]), target.new_cache(), hidden_layers=layers)
    hidden = out.hidden  # [1, n, k*H]
    root = 5  # the drafter has seen features of rows 0..root-1 and tokens up to committed[root]
    drafter.start(committed[:root], hidden[:, :root], SamplingParams(), None)
    seen = []  # the logits of every drafting step, in order
    head = model.logits
    model.logits = lambda out: seen.append(head(out)) or seen[-1]
    chain = drafter.propose(committed[: root + 1], depth).tokens.tolist()
    model.logits = head
    tokens = torch.tensor([committed[: root + 1] + chain + [0] * (depth + 2)])
    ok = torch.ones_like(tokens, dtype=torch.bool)
    to_draft = target_to_draft(vocab, target.vocab_size)
    with torch.no_grad():
        steps = ttt_forward(model, drafter.embedding.weight, hidden[:, :root], tokens, ok, to_draft, depth)
    i = root - 1  # the last committed feature row drafts depth 1
    for j, (h, labels, _) in enumerate(steps):
        torch.testing.assert_close(model.logits(h[0, i]), seen[j], rtol=1e-5, atol=1e-5, msg=f"step {j}")
        assert int(vocab[labels[0, i]]) == chain[j]


def test_layer_choice_takes_the_stored_layers_nearest_vllms_defaults():
    assert pick_layers((1, 8, 14, 20, 27), 30) == (1, 14, 27)
    assert pick_layers((0, 1), 2) == (0, 1)


def _cfg(**kw) -> Eagle3TrainConfig:
    base = dict(steps=6, seqs_per_step=2, ttt_steps=3, lr=3e-3, draft_vocab_size=0, eval_every=3, ckpt_every=1)
    return Eagle3TrainConfig(**{**base, **kw})


def test_training_resumes_exactly_and_exports_a_lossless_head(tmp_path, regen_dir, tiny_llama_dir):
    straight = Eagle3Trainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "a", _cfg())
    straight.run(progress=False)
    first = Eagle3Trainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", _cfg())
    first.run(progress=False, stop_after=4)  # "killed" after step 4
    resumed = Eagle3Trainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", _cfg())
    assert resumed.step == 4
    resumed.run(progress=False)
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    log = [json.loads(line) for line in (tmp_path / "a" / "train.log").read_text().splitlines()]
    evals = [row["eval"] for row in log if "eval" in row]
    assert evals and all(1.0 <= e["tau"] <= 1 + 3 and len(e["step_acc"]) == 3 for e in evals)
    path = straight.export(tmp_path / "export")
    target = load_model(str(tiny_llama_dir))
    for budget in (0, 6):
        drafter = Eagle3Drafter(load_eagle3(path), target, depth=3, budget=budget, top_k=2)
        greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=30), drafter)
    with pytest.raises(ByblockError, match="another recipe"):
        Eagle3Trainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "a", _cfg(lr=1e-3))


def test_training_lowers_the_loss_on_tiny_data(tmp_path, regen_dir, tiny_llama_dir):
    cfg = _cfg(steps=40, seqs_per_step=4, ckpt_every=1000, eval_every=1000)
    trainer = Eagle3Trainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "t", cfg)
    batch = trainer.train[:4]
    before = trainer.loss(batch)[0].item()
    trainer.run(progress=False)
    assert trainer.loss(batch)[0].item() < 0.7 * before


def test_cli_trains_and_exports_a_head_generate_runs(tmp_path, regen_dir, tiny_llama_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "regen").symlink_to(regen_dir / "regen")
    cmd = [sys.executable, "-m", "byblock.cli.main", "train", "eagle3", "--target", str(tiny_llama_dir)]
    cmd += ["--out", str(out), "--stage", "all", "--steps", "4", "--ttt-steps", "2", "--draft-vocab-size", "0"]
    r = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    head = out / "export-eagle3"
    assert json.loads((head / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    gen = [sys.executable, "-m", "byblock.cli.main", "generate", "hi", "--model", str(tiny_llama_dir)]
    g = subprocess.run(
        [*gen, "--drafter", f"eagle3tree:{head}", "--max-new-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert g.returncode == 0, g.stderr
    bad = subprocess.run([*cmd, "--ttt-steps", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
