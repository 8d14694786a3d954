"""Offline DDTree τ vs the calibration of the drafter's distributions (issue 5).

DDTree ranks prefixes by Σ_d log p_d(x_d) — the drafter's marginals taken as independent and calibrated.
This script measures, teacher-forced on held-out *training* blocks (the regenerated shard the trainer holds
out; never dev prompts or HumanEval), the τ of trees built from log softmax(z / T) − λ·depth for a grid of
temperatures T and per-depth penalties λ, next to the chain. A greedy tree accepts the deepest path whose
tokens equal the target's; τ = 1 + that depth.

    python benchmarks/tree_calibration.py --data /work/data/dflash-smollm2/regen \
        --drafter src/byblock/drafters/weights/smollm2-135m-dflash --budgets 16,32
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from byblock.drafters.ddtree import build_tree
from byblock.training.dflash_data import IGNORE, make_batch, sample_anchors
from byblock.training.dflash_train import DFlashTrainer, TrainConfig


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


@torch.no_grad()
def held_out_logits(trainer: DFlashTrainer, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [n, B-1, Vd] and labels [n, B-1] (IGNORE past a sequence's end) of held-out blocks."""
    g = torch.Generator().manual_seed(12345)
    block = trainer.cfg.block_size
    seqs = [s for s in trainer.val if s.num_anchors > 0]
    out_logits, out_labels, n = [], [], 0
    trainer.net.eval()
    while n < blocks:
        chosen = [seqs[int(torch.randint(len(seqs), (1,), generator=g))] for _ in range(8)]
        anchors = [sample_anchors(s, 4, g) for s in chosen]
        batch = make_batch(chosen, anchors, block, trainer.model_cfg.mask_token_id, trainer.to_draft, trainer.weights)
        base, _ = trainer.draft_logits(batch, trainer.net)
        logits = base.float().view(-1, block, base.shape[-1])[:, 1:]  # [blocks, B-1, Vd]
        labels = batch.labels.view(-1, block)[:, 1:]
        keep = labels[:, 0] != IGNORE
        out_logits.append(logits[keep])
        out_labels.append(labels[keep])
        n += int(keep.sum())
    return torch.cat(out_logits)[:blocks], torch.cat(out_labels)[:blocks]


def tree_tau(logits: torch.Tensor, labels: torch.Tensor, budget: int, temp: float, penalty: float) -> float:
    """Mean teacher-forced τ of best-first trees over log softmax(z / temp) − penalty per depth."""
    total = 0
    for z, lab in zip(logits, labels, strict=True):
        logp = torch.log_softmax(z / temp, dim=-1) - penalty  # [D, Vd]
        toks, parents = build_tree(logp, budget)
        depth, ok, best = [], [], 0
        for t, p in zip(toks, parents, strict=True):
            d = 0 if p < 0 else depth[p] + 1
            depth.append(d)
            good = (p < 0 or ok[p]) and int(lab[d]) == t
            ok.append(good)
            if good:
                best = max(best, d + 1)
        total += best
    return 1 + total / len(labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regenerated data dir (its last shard is the held-out one)")
    ap.add_argument("--drafter", required=True, help="exported DFlash checkpoint dir")
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--temperatures", default="0.5,0.7,1,1.4,2")
    ap.add_argument("--penalties", default="0,0.5,1")
    args = ap.parse_args()
    from byblock.drafters.dflash_format import load_dflash

    model, _ = load_dflash(args.drafter)
    cfg = TrainConfig(num_layers=model.config.num_layers, block_size=model.config.block_size, init_from=args.drafter)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DFlashTrainer(args.target, args.data, tmp, cfg)
    logits, labels = held_out_logits(trainer, args.blocks)
    hit = (logits.argmax(-1) == labels).long().cumprod(-1)
    print(f"held-out blocks: {len(labels)}; chain τ (block {cfg.block_size}): {1 + hit.sum(-1).float().mean():.3f}")
    print("| budget | T | λ | tree τ |\n|---:|---:|---:|---:|")
    for budget in (int(b) for b in args.budgets.split(",")):
        for temp in floats(args.temperatures):
            for pen in floats(args.penalties):
                tau = tree_tau(logits, labels, budget, temp, pen)
                print(f"| {budget} | {temp:g} | {pen:g} | {tau:.3f} |", flush=True)


if __name__ == "__main__":
    main()
