"""Train a small masked-diffusion model (MDM) and an autoregressive model of the same size on Sudoku.

Both are transformers Llama-architecture models with the same config, data, batch size and steps; only
the objective and the attention mask differ:
- MDM: [puzzle ; <sep>] is causal, the answer canvas attends to all of it and to itself (bidirectional);
  each example masks every answer cell with probability t ~ U(ε, 1) and the loss is the cross-entropy on
  the masked cells weighted by 1/t (the MDLM / LLaDA ELBO), so at decode time the model can fill the
  easiest cells first and look at every cell — the property seed 001 credits for DiffusionGemma's Sudoku.
- AR: the usual next-token loss on the answer (and <eos>), left to right.

Stages are resumable: puzzles are generated in chunks to OUT/data/*.jsonl, training writes OUT/<kind>/state.pt
atomically every --ckpt-every steps and resumes from it bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from byblock.dllm.config import DllmConfig, SamplerKind
from byblock.dllm.denoisers import MaskDenoiser, segment_mask
from byblock.dllm.loading import DLLM_CONFIG
from byblock.dllm.sudoku import Board, is_solution, make_puzzle, make_tokenizer, puzzle_prompt, solve_ar, solve_mdm
from byblock.errors import ByblockError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PuzzleConfig:
    """The generated task."""

    box_rows: int = 2
    box_cols: int = 3
    train_puzzles: int = 60_000
    test_puzzles: int = 500
    min_clues: int = 8  # blank cells while the solution stays unique, down to this many givens
    seed: int = 0

    @property
    def board(self) -> Board:
        """The board geometry."""
        return Board(self.box_rows, self.box_cols)


@dataclass(frozen=True)
class DllmTrainConfig:
    """One training run (MDM or AR); both runs of a comparison share everything but `kind`."""

    kind: str = "mdm"  # "mdm" or "ar"
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 256
    steps: int = 4000
    batch_size: int = 128
    lr: float = 1e-3
    warmup: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 500
    eval_puzzles: int = 200
    ckpt_every: int = 100
    seed: int = 0


def generate_puzzles(out: Path, cfg: PuzzleConfig, progress: bool = True) -> tuple[Path, Path]:
    """Write OUT/data/{train,test}.jsonl (resumable: appends to what exists; test puzzles never in train)."""
    from tqdm import tqdm

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    meta = data / "config.json"
    if meta.is_file() and json.loads(meta.read_text()) != asdict(cfg):
        raise ByblockError(f"{data} holds puzzles from another configuration; use a new --out")
    meta.write_text(json.dumps(asdict(cfg)))
    paths = (data / "train.jsonl", data / "test.jsonl")
    board = cfg.board
    test_seen: set[str] = set()
    for path, count, seed in ((paths[1], cfg.test_puzzles, cfg.seed + 1), (paths[0], cfg.train_puzzles, cfg.seed)):
        lines = path.read_text().splitlines() if path.is_file() else []
        lines = [ln for ln in lines if ln.endswith("}")]  # a line cut by a kill is dropped and redone
        rng = random.Random(f"{seed}:{len(lines)}")
        with path.open("w") as f:
            for ln in lines:
                f.write(ln + "\n")
            bar = tqdm(total=count, initial=len(lines), desc=f"puzzles {path.stem}", disable=not progress)
            done = len(lines)
            while done < count:
                puzzle, solution = make_puzzle(board, rng, cfg.min_clues)
                if path == paths[0] and puzzle in test_seen:
                    continue
                f.write(json.dumps({"puzzle": puzzle, "solution": solution}) + "\n")
                done += 1
                bar.update(1)
                if done % 1000 == 0:
                    f.flush()
            bar.close()
        if path == paths[1]:
            test_seen = {json.loads(ln)["puzzle"] for ln in path.read_text().splitlines()}
    return paths


def load_puzzles(path: Path) -> list[tuple[str, str]]:
    """(puzzle, solution) pairs of a JSONL file."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [(r["puzzle"], r["solution"]) for r in rows]


