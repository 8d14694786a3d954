"""Train an EAGLE-3 head on regenerated shards (the DFlash pipeline's data: no target forwards, features on disk).

Training-time test (the paper's TTT, SpecForge `ttt_length`): the head is unrolled K steps on its own outputs.
Step 0 reads the target's fused features g_i with the embedding of x_{i+1} at position i and predicts x_{i+2};
step j reads its step j−1 output with the embedding of x_{i+1+j} at position i + j and predicts x_{i+2+j}.
A step-j row attends step 0's keys at rows ≤ i (the committed context, causal) and steps 1..j's keys at its
own row only — exactly the keys a drafted token at depth j + 1 sees at inference (drafters/eagle3.py).
Loss: Σ_j 0.8^j · CE_j over response labels in the draft vocabulary (EAGLE-3's weighting).
Offline τ on held-out shards: greedy chain acceptance is the leading run of steps whose argmax is the label.

Resumable like the DFlash trainer: `state.pt` replaced atomically every `ckpt_every` steps; batches depend only
on (seed, step), so a resumed run sees the batches the killed one would have seen.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from byblock.drafters.eagle3_model import Eagle3Config, Eagle3DraftModel, default_layer_ids, init_from_target
from byblock.errors import ByblockError, InvalidParameterError
from byblock.training.dflash_data import IGNORE, Sequence, build_draft_vocab, cosine_lr, load_shards, target_to_draft
from byblock.training.dflash_train import _read_manifest, _split_shards
from byblock.training.distributed import process_device
from byblock.training.optim import build_optimizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """Recipe of one EAGLE-3 training run (written next to the checkpoints; a resume must match it)."""

    steps: int = 400
    seqs_per_step: int = 4
    ttt_steps: int = 7  # K: unrolled steps = the deepest chain trained
    lr: float = 3e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    decay: float = 0.8  # step j's loss weight decay^j
    draft_vocab_size: int = 8192  # 0: the full target vocabulary
    init_from_target: bool = True
    optimizer: str = "adamw"  # or "muon" (training/optim.py)
    extra_data: str = ""  # comma-separated regen dirs trained on beside the main one (each holds out its own)
    val_shards: int = 1
    val_seqs: int = 32
    eval_every: int = 100
    ckpt_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.seqs_per_step < 1 or self.ttt_steps < 1 or self.ckpt_every < 1:
            raise InvalidParameterError("eagle3: steps, seqs-per-step, ttt-steps and ckpt-every must be >= 1")
        if self.optimizer not in ("adamw", "muon"):
            raise InvalidParameterError(f"--optimizer must be adamw or muon, not '{self.optimizer}'")
        if not 0.0 < self.decay <= 1.0:
            raise InvalidParameterError("--decay must be in (0, 1]")


def pick_layers(stored: tuple[int, ...], num_target_layers: int) -> tuple[int, ...]:
    """The stored feature layers nearest to vLLM's default low / mid / high ones (distinct, ascending)."""
    chosen: list[int] = []
    for want in default_layer_ids(num_target_layers):
        free = [s for s in stored if s not in chosen]
        if free:
            chosen.append(min(free, key=lambda s: (abs(s - want), s)))
    return tuple(sorted(chosen))


