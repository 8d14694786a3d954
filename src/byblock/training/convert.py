"""AR → block diffusion: fine-tune an autoregressive LM into a block-causal masked-diffusion LM.

The recipe is Fast-dLLM v2's (seed 001: a short fine-tune, not pre-training from scratch), at CPU scale:
  * Attention: the prompt is causal, every earlier response block is bidirectional inside itself and sees
    what precedes it, and the canvas (the block being denoised) sees all of that and itself — exactly the
    masks byblock's MaskDenoiser decodes with (dllm/denoisers.py segment_mask; commits are bidirectional
    passes), so the exact block KV cache applies to the result unchanged.
  * Shifted logits (Dream / Fast-dLLM v2): the row before each token predicts it, so the AR model's
    next-token head is the starting point instead of a new task; `byblock_dllm.json` says `"shift": true`.
  * Objective: pick a block of a regenerated answer (the target's own greedy response: the data the DFlash
    pipeline made, training/regenerate.py), mask each of its tokens with probability t ~ U(ε, 1), and take the
    cross-entropy on the masked ones weighted 1/t (the MDLM / LLaDA ELBO). **Complementary masking**: every
    example also appears with the complementary mask (weight 1/(1−t)), so every token of the block is a label
    once per step — Fast-dLLM v2's trick for data efficiency. Optional self-distillation on the AR model's stored
    top-k next-token distributions (the AR model's belief about each response token, `distill`).
  * The mask token is an existing special token the chat template never uses (SmolLM2's `<empty_output>`);
    no embedding row is added, so the checkpoint keeps the AR model's exact shapes.

Resumable: OUT/state.pt is replaced atomically every `ckpt_every` steps and batches depend only on (seed, step).
`export` writes a transformers checkpoint plus `byblock_dllm.json`, which `byblock generate --model DIR` decodes
with every mask sampler (dllm/).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from byblock.dllm.denoisers import segment_mask
from byblock.errors import ByblockError, InvalidParameterError
from byblock.training.dflash_data import Sequence, cosine_lr, load_shards

log = logging.getLogger(__name__)

MASK_TOKEN_CANDIDATES = ("<empty_output>", "<|mask|>", "<mask>")  # special tokens no chat template emits


@dataclass(frozen=True)
class ConvertConfig:
    """The conversion recipe (defaults: a CPU-minutes run on the 135M model)."""

    block_size: int = 8
    steps: int = 300
    seqs_per_step: int = 8  # examples per step; each also runs with its complementary mask
    lr: float = 5e-5
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    distill: float = 0.5  # weight of the KL to the AR model's stored top-k (0: hard labels only)
    complementary: bool = True
    bf16: bool = False  # autocast the matmuls to bf16 (weights and optimizer stay fp32): ~1.8x on native-bf16 CPUs
    max_context: int = 256  # blocks whose context (prompt + earlier blocks) is longer are not drawn (CPU cost)
    min_mask: float = 0.05  # ε of t ~ U(ε, 1)
    val_shards: int = 1
    val_examples: int = 64
    eval_every: int = 100
    ckpt_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.steps < 1 or self.seqs_per_step < 1:
            raise InvalidParameterError("--block-size, --steps and --seqs-per-step must be >= 1")
        if not 0.0 < self.min_mask < 1.0 or self.lr <= 0 or self.distill < 0:
            raise InvalidParameterError("need 0 < --min-mask < 1, --lr > 0 and --distill >= 0")


def pick_mask_token(tokenizer) -> int:
    """The id of a special token usable as [MASK] (one-line error when the tokenizer has none)."""
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_CANDIDATES:
        if name in vocab:
            return int(vocab[name])
    pad = tokenizer.pad_token_id  # last resort: a padding token that is not the end of a turn
    if pad is not None and pad != tokenizer.eos_token_id:
        return int(pad)
    raise ByblockError(f"the tokenizer has none of {MASK_TOKEN_CANDIDATES} to use as the mask token")


def block_example(seq: Sequence, block: int, size: int, eos: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(context ids [C], block ids [size] padded with EOS, first response index of the block) for block `block`."""
    start = seq.prompt_len + block * size
    ctx = seq.tokens[:start]
    blk = seq.tokens[start : start + size]
    if len(blk) < size:  # the answer's last block: EOS fills the canvas, as the sampler stops at EOS
        blk = torch.cat([blk, torch.full((size - len(blk),), eos, dtype=blk.dtype)])
    return ctx, blk, block * size


