"""The DFlash training pipeline on a tiny target: regenerate (batched == plain greedy), resume, train, export."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from conftest import REGEN_PROMPTS
from lossless import greedy_outputs_match

from byblock import SamplingParams, generate
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.dflash_format import load_dflash
from byblock.models.loading import load_model
from byblock.training.dflash_data import (
    IGNORE,
    cosine_lr,
    decay_weights,
    load_shards,
    make_batch,
    sample_anchors,
    target_to_draft,
)
from byblock.training.dflash_train import DFlashTrainer, TrainConfig
from byblock.training.regenerate import RegenConfig, build_target_layer_ids, regenerate


def test_layer_ids_follow_the_reference_rule():
    assert build_target_layer_ids(30, 5) == (1, 8, 14, 20, 27)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the published Qwen3-8B drafter's
    assert build_target_layer_ids(30, 1) == (15,)


def test_batched_regeneration_equals_plain_greedy(regen_dir, tiny_llama_dir):
    """Left-padded batched decoding gives each prompt exactly its unbatched greedy answer and features."""
    target = load_model(str(tiny_llama_dir), relayout=False)
    seqs = load_shards(sorted((regen_dir / "regen").glob("shard_*.safetensors")))
    assert len(seqs) == len(REGEN_PROMPTS)
    for s in seqs:
        prompt = s.tokens[: s.prompt_len].tolist()
        plain = generate(target, prompt, SamplingParams(max_new_tokens=24, ignore_eos=False))
        assert s.tokens[s.prompt_len :].tolist() == plain.token_ids
        out = target.forward(s.tokens[None, :-1], target.new_cache(), hidden_layers=(0, 1))
        torch.testing.assert_close(s.hidden.float(), out.hidden[0], rtol=2e-2, atol=2e-2)  # stored in bf16
        assert s.topk_ids[:, 0].tolist() == plain.token_ids  # top-1 of the stored distribution = the token


def test_regeneration_resumes_and_refuses_other_settings(tmp_path, regen_dir, tiny_llama_dir):
    from byblock.errors import ByblockError

    prompts = regen_dir / "prompts.jsonl"
    cfg = RegenConfig(
        target=str(tiny_llama_dir), prompts=str(prompts), layer_ids=(0, 1), max_new_tokens=8, batch_size=3
    )
    out = tmp_path / "r"
    first = regenerate(RegenConfig(**{**cfg.__dict__, "limit": 3}), out, progress=False)
    assert first["shards"] == 1
    stamp = (out / "shard_00000.safetensors").stat().st_mtime_ns
    second = regenerate(cfg, out, progress=False)
    assert second["shards"] == 3 and (out / "shard_00000.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ByblockError, match="different settings"):
        regenerate(RegenConfig(**{**cfg.__dict__, "max_new_tokens": 9}), out, progress=False)


def test_bf16_regeneration_and_old_manifests(tmp_path, regen_dir, tiny_llama_dir):
    """`dtype` is part of the manifest; manifests written before it existed read as float32."""
    from byblock.errors import ByblockError

    prompts = regen_dir / "prompts.jsonl"
    cfg = RegenConfig(
        target=str(tiny_llama_dir), prompts=str(prompts), layer_ids=(0, 1), max_new_tokens=8, batch_size=4
    )
    bf = tmp_path / "bf16"
    regenerate(RegenConfig(**{**cfg.__dict__, "dtype": "bfloat16"}), bf, progress=False)
    assert json.loads((bf / "manifest.json").read_text())["dtype"] == "bfloat16"
    seqs = load_shards(sorted(bf.glob("shard_*.safetensors")))
    assert len(seqs) == len(REGEN_PROMPTS)
    for s in seqs:  # greedy: each response token is the top-1 of the distribution stored beside it
        assert s.topk_ids[:, 0].tolist() == s.tokens[s.prompt_len :].tolist()
    with pytest.raises(ByblockError, match="dtype"):
        regenerate(cfg, bf, progress=False)
    old = tmp_path / "old"
    regenerate(RegenConfig(**{**cfg.__dict__, "limit": 4}), old, progress=False)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["dtype"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert regenerate(cfg, old, progress=False)["shards"] == 2


def test_model_config_without_weights(tmp_path, tiny_llama_dir):
    """The regenerate stage reads the layer count from the config alone; a bad reference is one line."""
    from byblock.errors import ModelNotFoundError
    from byblock.models.loading import load_model_config

    cfg = load_model_config(str(tiny_llama_dir))
    assert cfg.get_text_config().num_hidden_layers == load_model(str(tiny_llama_dir)).num_layers
    with pytest.raises(ModelNotFoundError, match="not a checkpoint directory"):
        load_model_config(str(tmp_path))


def test_block_batch_masks_and_labels(regen_dir):
    seqs = [s for s in load_shards(sorted((regen_dir / "regen").glob("shard_*"))) if s.num_anchors >= 3]
    seq = seqs[0]
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(seq, 2, g)
    lut = target_to_draft(torch.arange(400), 400)
    w = decay_weights(4, 4.0)
    b = make_batch([seq], [anchors], 4, 399, lut, w)
    c = b.ctx_hidden.shape[1]
    for j, a in enumerate(anchors.tolist()):
        rows = b.mask[0, 0, j * 4 : (j + 1) * 4]
        assert rows[:, :a].all() and not rows[:, a:c].any()  # features strictly before the anchor
        assert rows[:, c + j * 4 : c + (j + 1) * 4].all()  # its own block, bidirectionally
        assert rows[:, c:].sum() == 4 * 4  # and no other block
        assert b.block_ids[0, j * 4] == seq.tokens[a] and (b.block_ids[0, j * 4 + 1 : (j + 1) * 4] == 399).all()
        labels = b.labels[0, j * 4 : (j + 1) * 4].tolist()
        assert labels[0] == IGNORE
        for k in range(1, 4):
            want = int(seq.tokens[a + k]) if a + k < len(seq.tokens) else IGNORE
            assert labels[k] == want
    assert torch.allclose(w[1:], torch.exp(-torch.arange(3.0) / 4.0)) and w[0] == 0


def test_cosine_schedule():
    lrs = [cosine_lr(s, 100, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[-1] < 0.01
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))


def _cfg(**kw) -> TrainConfig:
    base = dict(
        num_layers=1,
        block_size=4,
        draft_vocab_size=0,
        steps=6,
        seqs_per_step=2,
        anchors_per_seq=3,
        lr=3e-3,
        val_blocks=8,
        eval_every=3,
        ckpt_every=1,
        distill=0.5,
    )
    return TrainConfig(**{**base, **kw})


def test_training_resumes_exactly_and_exports_a_lossless_drafter(tmp_path, regen_dir, tiny_llama_dir):
    straight = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "a", _cfg())
    straight.run(progress=False)
    first = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", _cfg())
    first.run(progress=False, stop_after=4)  # "killed" after step 4
    resumed = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", _cfg())
    assert resumed.step == 4
    resumed.run(progress=False)
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    log = [json.loads(line) for line in (tmp_path / "a" / "train.log").read_text().splitlines()]
    assert any("eval" in row and row["eval"]["tau"] >= 1.0 for row in log)
    path = straight.export(tmp_path / "export")
    model, _ = load_dflash(path)
    target = load_model(str(tiny_llama_dir))
    drafter = DFlashDrafter(model, target)
    greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=30), drafter)


def test_training_lowers_loss_on_tiny_data(tmp_path, regen_dir, tiny_llama_dir):
    cfg = _cfg(steps=60, seqs_per_step=4, ckpt_every=1000, eval_every=1000)
    trainer = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "t", cfg)
    before = trainer.loss(trainer.batch_for(0, 0), trainer.net)[0].item()
    trainer.run(progress=False)
    after = trainer.loss(trainer.batch_for(0, 0), trainer.net)[0].item()
    assert after < 0.7 * before


def test_cli_pipeline_and_torchrun(tmp_path, regen_dir, tiny_llama_dir):
    """`byblock train dflash` stages through the real CLI, training under torchrun with 2 gloo ranks."""
    out = tmp_path / "run"
    common = ["train", "dflash", "--target", str(tiny_llama_dir), "--out", str(out), "--quiet"]
    tiny = ["--features", "2", "--max-new-tokens", "16", "--batch-size", "4", "--num-layers", "1"]
    tiny += ["--block-size", "4", "--draft-vocab-size", "0", "--steps", "4", "--seqs-per-step", "2"]
    tiny += ["--anchors-per-seq", "2", "--eval-every", "2", "--val-blocks", "4"]
    prompts = str(regen_dir / "prompts.jsonl")
    cli = [sys.executable, "-m", "byblock.cli.main"]
    r = subprocess.run(
        [*cli, *common, *tiny, "--prompts", prompts, "--stage", "regenerate"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "byblock.cli.main"]
    r = subprocess.run([*torchrun, *common, *tiny, "--stage", "train"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([*cli, *common, *tiny, "--stage", "export"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "export" / "config.json").is_file() and (out / "train" / "state.pt").is_file()
    r = subprocess.run([*cli, *common, "--stage", "export", "--steps", "5"], capture_output=True, text=True)
    assert r.returncode == 2 and "another recipe" in r.stderr and "Traceback" not in r.stderr
    domino = [*cli, "train", "domino", *common[2:], *tiny, "--freeze-backbone", "true", "--stage", "all"]
    r = subprocess.run(domino, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "export-domino" / "domino_head.safetensors").is_file()


def test_domino_training_from_a_dflash_checkpoint(tmp_path, regen_dir, tiny_llama_dir):
    from byblock.drafters.domino import DominoDrafter, load_domino

    base = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "d", _cfg(steps=20, ckpt_every=100))
    base.run(progress=False)
    dflash_dir = base.export(tmp_path / "dflash")
    cfg = _cfg(steps=30, ckpt_every=100, eval_every=100, domino=True, init_from=str(dflash_dir), lambda_decay=0.5)
    trainer = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "dom", cfg)
    assert trainer.curriculum() == 1.0
    batch = trainer.batch_for(0, 0)
    _, final = trainer.draft_logits(batch, trainer.net)
    base_logits, _ = trainer.draft_logits(batch, trainer.net)
    torch.testing.assert_close(final, base_logits.float())  # zero-initialised residual: Domino == DFlash
    start = trainer.evaluate_on(trainer.val)
    assert start["tau"] == start["base_tau"]  # the backbone's own chain is reported beside the corrected one
    trainer.run(progress=False)
    assert "base_tau" not in base.evaluate_on(base.val)
    assert trainer.curriculum() == 0.0
    out = trainer.export(tmp_path / "domino")
    target = load_model(str(tiny_llama_dir))
    model, vocab = load_dflash(out)
    drafter = DominoDrafter(DFlashDrafter(model, target, draft_vocab=vocab), load_domino(out, target.hidden_size))
    greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=30), drafter)


def test_domino_head_only_keeps_the_backbone(tmp_path, regen_dir, tiny_llama_dir):
    from byblock.drafters.domino import load_domino
    from byblock.errors import ByblockError

    base = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "d", _cfg(steps=5, ckpt_every=100))
    base.run(progress=False)
    dflash_dir = base.export(tmp_path / "dflash")
    cfg = _cfg(steps=5, ckpt_every=100, eval_every=100, domino=True, freeze_backbone=True, init_from=str(dflash_dir))
    trainer = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "dom", cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.run(progress=False)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert trainer.head is not None and trainer.head.proj_out.weight.abs().sum() > 0
    # A joint run from the exported pair starts from both: the backbone and the trained head (as stored, bf16).
    pair = trainer.export(tmp_path / "pair")
    joint = DFlashTrainer(
        str(tiny_llama_dir), regen_dir / "regen", tmp_path / "joint", _cfg(domino=True, init_from=str(pair))
    )
    stored = load_domino(pair, joint.model_cfg.hidden_size).state_dict()
    for k, v in joint.head.state_dict().items():
        assert torch.equal(v, stored[k]), k
    with pytest.raises(ByblockError, match="another shape"):
        DFlashTrainer(
            str(tiny_llama_dir), regen_dir / "regen", tmp_path / "j2", _cfg(domino=True, init_from=str(pair), emb_dim=8)
        )


def test_draft_vocab_fills_its_budget_beyond_the_kept_tokens():
    """Kept tokens (EOS, or a continued run's old vocabulary) are often the most frequent ones; the budget left
    must still go to the most frequent *other* tokens."""
    from byblock.training.dflash_data import Sequence, build_draft_vocab

    z = torch.zeros(7, 1)
    seq = Sequence(tokens=torch.tensor([9, 1, 1, 1, 2, 2, 3, 4]), prompt_len=1, hidden=z, topk_ids=z, topk_logp=z)
    vocab, coverage = build_draft_vocab([seq], 3, {1, 2})
    assert vocab.tolist() == [1, 2, 3] and coverage == pytest.approx(6 / 7)
    vocab, coverage = build_draft_vocab([seq], 3, {7})
    assert vocab.tolist() == [1, 2, 7] and coverage == pytest.approx(5 / 7)


def test_loss_is_finite_when_a_position_has_no_soft_target(tmp_path, regen_dir, tiny_llama_dir):
    trainer = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "n", _cfg())
    batch = trainer.batch_for(0, 0)
    row = (batch.weights > 0).nonzero()[0]
    batch.soft_ids[row[0], row[1]] = IGNORE  # every top-k token outside the draft vocabulary
    loss, _ = trainer.loss(batch, trainer.net)
    assert torch.isfinite(loss)


def test_continuous_decoder_refills_compacts_and_matches_plain_greedy(tiny_llama_dir):
    """Rows of very different lengths through a 3-row running batch refilled one row at a time, with leading
    padding dropped every 2 slots: every answer and its features equal decoding that prompt alone."""
    from byblock.training.regen_decode import ContinuousDecoder, DecodeSettings

    target = load_model(str(tiny_llama_dir), relayout=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (2, 9, 1, 17, 4, 30, 3, 6)]
    settings = DecodeSettings(
        layer_ids=(0, 1), eos_ids=frozenset({0}), pad_id=0, max_new_tokens=11, topk=4, temperature=0.0,
        rows=3, refill=1, compact=2,
    )  # fmt: skip
    jobs = [(i, p, i) for i, p in enumerate(prompts)]
    got = dict(ContinuousDecoder(target.hf, settings).run(jobs))
    assert sorted(got) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        plain = generate(target, p, SamplingParams(max_new_tokens=11, ignore_eos=False))
        assert got[i]["tokens"].tolist() == p + plain.token_ids
        out = target.forward(got[i]["tokens"][None, :-1].long(), target.new_cache(), hidden_layers=(0, 1))
        torch.testing.assert_close(got[i]["hidden"].float(), out.hidden[0], rtol=2e-2, atol=2e-2)


def test_continuous_decoder_samples_do_not_depend_on_the_batch(tiny_llama_dir):
    """A sampled answer is drawn from its own seeded stream: the same alone and in a refilled batch."""
    from byblock.training.regen_decode import ContinuousDecoder, DecodeSettings

    target = load_model(str(tiny_llama_dir), relayout=False)
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15], [20, 21]]
    jobs = [(i, p, 100 + i) for i, p in enumerate(prompts)]

    def run(rows: int) -> dict[int, list[int]]:
        settings = DecodeSettings(
            layer_ids=(0,), eos_ids=frozenset({0}), pad_id=0, max_new_tokens=12, topk=2, temperature=1.0,
            rows=rows, refill=1,
        )  # fmt: skip
        return {k: v["tokens"].tolist() for k, v in ContinuousDecoder(target.hf, settings).run(jobs)}

    alone, together = run(1), run(3)
    assert alone == together
    assert len({tuple(v[len(p) :]) for v, p in zip(alone.values(), prompts, strict=True)}) > 1


def test_regenerate_rejects_bad_settings(tiny_llama_dir):
    from byblock.errors import ByblockError

    with pytest.raises(ByblockError, match="rows must be at least 1"):
        RegenConfig(target=str(tiny_llama_dir), prompts="p.jsonl", layer_ids=(0,), rows=0)


def test_muon_recipe_trains_resumes_exactly_and_is_refused_when_misspelt(tmp_path, regen_dir, tiny_llama_dir):
    """MiMo's optimizer: Muon for the draft layers' matrices, AdamW for the rest; it lowers the loss, and a run
    killed mid-way resumes to the same weights as one straight run."""
    from byblock.errors import InvalidParameterError
    from byblock.training.optim import _Pair

    cfg = _cfg(optimizer="muon")
    straight = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "a", cfg)
    assert isinstance(straight.opt, _Pair)
    muon_params = {id(p) for g in straight.opt.parts[0].param_groups for p in g["params"]}
    assert muon_params and all(p.ndim == 2 for g in straight.opt.parts[0].param_groups for p in g["params"])
    before = straight.loss(straight.batch_for(0, 0), straight.net)[0].item()
    straight.run(progress=False)
    assert straight.loss(straight.batch_for(0, 0), straight.net)[0].item() < before
    first = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", cfg)
    first.run(progress=False, stop_after=3)
    resumed = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "b", cfg)
    assert resumed.step == 3
    resumed.run(progress=False)
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    with pytest.raises(InvalidParameterError, match="adamw or muon"):
        _cfg(optimizer="sgd")


def test_sliding_window_training_masks_the_context_like_drafting(tmp_path, regen_dir, tiny_llama_dir):
    """--sliding-window W: block row j of an anchor a sees context positions a + j - W < q < a, the drafter's
    inference rule (drafters/dflash_model.py windowed); the run trains and exports the window."""
    from byblock.errors import InvalidParameterError

    cfg = _cfg(sliding_window=6, steps=3)
    trainer = DFlashTrainer(str(tiny_llama_dir), regen_dir / "regen", tmp_path / "w", cfg)
    assert trainer.model.config.sliding_window == 6
    batch = trainer.batch_for(0, 0)
    c = batch.ctx_hidden.shape[1]
    for i in range(batch.mask.shape[0]):
        for j in range(batch.block_pos.shape[1] // cfg.block_size):
            rows = slice(j * cfg.block_size, (j + 1) * cfg.block_size)
            if (batch.labels[i, rows] == -100).all():
                continue
            a = int(batch.block_pos[i, j * cfg.block_size])
            for r in range(cfg.block_size):
                seen = batch.mask[i, 0, j * cfg.block_size + r, :c].nonzero().flatten().tolist()
                assert seen == list(range(max(0, a + r - 6 + 1), a)), (i, j, r)
    trainer.run(progress=False)
    loaded, _ = load_dflash(trainer.export(tmp_path / "export"))
    assert loaded.config.sliding_window == 6
    with pytest.raises(InvalidParameterError, match="sliding-window"):
        _cfg(sliding_window=2)  # not wider than the block
