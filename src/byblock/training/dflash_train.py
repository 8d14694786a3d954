"""Stage 2: train a DFlash drafter on regenerated shards (no target forwards: features are on disk).

Objective (paper Eq. 4): Σ_k w_k · CE(draft_k, x_{a+k}) over block positions k = 1..B−1, w_k = exp(−(k−1)/γ),
optionally mixed with a cross-entropy against the target's stored top-k distribution (distillation).
AdamW, linear warm-up + cosine decay, gradient clipping. Offline τ on held-out shards: for a block at an
anchor with teacher-forced context, greedy verification accepts exactly the leading positions where the
draft argmax equals the target's token, so 1 + (that prefix length) is the round's τ.

Resumable: `state.pt` (model, optimizer, step) is replaced atomically every `ckpt_every` steps; batches
depend only on (seed, rank, step), so a resumed run sees the batches the killed one would have seen.
Runs in one process or under `torchrun --nproc_per_node=N` (DDP over NCCL on GPUs, gloo on CPU), on the device
the trainer is given (one GPU per process under torchrun: cuda:LOCAL_RANK).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from byblock.drafters.dflash_model import DFlashConfig, DFlashDraftModel, init_from_target
from byblock.drafters.domino import DominoConfig, DominoHead, has_domino, load_domino, save_domino
from byblock.errors import ByblockError
from byblock.training.dflash_data import (
    IGNORE,
    Batch,
    Sequence,
    build_draft_vocab,
    cosine_lr,
    decay_weights,
    default_gamma,
    load_shards,
    make_batch,
    sample_anchors,
    target_to_draft,
)
from byblock.training.distributed import process_device, world
from byblock.training.optim import build_optimizer
from byblock.training.regenerate import MANIFEST
from byblock.training.train_config import TrainConfig, same_recipe

log = logging.getLogger(__name__)


def _read_manifest(data_dir: Path) -> dict:
    path = data_dir / MANIFEST
    if not path.is_file():
        raise ByblockError(f"{data_dir} has no regenerated data (run the regenerate stage first)")
    return json.loads(path.read_text())


def _split_shards(data_dir: Path, val_shards: int) -> tuple[list[Path], list[Path]]:
    """(train, held-out) shard files of one regen dir: the last `val_shards` are held out."""
    shards = sorted(data_dir.glob("shard_*.safetensors"))
    if len(shards) <= val_shards:
        raise ByblockError(f"{data_dir}: {len(shards)} shards; need more than val_shards={val_shards}")
    return shards[:-val_shards], shards[-val_shards:]


def _accepted_runs(logits: torch.Tensor, labels: torch.Tensor, has_label: torch.Tensor, block: int) -> torch.Tensor:
    """Greedy acceptance of teacher-forced blocks: logits [b, T, Vd], labels [b, T] -> [n, B−1] 0/1 runs that
    stop at the first miss, for the n blocks with a real next token."""
    hit = (logits.argmax(-1) == labels) & (labels != IGNORE)  # [b, T]
    return hit.view(-1, block)[:, 1:].long().cumprod(-1)[has_label]


def pick_mask_token(tokenizer, seqs: list[Sequence], eos: frozenset[int], vocab_size: int) -> int:
    """A token id the target never emits: an unused special token, else the last id of the vocabulary."""
    seen: set[int] = set()
    for s in seqs:
        seen.update(s.tokens[s.prompt_len :].unique().tolist())
    specials = sorted(
        set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    )
    for t in reversed(specials):
        if t not in seen and t not in eos and t < vocab_size:
            return int(t)
    return vocab_size - 1


class _Net(torch.nn.Module):
    """Backbone + optional Domino head as one module (what DDP wraps and what state.pt holds)."""

    def __init__(self, backbone: DFlashDraftModel, head: DominoHead | None, freeze_backbone: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.block = backbone.config.block_size
        self.freeze_backbone = freeze_backbone
        backbone.requires_grad_(not freeze_backbone)

    def forward(self, emb, ctx, block_pos, ctx_pos, mask, prefix_embeds=None):
        """Draft states [b, T, H] and Domino's teacher-forced residuals [b, T, Vd] (None without a head)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_backbone):
            h = self.backbone(emb, ctx, block_pos, ctx_pos, mask)
        if self.head is None:
            return h, None
        b, t, hid = h.shape
        hb = h.view(-1, self.block, hid)[:, 1:]  # [blocks, B-1, H]: positions 1..B-1
        pe = prefix_embeds.view(-1, self.block, hid)[:, :-1].to(h.dtype)  # [blocks, B-1, H]: tokens at 0..B-2
        res = self.head(hb, pe)  # [blocks, B-1, Vd]
        zero = torch.zeros(res.shape[0], 1, res.shape[2], dtype=res.dtype, device=res.device)
        return h, torch.cat([zero, res], dim=1).view(b, t, -1)  # aligned with the block rows