def ttt_forward(
    model: Eagle3DraftModel,
    embed: torch.Tensor,  # [V, H] the target's input embedding
    feats: torch.Tensor,  # [b, T, k*H] target features of rows 0..T-1
    tokens: torch.Tensor,  # [b, T + K + 1] x_0.. padded (0) past each sequence's end
    labels_ok: torch.Tensor,  # [b, T + K + 1] bool: the token at that index is a supervised label
    to_draft: torch.Tensor,  # [V] draft id of each target id, IGNORE outside the draft vocabulary
    steps: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The K unrolled steps -> per step j: (outputs [b, T, H], draft-vocab labels x_{i+2+j} [b, T], which rows
    carry a label [b, T])."""
    b, t, _ = feats.shape
    dev = feats.device
    h = model.fc(feats)
    rows = torch.arange(t, device=dev)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    past, out = [], []
    for j in range(steps):
        emb = F.embedding(tokens[:, 1 + j : 1 + j + t], embed).to(h.dtype)
        labels = to_draft[tokens[:, 2 + j : 2 + j + t]]
        ok = labels_ok[:, 2 + j : 2 + j + t] & (labels != IGNORE)
        mask = torch.cat([causal, *([eye] * j)], dim=1)[None, None] if j else None
        h, kv = model.step(emb, h, (rows + j)[None].expand(b, -1), past, mask)
        past.append(kv)
        out.append((h, labels, ok))
    return out


class Eagle3Trainer:
    """The frozen target tables, the data, the head and its optimizer; `run` trains, `export` writes."""

    def __init__(
        self, target_name: str, data_dir: str | Path, out_dir: str | Path, cfg: Eagle3TrainConfig, device: str = "cpu"
    ) -> None:
        from byblock.models.loading import load_model

        self.cfg = cfg
        self.device = process_device(device)
        self.data_dir, self.out_dir = Path(data_dir), Path(out_dir)
        self.manifest = _read_manifest(self.data_dir)
        dirs = [self.data_dir] + [Path(d.strip()) for d in cfg.extra_data.split(",") if d.strip()]
        self.train_paths, val_paths = [], []
        for d in dirs:
            m = _read_manifest(d)
            if m["layer_ids"] != self.manifest["layer_ids"] or m["target"] != self.manifest["target"]:
                raise ByblockError(f"{d} was regenerated with another target or feature layers than {self.data_dir}")
            tr, va = _split_shards(d, cfg.val_shards)
            self.train_paths += tr
            val_paths += va if d == self.data_dir else []
        self.train_names = [str(p) for p in self.train_paths]
        target = load_model(target_name, device="cpu", dtype="float32", relayout=False)  # only its tables are used
        self.target_name = target_name
        stored = tuple(self.manifest["layer_ids"])
        self.layer_ids = pick_layers(stored, target.num_layers)
        h = target.hidden_size
        cols = [c for i in self.layer_ids for c in range(stored.index(i) * h, (stored.index(i) + 1) * h)]
        self.cols = torch.tensor(cols)
        self.train = [s for s in load_shards(self.train_paths) if s.num_anchors > 1]
        self.val = [s for s in load_shards(val_paths) if s.num_anchors > 1][: cfg.val_seqs]
        if not self.train or not self.val:
            raise ByblockError(f"{self.data_dir}: no usable training or held-out sequences")
        resumed = None
        if (self.out_dir / "state.pt").is_file():
            resumed = torch.load(self.out_dir / "state.pt", weights_only=False, map_location="cpu")
            if resumed["config"] != asdict(cfg) or resumed["train_paths"] != self.train_names:
                raise ByblockError(f"{self.out_dir} holds a run with another recipe or data; use a new --out")
            vocab, self.coverage = resumed["draft_vocab"], resumed["coverage"]
        elif cfg.draft_vocab_size:
            vocab, self.coverage = build_draft_vocab(self.train, cfg.draft_vocab_size, set(target.eos_token_ids))
        else:
            vocab, self.coverage = torch.arange(target.vocab_size), 1.0
        tc = target.text_config
        self.model_cfg = Eagle3Config(
            hidden_size=h,
            intermediate_size=tc.intermediate_size,
            num_heads=tc.num_attention_heads,
            num_kv_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=getattr(tc, "head_dim", None) or h // tc.num_attention_heads,
            vocab_size=target.vocab_size,
            draft_vocab_size=len(vocab),
            target_layer_ids=self.layer_ids,
            num_target_layers=target.num_layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
            rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=target.max_context,
            extra={"target": target_name, "recipe": asdict(cfg), "draft_vocab_coverage": round(self.coverage, 5)},
        )
        torch.manual_seed(cfg.seed)
        self.model = Eagle3DraftModel(self.model_cfg)
        self.model.set_draft_vocab(vocab)
        if cfg.init_from_target and resumed is None:
            init_from_target(self.model, target.hf, vocab)
        self.vocab = vocab
        self.embed = target.hf.get_input_embeddings().weight.detach().to(self.device)
        self.to_draft = target_to_draft(vocab, target.vocab_size).to(self.device)
        del target
        self.model.to(self.device)
        self.opt = build_optimizer(self.model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        self.step, self.train_seconds = 0, 0.0
        if resumed is not None:
            self.model.load_state_dict(resumed["model"])
            self.opt.load_state_dict(resumed["optimizer"])
            self.step, self.train_seconds = resumed["step"], resumed["train_seconds"]

    # ---- batches and the objective ------------------------------------------------------------------------

    def batch_for(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features [b, T, 3H], tokens [b, T+K+1], labels_ok [b, T+K+1]) for whole sequences, right-padded."""
        k = self.cfg.ttt_steps
        t = max(len(s.tokens) - 1 for s in seqs)
        feats = torch.zeros(len(seqs), t, len(self.cols), dtype=torch.float32)
        tokens = torch.zeros(len(seqs), t + k + 1, dtype=torch.long)
        ok = torch.zeros(len(seqs), t + k + 1, dtype=torch.bool)
        for r, s in enumerate(seqs):
            n = len(s.tokens)
            feats[r, : n - 1] = s.hidden[:, self.cols].float()
            tokens[r, :n] = s.tokens
            ok[r, s.prompt_len : n] = True  # response tokens are the labels
        return feats.to(self.device), tokens.to(self.device), ok.to(self.device)

    def _steps(self, seqs: list[Sequence]):
        feats, tokens, ok = self.batch_for(seqs)
        return ttt_forward(self.model, self.embed, feats, tokens, ok, self.to_draft, self.cfg.ttt_steps)

    def loss(self, seqs: list[Sequence]) -> tuple[torch.Tensor, float]:
        """Σ_j decay^j · mean CE_j over the labelled rows (the head runs on those rows only), and step 0's
        top-1 accuracy."""
        total = torch.zeros((), device=self.device)
        acc = 0.0
        for j, (h, labels, ok) in enumerate(self._steps(seqs)):
            if bool(ok.any()):
                logits = self.model.logits(h[ok])
                total = total + self.cfg.decay**j * F.cross_entropy(logits.float(), labels[ok])
                if j == 0:
                    acc = float((logits.argmax(-1) == labels[ok]).float().mean())
        return total, acc

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out greedy chain τ (1 + the leading run of steps whose argmax is the label, over rows whose next
        token is a response label) and each step's accuracy."""
        self.model.eval()
        runs, hits = [], [[] for _ in range(self.cfg.ttt_steps)]
        for s in self.val:
            alive = None
            for j, (h, labels, ok) in enumerate(self._steps([s])):
                hit = (self.model.logits(h[0]).argmax(-1) == labels[0]) & ok[0]
                hits[j].append(hit[ok[0]].float())
                if alive is None:
                    first, alive, run = ok[0], hit, hit.float()
                else:
                    alive = alive & hit
                    run = run + alive.float()
            runs.append(run[first])
        self.model.train()
        every = torch.cat(runs)
        accs = [round(float(torch.cat(h).mean()), 4) if h else 0.0 for h in hits]
        return {"tau": 1.0 + float(every.mean()), "step_acc": accs, "rows": len(every)}

    # ---- the loop -----------------------------------------------------------------------------------------

    def save_state(self) -> None:
        """Atomically replace state.pt."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "config": asdict(self.cfg),
            "train_paths": self.train_names,
            "draft_vocab": self.vocab,
            "coverage": self.coverage,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "train_seconds": self.train_seconds,
        }
        tmp = self.out_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out_dir / "state.pt")

    def export(self, out: str | Path) -> Path:
        """Write the current weights as an EAGLE-3 checkpoint (bf16, the layout vLLM loads)."""
        from byblock.drafters.eagle3_format import save_eagle3

        self.model_cfg.extra.update(
            steps=self.step,
            train_sequences=len(self.train),
            train_response_tokens=sum(len(s.tokens) - s.prompt_len for s in self.train),
            train_hours=round(self.train_seconds / 3600, 3),
            layer_ids=list(self.layer_ids),
        )
        return save_eagle3(self.model, out, torch.bfloat16)

    def run(self, progress: bool = True, stop_after: int | None = None) -> dict:
        """Train to cfg.steps (or `stop_after` more steps); returns the last evaluation."""
        from tqdm import tqdm

        cfg = self.cfg
        self.model.train()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "eagle3: %d sequences, %d held out; layers %s; draft vocab %d covers %.4f; step %d/%d",
            len(self.train),
            len(self.val),
            list(self.layer_ids),
            len(self.vocab),
            self.coverage,
            self.step,
            cfg.steps,
        )
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        bar = tqdm(total=end, initial=self.step, desc="train eagle3", disable=not progress)
        last: dict = {}
        with (self.out_dir / "train.log").open("a") as logf:
            while self.step < end:
                t0 = time.perf_counter()
                lr = cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step * 1009)
                idx = torch.randint(len(self.train), (cfg.seqs_per_step,), generator=g).tolist()
                loss, acc = self.loss([self.train[i] for i in idx])
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                self.opt.step()
                self.step += 1
                self.train_seconds += time.perf_counter() - t0
                bar.update(1)
                if self.step % 10 == 0 or self.step == end:
                    bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
                    row = {"step": self.step, "loss": loss.item(), "acc0": acc, "lr": lr, "gnorm": float(gnorm)}
                    logf.write(json.dumps(row) + "\n")
                    logf.flush()
                if self.step % cfg.ckpt_every == 0 or self.step == end:
                    self.save_state()
                if self.step % cfg.eval_every == 0 or self.step == end:
                    last = self.evaluate()
                    logf.write(json.dumps({"step": self.step, "eval": last}) + "\n")
                    logf.flush()
                    log.info("step %d: held-out τ %.3f, step accuracy %s", self.step, last["tau"], last["step_acc"])
        bar.close()
        return last