class Converter:
    """The model being converted, its data and optimizer; `run` trains, `export` writes the dLLM checkpoint."""

    def __init__(self, model_name: str, data_dir: str | Path, out_dir: str | Path, cfg: ConvertConfig) -> None:
        from transformers import AutoModelForCausalLM

        from byblock.models.loading import _quiet_transformers, load_tokenizer, resolve_checkpoint
        from byblock.training.eagle3_train import _read_manifest, _split_shards

        _quiet_transformers()
        self.cfg, self.model_name = cfg, model_name
        self.data_dir, self.out_dir = Path(data_dir), Path(out_dir)
        manifest = _read_manifest(self.data_dir)
        train_paths, val_paths = _split_shards(self.data_dir, cfg.val_shards)
        self.train_names = [str(p) for p in train_paths]
        self.train = [s for s in load_shards(train_paths) if self.blocks(s) > 0]
        val = [s for s in load_shards(val_paths) if self.blocks(s) > 0]
        if not self.train or not val:
            raise ByblockError(f"{self.data_dir}: no usable training or held-out sequences")
        self.tok = load_tokenizer(model_name)
        self.mask_id = pick_mask_token(self.tok)
        self.eos_id = int(self.tok.eos_token_id)
        torch.manual_seed(cfg.seed)
        ckpt = resolve_checkpoint(model_name)
        self.hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
        if manifest.get("target") not in (None, model_name):
            log.warning("data regenerated by %s, converting %s", manifest.get("target"), model_name)
        decay = [p for p in self.hf.parameters() if p.dim() >= 2]
        rest = [p for p in self.hf.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr)
        g = torch.Generator().manual_seed(cfg.seed + 7)  # a fixed held-out set: (sequence, block, mask draw)
        self.val = []
        for i in range(cfg.val_examples):
            seq = val[i % len(val)]
            self.val.append((seq, int(torch.randint(self.blocks(seq), (1,), generator=g))))
        self.step, self.train_seconds = 0, 0.0
        state = self.out_dir / "state.pt"
        if state.is_file():
            saved = torch.load(state, weights_only=False, map_location="cpu")
            same = saved["train_paths"] == self.train_names and saved["model_name"] == model_name
            if saved["config"] != asdict(cfg) or not same:
                raise ByblockError(f"{self.out_dir} holds a run with another recipe or data; use a new --out")
            self.hf.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["optimizer"])
            self.step, self.train_seconds = saved["step"], saved["train_seconds"]

    def blocks(self, seq: Sequence) -> int:
        """How many of the answer's blocks may be drawn (their context fits max_context)."""
        size = self.cfg.block_size
        answer = math.ceil((len(seq.tokens) - seq.prompt_len) / size)
        fit = (self.cfg.max_context - seq.prompt_len) // size + 1 if seq.prompt_len <= self.cfg.max_context else 0
        return max(0, min(answer, fit))

    # ---- objective ----------------------------------------------------------------------------------------

    def batch(self, examples: list[tuple[Sequence, int]], masks: list[torch.Tensor]):
        """Right-padded ids [N, T], additive masks [N, 1, T, T], and per example (context, block, response index)."""
        size = self.cfg.block_size
        parts = [block_example(seq, blk, size, self.eos_id) for seq, blk in examples]
        width = max(len(c) + size for c, _, _ in parts)
        ids = torch.full((len(parts), width), self.eos_id, dtype=torch.long)
        att = torch.full((len(parts), 1, width, width), torch.finfo(torch.float32).min)
        for n, ((seq, blk_index), (ctx, blk, _), masked) in enumerate(zip(examples, parts, masks, strict=True)):
            c = len(ctx)
            ids[n, :c] = ctx
            ids[n, c : c + size] = torch.where(masked, self.mask_id, blk)
            segments = [(seq.prompt_len, False), *[(size, True)] * blk_index, (size, True)]
            att[n, :, : c + size, : c + size] = segment_mask(segments, torch.float32)[0]
            att[n, 0, c + size :, 0] = 0.0  # padding rows see one key (no NaN rows); their outputs are unused
        return ids, att, parts

    def loss(self, examples: list[tuple[Sequence, int]], masks: list[torch.Tensor], weights: list[float]):
        """ELBO-weighted masked cross-entropy (+ distillation) over the examples; returns (loss, masked accuracy)."""
        ids, att, parts = self.batch(examples, masks)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            states = self.hf.model(input_ids=ids, attention_mask=att).last_hidden_state
        states = states.float()
        size = self.cfg.block_size
        # shifted: rows c-1 .. c+size-2 predict the canvas tokens; the LM head runs on those rows only
        rows = torch.stack([torch.arange(len(ctx) - 1, len(ctx) - 1 + size) for ctx, _, _ in parts])
        logits = self.hf.lm_head(states.gather(1, rows[..., None].expand(-1, -1, states.shape[-1])))
        total = torch.zeros(())
        hits = count = 0
        for n, ((seq, _), (_, blk, r0), masked, w) in enumerate(zip(examples, parts, masks, weights, strict=True)):
            if not masked.any():
                continue
            lg = logits[n][masked]
            ce = torch.nn.functional.cross_entropy(lg, blk[masked], reduction="sum")
            term = ce
            if self.cfg.distill:
                rows = torch.arange(r0, r0 + size)[masked]
                real = rows < len(seq.topk_ids)  # EOS padding has no stored distribution
                if real.any():
                    logp = torch.log_softmax(lg[real], -1).gather(-1, seq.topk_ids[rows[real]])
                    p = torch.softmax(seq.topk_logp[rows[real]], -1)
                    term = term + self.cfg.distill * -(p * logp).sum()
            total = total + w * term / size
            hits += int((lg.argmax(-1) == blk[masked]).sum())
            count += int(masked.sum())
        return total / len(examples), hits / max(count, 1)

    def draw(self, step: int) -> tuple[list[tuple[Sequence, int]], list[torch.Tensor], list[float]]:
        """The step's examples (deterministic in seed and step), with complementary masks."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009)
        examples, masks, weights = [], [], []
        for _ in range(cfg.seqs_per_step):
            seq = self.train[int(torch.randint(len(self.train), (1,), generator=g))]
            blk = int(torch.randint(self.blocks(seq), (1,), generator=g))
            t = cfg.min_mask + (1 - cfg.min_mask) * float(torch.rand((), generator=g))
            masked = torch.rand(cfg.block_size, generator=g) < t
            if not masked.any():
                masked[int(torch.randint(cfg.block_size, (1,), generator=g))] = True
            examples.append((seq, blk))
            masks.append(masked)
            weights.append(1.0 / t)
            if cfg.complementary and not masked.all():
                examples.append((seq, blk))
                masks.append(~masked)
                weights.append(1.0 / max(1 - t, cfg.min_mask))
        return examples, masks, weights

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out accuracy of the masked tokens with the whole block masked (the first denoising step) and
        with half of it masked."""
        self.hf.eval()
        out = {}
        size = self.cfg.block_size
        for name, keep in (("acc_full_mask", 0), ("acc_half_mask", size // 2)):
            masks = []
            for i in range(len(self.val)):
                m = torch.ones(size, dtype=torch.bool)
                m[torch.randperm(size, generator=torch.Generator().manual_seed(i))[:keep]] = False
                masks.append(m)
            hits = count = 0
            for a in range(0, len(self.val), 8):
                _, acc = self.loss(self.val[a : a + 8], masks[a : a + 8], [1.0] * len(masks[a : a + 8]))
                n = int(sum(int(m.sum()) for m in masks[a : a + 8]))
                hits, count = hits + acc * n, count + n
            out[name] = round(hits / max(count, 1), 4)
        self.hf.train()
        return out

    # ---- the loop -----------------------------------------------------------------------------------------

    def save_state(self) -> None:
        """Atomically replace state.pt."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "config": asdict(self.cfg),
            "train_paths": self.train_names,
            "model_name": self.model_name,
            "model": self.hf.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "train_seconds": self.train_seconds,
        }
        tmp = self.out_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out_dir / "state.pt")

    def run(self, progress: bool = True, stop_after: int | None = None) -> dict:
        """Train to cfg.steps (or `stop_after` more steps); returns the last evaluation."""
        from tqdm import tqdm

        cfg = self.cfg
        self.hf.train()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        bar = tqdm(total=end, initial=self.step, desc="convert", disable=not progress)
        last: dict = {}
        if self.step == 0:
            last = {"step": 0, "eval": self.evaluate()}  # the AR model as a dLLM before any fine-tune
            with (self.out_dir / "train.log").open("a") as logf:
                logf.write(json.dumps(last) + "\n")
        with (self.out_dir / "train.log").open("a") as logf:
            while self.step < end:
                t0 = time.perf_counter()
                lr = cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                loss, acc = self.loss(*self.draw(self.step))
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.hf.parameters(), cfg.grad_clip)
                self.opt.step()
                self.step += 1
                self.train_seconds += time.perf_counter() - t0
                bar.update(1)
                if self.step % 10 == 0 or self.step == end:
                    bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
                    logf.write(json.dumps({"step": self.step, "loss": loss.item(), "acc": acc, "lr": lr}) + "\n")
                    logf.flush()
                if self.step % cfg.ckpt_every == 0 or self.step == end:
                    self.save_state()
                if self.step % cfg.eval_every == 0 or self.step == end:
                    last = {"step": self.step, "eval": self.evaluate(), "train_s": round(self.train_seconds, 1)}
                    logf.write(json.dumps(last) + "\n")
                    logf.flush()
        bar.close()
        return last

    def export(self, out: str | Path) -> Path:
        """A transformers checkpoint + byblock_dllm.json (block-causal: the exact block cache applies)."""
        from byblock.dllm.loading import DLLM_CONFIG

        path = Path(out)
        tmp = path.with_name(path.name + ".tmp")
        self.hf.save_pretrained(tmp)
        self.tok.save_pretrained(tmp)
        meta = {
            "mask_token_id": self.mask_id,
            "block_size": self.cfg.block_size,
            "shift": True,
            "converted_from": self.model_name,
            "steps": self.step,
            "train_hours": round(self.train_seconds / 3600, 3),
        }
        (tmp / DLLM_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
        return path