class DFlashTrainer:
    """Holds the frozen target pieces (embedding, head), the data, the draft model and its optimizer."""

    def __init__(
        self, target_name: str, data_dir: str | Path, out_dir: str | Path, cfg: TrainConfig, device: str = "cpu"
    ) -> None:
        """device: where the drafter trains ("auto", "cpu", "cuda[:N]"); not part of the recipe, so a run may
        resume on another device."""
        from byblock.models.loading import load_model

        self.cfg = cfg
        self.device = process_device(device)
        self.data_dir, self.out_dir = Path(data_dir), Path(out_dir)
        self.rank, self.world = world(self.device)
        self.manifest = _read_manifest(self.data_dir)
        extra_dirs = [Path(d.strip()) for d in cfg.extra_data.split(",") if d.strip()]
        names = [d.name for d in extra_dirs]
        if len(set(names)) != len(names) or "main" in names:
            raise ByblockError(f"--extra-data dirs need distinct names other than 'main' (got {', '.join(names)})")
        for d in extra_dirs:
            m = _read_manifest(d)
            if m["layer_ids"] != self.manifest["layer_ids"] or m["target"] != self.manifest["target"]:
                raise ByblockError(f"{d} was regenerated with another target or feature layers than {self.data_dir}")
        self.train_paths, self.val_paths = _split_shards(self.data_dir, cfg.val_shards)
        # Held-out sets by name: "main" is the main dir's (its τ is the one logged and compared across runs).
        self.val_sets: dict[str, list[Path]] = {"main": self.val_paths}
        self.train_names = [p.name for p in self.train_paths]  # what a resume must find again
        for d in extra_dirs:
            train_paths, val_paths = _split_shards(d, cfg.val_shards)
            self.train_paths += train_paths
            self.val_sets[d.name] = val_paths
            self.train_names += [f"{d.name}/{p.name}" for p in train_paths]
        target = load_model(target_name, device="cpu", dtype="float32", relayout=False)  # only its tables are used
        self.target_name = target_name
        self.embed = target.hf.get_input_embeddings().weight.detach()  # [V, H] frozen
        head = target.hf.get_output_embeddings().weight.detach()  # [V, H] frozen
        self.train = load_shards(self.train_paths)
        self.val_seqs = {name: load_shards(paths) for name, paths in self.val_sets.items()}
        self.val = self.val_seqs["main"]
        self.train = [s for s in self.train if s.num_anchors > 0]
        state_path = self.out_dir / "state.pt"
        # Loaded onto the CPU whatever device wrote it: load_state_dict copies into the device's parameters and
        # the optimizer moves its state to them.
        resumed = torch.load(state_path, weights_only=False, map_location="cpu") if state_path.is_file() else None
        if resumed is not None:
            if not same_recipe(resumed["config"], cfg) or resumed["train_paths"] != self.train_names:
                raise ByblockError(f"{self.out_dir} holds a run with another recipe or data; use a new --out")
            vocab, mask_id = resumed["draft_vocab"], resumed["mask_token_id"]
            self.coverage = resumed["coverage"]
        elif cfg.init_from:
            from byblock.drafters.dflash_format import load_dflash

            start_model, start_vocab = load_dflash(cfg.init_from)
            vocab = start_vocab if start_vocab is not None else torch.arange(target.vocab_size)
            mask_id = start_model.config.mask_token_id
            if start_vocab is not None and not cfg.domino and cfg.draft_vocab_size > len(vocab):
                # New data (e.g. raw code) may use tokens the start vocabulary lacks; the backbone has no
                # per-token weights (the head is the target's), so growing the vocabulary is free. A Domino
                # head is indexed by draft id and must keep its backbone's vocabulary.
                keep = set(vocab.tolist()) | set(target.eos_token_ids)
                vocab, self.coverage = build_draft_vocab(self.train, cfg.draft_vocab_size, keep)
            else:
                self.coverage = start_model.config.extra.get("draft_vocab_coverage", 1.0)
        else:
            if cfg.draft_vocab_size:
                vocab, self.coverage = build_draft_vocab(self.train, cfg.draft_vocab_size, set(target.eos_token_ids))
            else:
                vocab, self.coverage = torch.arange(target.vocab_size), 1.0
            mask_id = pick_mask_token(target.tokenizer, self.train, target.eos_token_ids, target.vocab_size)
        self.vocab = vocab
        self.to_draft = target_to_draft(vocab, target.vocab_size)
        self.head_t = head[vocab].t().contiguous()  # [H, Vd]
        layer_ids = tuple(self.manifest["layer_ids"])
        tc = target.text_config
        self.model_cfg = DFlashConfig(
            hidden_size=target.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=tc.num_attention_heads,
            num_kv_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=getattr(tc, "head_dim", None) or target.hidden_size // tc.num_attention_heads,
            block_size=cfg.block_size,
            mask_token_id=mask_id,
            target_layer_ids=layer_ids,
            num_target_layers=target.num_layers,
            vocab_size=target.vocab_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=target.max_context,
            sliding_window=cfg.sliding_window or None,
            extra={"target": target_name, "recipe": asdict(cfg), "draft_vocab_coverage": round(self.coverage, 5)},
        )
        torch.manual_seed(cfg.seed)
        self.model = DFlashDraftModel(self.model_cfg)
        if cfg.init_from and resumed is None:
            self.model.load_state_dict(start_model.state_dict())
        elif cfg.init_from_target and resumed is None:
            init_from_target(self.model, target.hf)
        del target
        self.head: DominoHead | None = None
        if cfg.domino:
            dcfg = DominoConfig(self.model_cfg.hidden_size, len(vocab), cfg.gru_hidden_dim, cfg.emb_dim)
            self.head = DominoHead(dcfg)
            if cfg.init_from and resumed is None and has_domino(cfg.init_from):
                # Warm start: the head trained on this backbone (e.g. frozen) continues, jointly or not.
                start_head = load_domino(cfg.init_from, self.model_cfg.hidden_size)
                if start_head.config != dcfg:
                    raise ByblockError(f"the Domino head in {cfg.init_from} has another shape than this recipe's")
                self.head.load_state_dict(start_head.state_dict())
        if cfg.freeze_backbone and not cfg.domino:
            raise ByblockError("--freeze-backbone only makes sense with --domino")
        self.net = _Net(self.model, self.head, cfg.freeze_backbone).to(self.device)
        self.embed, self.head_t = self.embed.to(self.device), self.head_t.to(self.device)
        self.weights = decay_weights(cfg.block_size, cfg.gamma or default_gamma(cfg.block_size))
        self.opt = build_optimizer(self.net, cfg.optimizer, cfg.lr, cfg.weight_decay)  # training/optim.py
        self.step = 0
        self.train_seconds = 0.0  # wall time spent in run(), summed over resumes
        if resumed is not None:
            self.net.load_state_dict(resumed["model"])
            self.opt.load_state_dict(resumed["optimizer"])
            self.step = resumed["step"]
            self.train_seconds = resumed.get("train_seconds", 0.0)
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.net, device_ids=ids)

    # ---- one step -----------------------------------------------------------------------------------------

    def batch_for(self, step: int, rank: int) -> Batch:
        """The batch of (step, rank): a pure function of the seed, so resuming replays the same data."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + rank)
        idx = torch.randint(len(self.train), (self.cfg.seqs_per_step,), generator=g).tolist()
        seqs = [self.train[i] for i in idx]
        anchors = [sample_anchors(s, self.cfg.anchors_per_seq, g) for s in seqs]
        window = self.model_cfg.sliding_window
        return make_batch(
            seqs, anchors, self.cfg.block_size, self.model_cfg.mask_token_id, self.to_draft, self.weights, window
        )

    def _position_loss(self, logits: torch.Tensor, batch: Batch, sel: torch.Tensor) -> torch.Tensor:
        """Per-position loss [N] for draft logits [N, Vd] at the labelled positions `sel`."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        labels = batch.labels[sel]
        hard = -logp.gather(1, labels[:, None])[:, 0]
        if self.cfg.distill <= 0:
            return hard
        sid = batch.soft_ids[sel]  # [N, k]
        ok = sid != IGNORE
        # Renormalised top-k; a position whose top-k all fall outside the draft vocabulary has no soft target
        # (softmax of all -inf is NaN: it left the gradient alone but printed loss=nan).
        pt = torch.softmax(batch.soft_logp[sel].masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
        soft = -(pt * logp.gather(1, sid.clamp(min=0)).masked_fill(~ok, 0.0)).sum(-1)
        return (1 - self.cfg.distill) * hard + self.cfg.distill * soft

    def curriculum(self) -> float:
        """Domino's λ: weight of the base-logit loss, linearly 1 -> 0 over lambda_decay of the run."""
        span = max(1.0, self.cfg.lambda_decay * self.cfg.steps)
        return max(0.0, 1.0 - self.step / span)

    def draft_logits(self, batch: Batch, net: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Base logits [b, T, Vd] and, with a Domino head, teacher-forced corrected ones (else None)."""
        emb = F.embedding(batch.block_ids, self.embed)  # [b, T, H]
        prefix = F.embedding(batch.block_tokens, self.embed) if self.head is not None else None
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            h, res = net(emb, batch.ctx_hidden.float(), batch.block_pos, batch.ctx_pos, batch.mask, prefix)
            base = h @ self.head_t  # [b, T, Vd]
        final = None if res is None else base.float() + res.float()
        return base, final

    def loss(self, batch: Batch, net: torch.nn.Module) -> tuple[torch.Tensor, dict]:
        """Weighted CE (+ distillation) over labelled block positions; Domino adds the curriculum mix."""
        base, final = self.draft_logits(batch, net)
        sel = batch.weights > 0  # [b, T]
        w = batch.weights[sel]
        labels = batch.labels[sel]
        loss = (w * self._position_loss(base[sel], batch, sel)).sum() / w.sum()
        scored = base[sel]
        if final is not None:
            # Base-anchored curriculum; with a frozen backbone the base term carries no gradient, so only
            # the corrected logits are trained.
            lam = 0.0 if self.cfg.freeze_backbone else self.curriculum()
            final_loss = (w * self._position_loss(final[sel], batch, sel)).sum() / w.sum()
            loss = lam * loss + (1 - lam) * final_loss
            scored = final[sel]
        acc = (scored.argmax(-1) == labels).float().mean()  # a tensor: read on logging steps only (a host sync)
        return loss, {"acc": acc}

    def evaluate(self) -> dict:
        """Offline τ on every held-out set: the main set's fields at top level, the others' τ as tau_NAME."""
        result = self.evaluate_on(self.val)
        for name, seqs in self.val_seqs.items():
            if name != "main":
                other = self.evaluate_on(seqs)
                result[f"tau_{name}"] = other["tau"]
                if "base_tau" in other:
                    result[f"base_tau_{name}"] = other["base_tau"]
        return result

    @torch.no_grad()
    def evaluate_on(self, val: list[Sequence]) -> dict:
        """Offline τ and per-position acceptance on held-out blocks (greedy, teacher-forced context).

        With a Domino head, τ is the corrected chain's and `base_tau` the backbone's own (the DFlash chain the
        same weights give without the head) — a joint run must not buy one with the other."""
        self.net.eval()
        g = torch.Generator().manual_seed(12345)
        block = self.cfg.block_size
        accepted_total, base_total, blocks = 0, 0, 0
        per_pos = torch.zeros(block - 1)
        seqs = [s for s in val if s.num_anchors > 0]
        while blocks < self.cfg.val_blocks and seqs:
            chosen = [seqs[int(torch.randint(len(seqs), (1,), generator=g))] for _ in range(8)]
            anchors = [sample_anchors(s, 4, g) for s in chosen]
            batch = make_batch(
                chosen,
                anchors,
                block,
                self.model_cfg.mask_token_id,
                self.to_draft,
                self.weights,
                self.model_cfg.sliding_window,
            )
            batch = batch.to(self.device)
            base, final = self.draft_logits(batch, self.net)
            # Teacher forcing is exact here: acceptance stops at the first miss, so every position that
            # counts saw a prefix equal to the true tokens, as the Domino GRU does at inference.
            # A block only counts positions with a real next token; acceptance stops at the first miss.
            has_label = (batch.labels.view(-1, block)[:, 1] != IGNORE) | (batch.weights.view(-1, block)[:, 1] > 0)
            run = _accepted_runs(base if final is None else final, batch.labels, has_label, block)
            accepted_total += int(run.sum())
            per_pos += run.float().sum(0)
            blocks += int(has_label.sum())
            if final is not None:
                base_total += int(_accepted_runs(base, batch.labels, has_label, block).sum())
        self.net.train()
        n = max(1, blocks)
        result = {"tau": 1 + accepted_total / n, "per_position": (per_pos / n).tolist(), "blocks": blocks}
        if self.head is not None:
            result["base_tau"] = 1 + base_total / n
        return result

    # ---- the loop -----------------------------------------------------------------------------------------

    def save_state(self) -> None:
        """Atomically replace state.pt (rank 0 only)."""
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "config": asdict(self.cfg),
            "train_paths": self.train_names,
            "draft_vocab": self.vocab,
            "mask_token_id": self.model_cfg.mask_token_id,
            "coverage": self.coverage,
            "model": self.net.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "train_seconds": self.train_seconds,
        }
        tmp = self.out_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out_dir / "state.pt")

    def export(self, out: str | Path | None = None) -> Path:
        """Write the current weights as a DFlash checkpoint (bf16 + byblock's draft vocabulary)."""
        from byblock.drafters.dflash_format import save_dflash

        vocab = self.vocab if self.cfg.draft_vocab_size or self.cfg.init_from else None
        tokens = sum(len(s.tokens) - s.prompt_len for s in self.train)
        self.model_cfg.extra.update(
            steps=self.step,
            train_sequences=len(self.train),
            train_response_tokens=tokens,
            train_hours=round(self.train_seconds / 3600, 3),
            world_size=self.world,
        )
        path = save_dflash(self.model, out or self.out_dir / "export", torch.bfloat16, draft_vocab=vocab)
        if self.head is not None:
            save_domino(self.head, path)
        return path

    def _log_eval(self, result: dict) -> None:
        def tau(name: str, key: str) -> str:
            base = result.get(f"base_{key}")
            return f"{name} {result[key]:.3f}" + ("" if base is None else f" (base {base:.3f})")

        others = "".join(", " + tau(k[4:], k) for k in result if k.startswith("tau_"))
        log.info("step %d: held-out %s%s", self.step, tau("τ", "tau"), others)

    def run(self, progress: bool = True, stop_after: int | None = None) -> dict:
        """Train to cfg.steps (or `stop_after` more steps); returns the last evaluation."""
        from tqdm import tqdm

        cfg = self.cfg
        model = self.ddp or self.net
        self.net.train()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        logf = (self.out_dir / "train.log").open("a") if self.rank == 0 else None
        if self.rank == 0:
            log.info(
                "train: %d sequences (%d shards), %d held out; draft vocab %d covers %.4f of labels; step %d/%d",
                len(self.train),
                len(self.train_paths),
                len(self.val),
                len(self.vocab),
                self.coverage,
                self.step,
                cfg.steps,
            )
        if self.rank == 0 and self.step == 0 and cfg.init_from:
            # A continued run's starting point on this run's held-out sets: the baseline its evals beat.
            start = self.evaluate()
            assert logf is not None
            logf.write(json.dumps({"step": 0, "eval": start}) + "\n")
            self._log_eval(start)
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        bar = tqdm(total=end, initial=self.step, desc="train", disable=not progress or self.rank != 0)
        last_eval: dict = {}
        t0, blocks_done = time.perf_counter(), 0
        while self.step < end:
            t_step = time.perf_counter()
            lr = cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup)
            for group in self.opt.param_groups:
                group["lr"] = lr
            host_batch = self.batch_for(self.step, self.rank)
            blocks = int((host_batch.weights.view(-1, cfg.block_size) > 0).any(-1).sum())  # counted on the host
            loss, info = self.loss(host_batch.to(self.device), model)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            trained = [p for p in self.net.parameters() if p.requires_grad]
            gnorm = torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
            self.opt.step()
            self.step += 1
            # Wall time without a sync: on a GPU the launch queue is bounded, so over many steps this is the
            # device's time too.
            self.train_seconds += time.perf_counter() - t_step
            logging_step = self.step % 10 == 0 or self.step == end
            blocks_done += blocks * self.world
            bar.update(1)
            if logging_step:  # the only host syncs of a step: loss, accuracy and the gradient norm
                rate = blocks_done / (time.perf_counter() - t0)
                stats = {"loss": loss.item(), "acc": info["acc"].item(), "gnorm": float(gnorm)}
                bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", blocks_s=f"{rate:.0f}")
            if logf is not None and logging_step:
                row = {"step": self.step, "loss": stats["loss"], "acc": stats["acc"], "lr": lr, "gnorm": stats["gnorm"]}
                logf.write(json.dumps({**row, "blocks_per_s": rate}) + "\n")
                logf.flush()
            if self.step % cfg.ckpt_every == 0 or self.step == end:
                self.save_state()
            if self.rank == 0 and (self.step % cfg.eval_every == 0 or self.step == end):
                last_eval = self.evaluate()
                assert logf is not None
                logf.write(json.dumps({"step": self.step, "eval": last_eval}) + "\n")
                logf.flush()
                self._log_eval(last_eval)
        bar.close()
        if logf is not None:
            logf.close()
        return last_eval