def build_model(cfg: DllmTrainConfig, vocab_size: int, max_len: int):
    """A Llama-architecture model (same for MDM and AR)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    conf = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(conf)


class DllmTrainer:
    """Trains one model (MDM or AR) on the generated puzzles; evaluates solve rate on held-out ones."""

    def __init__(self, out: Path, puzzles: PuzzleConfig, cfg: DllmTrainConfig) -> None:
        if cfg.kind not in ("mdm", "ar"):
            raise ByblockError(f"unknown model kind '{cfg.kind}' (mdm or ar)")
        self.out, self.pcfg, self.cfg = out, puzzles, cfg
        self.dir = out / cfg.kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tok = make_tokenizer()
        self.board = puzzles.board
        self.cells = self.board.n * self.board.n
        self.train = load_puzzles(out / "data" / "train.jsonl")
        self.test = load_puzzles(out / "data" / "test.jsonl")
        if len(self.train) < puzzles.train_puzzles:
            raise ByblockError("puzzle generation is incomplete: run the generate stage first")
        self.model = build_model(cfg, len(self.tok), 2 * self.cells + 4)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}], lr=cfg.lr
        )
        self.step = 0
        state = self.dir / "state.pt"
        if state.is_file():
            saved = torch.load(state, weights_only=False)
            if saved["config"] != asdict(cfg) or saved["puzzles"] != asdict(puzzles):
                raise ByblockError(f"{self.dir} holds a run with another recipe; use a new --out")
            self.model.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["opt"])
            self.step = saved["step"]
            torch.set_rng_state(saved["rng"])
        self.mask_id = self.tok.mask_token_id
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Digits to token ids."""
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic batch of (prompt ids [B, n²+1], answer ids [B, n²]) for a step."""
        rng = random.Random(f"{self.cfg.seed}:{step}")
        rows = [self.train[rng.randrange(len(self.train))] for _ in range(self.cfg.batch_size)]
        prompts = torch.tensor([puzzle_prompt(self.tok, p) for p, _ in rows])
        answers = torch.tensor([self.encode(s) for _, s in rows])
        return prompts, answers

    def loss(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """The run's objective on one batch."""
        b, p = prompts.shape
        a = answers.shape[1]
        if self.cfg.kind == "ar":
            ids = torch.cat([prompts, answers, torch.full((b, 1), self.eos_id)], dim=1)
            logits = self.model(input_ids=ids).logits[:, p - 1 : -1]  # predicts answer + eos
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, p:].reshape(-1))
        t = torch.rand(b, 1).clamp_min(1e-3)  # masking ratio per example
        masked = torch.rand(b, a) < t
        noisy = torch.where(masked, torch.full_like(answers, self.mask_id), answers)
        ids = torch.cat([prompts, noisy], dim=1)
        mask = segment_mask([(p, False), (a, True)], torch.float32)
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, p:]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), answers.reshape(-1), reduction="none"
        )
        return ((ce.view(b, a) * masked) / t).sum() / (b * a)

    def lr_at(self, step: int) -> float:
        """Linear warm-up then cosine decay to 0."""
        warm = max(1, int(self.cfg.warmup * self.cfg.steps))
        if step < warm:
            return self.cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, self.cfg.steps - warm)
        return self.cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    def save_state(self) -> None:
        """Atomic checkpoint of everything a resume needs."""
        tmp = self.dir / "state.pt.tmp"
        torch.save(
            {
                "config": asdict(self.cfg),
                "puzzles": asdict(self.pcfg),
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "step": self.step,
                "rng": torch.get_rng_state(),
            },
            tmp,
        )
        os.replace(tmp, self.dir / "state.pt")

    def export(self) -> Path:
        """A checkpoint `byblock generate` loads: transformers weights + tokenizer (+ byblock_dllm.json for MDM)."""
        path = self.out / f"export-{self.cfg.kind}"
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tok.save_pretrained(path)
        for f in path.iterdir():
            f.chmod(0o644)  # readable by whoever installs the package
        if self.cfg.kind == "mdm":
            meta = {"mask_token_id": self.mask_id, "block_size": self.cells, "task": "sudoku", "prompt_suffix": "<sep>"}
            meta["max_new_tokens"] = self.cells
            meta["board"] = [self.board.box_rows, self.board.box_cols]
            (path / DLLM_CONFIG).write_text(json.dumps(meta, indent=1))
        return path

    def evaluate(self, limit: int | None = None) -> float:
        """Solve rate on held-out puzzles (MDM: threshold 0.9 sampler; AR: greedy)."""
        puzzles = self.test[: limit or self.cfg.eval_puzzles]
        self.model.eval()
        if self.cfg.kind == "ar":
            answers = [solve_ar(self.model, self.tok, p) for p, _ in puzzles]
        else:
            denoiser = MaskDenoiser(self.model, self.mask_id, self.cells)
            cfg = DllmConfig(sampler=SamplerKind.THRESHOLD, threshold=0.9)
            answers = [solve_mdm(denoiser, self.tok, p, cfg)[0] for p, _ in puzzles]
        solved = sum(is_solution(self.board, p, a) for (p, _), a in zip(puzzles, answers, strict=True))
        self.model.train()
        return solved / len(puzzles)

    def run(self, progress: bool = True, until: int | None = None) -> dict:
        """Train to cfg.steps (or `until`), resuming, evaluating and checkpointing on the way; export at the end.

        A fresh run seeds the RNG here; a resumed one continues the RNG state saved with its checkpoint, so
        an interrupted run ends bit-identical to an uninterrupted one."""
        from tqdm import tqdm

        logf = (self.dir / "train.log").open("a")
        if self.step == 0:
            torch.manual_seed(self.cfg.seed + 1)
        self.model.train()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.cfg.kind}", disable=not progress)
        t0 = time.perf_counter()
        stop = min(self.cfg.steps, until or self.cfg.steps)
        while self.step < stop:
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.step)
            loss = self.loss(*self.batch(self.step))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            record: dict = {"step": self.step, "loss": round(loss.item(), 5), "s": round(time.perf_counter() - t0, 1)}
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                record["solve_rate"] = self.evaluate()
            if self.step % 10 == 0 or "solve_rate" in record:
                logf.write(json.dumps(record) + "\n")
                logf.flush()
            if self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save_state()
        bar.close()
        if self.step < self.cfg.steps:
            self.save_state()
            return {"steps": self.step}
        path = self.export()
        return {"steps": self.step, "export": str(path)}
