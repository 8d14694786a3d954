"""Sudoku as a text task for small diffusion and AR models: generator, solver, validator, tokenizer.

A puzzle of side n = box_rows × box_cols is a string of n² digits, '0' for a blank; its answer is the
n² digits of the unique solution. The generator draws a random full grid, then blanks cells in random
order while the solution stays unique (checked by the solver), down to a target number of clues.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL = ("<pad>", "<eos>", "<mask>", "<sep>")
DIGITS = "0123456789"


@dataclass(frozen=True)
class Board:
    """Geometry of an n×n Sudoku with box_rows × box_cols boxes."""

    box_rows: int = 2
    box_cols: int = 3

    @property
    def n(self) -> int:
        """Side length (and number of symbols)."""
        return self.box_rows * self.box_cols

    def units(self) -> list[list[int]]:
        """Every row, column and box as a list of cell indices."""
        n = self.n
        rows = [[r * n + c for c in range(n)] for r in range(n)]
        cols = [[r * n + c for r in range(n)] for c in range(n)]
        boxes = [
            [(br + i) * n + bc + j for i in range(self.box_rows) for j in range(self.box_cols)]
            for br in range(0, n, self.box_rows)
            for bc in range(0, n, self.box_cols)
        ]
        return rows + cols + boxes

    def peers(self) -> list[list[int]]:
        """For each cell, the other cells that share a unit with it."""
        peers: list[set[int]] = [set() for _ in range(self.n * self.n)]
        for unit in self.units():
            for c in unit:
                peers[c].update(unit)
        return [sorted(p - {i}) for i, p in enumerate(peers)]


def count_solutions(
    board: Board, grid: list[int], limit: int = 2, rng: random.Random | None = None
) -> tuple[int, list[int] | None]:
    """Number of solutions up to `limit`, and the first found. grid: n² ints, 0 = blank.

    Depth-first search on the most constrained blank cell with bitmask candidates; `rng` shuffles the
    candidate order (used to draw random full grids)."""
    n = board.n
    peers = board.peers()
    full = (1 << (n + 1)) - 2  # bits 1..n
    cells = list(grid)
    found: list[list[int]] = []

    def candidates(i: int) -> int:
        used = 0
        for p in peers[i]:
            used |= 1 << cells[p]
        return full & ~used

    def search() -> None:
        best, best_mask, best_count = -1, 0, n + 1
        for i, v in enumerate(cells):
            if v == 0:
                m = candidates(i)
                c = m.bit_count()
                if c < best_count:
                    best, best_mask, best_count = i, m, c
                    if c <= 1:
                        break
        if best < 0:
            found.append(list(cells))
            return
        digits = [d for d in range(1, n + 1) if best_mask >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        for d in digits:
            cells[best] = d
            search()
            if len(found) >= limit:
                break
        cells[best] = 0

    for i, v in enumerate(cells):
        if v and candidates(i) & (1 << v) == 0 and any(cells[p] == v for p in peers[i]):
            return 0, None  # the givens already conflict
    search()
    return len(found), (found[0] if found else None)


def make_puzzle(board: Board, rng: random.Random, min_clues: int) -> tuple[str, str]:
    """A random puzzle with a unique solution and (at least) min_clues givens: (puzzle, solution) strings."""
    n2 = board.n * board.n
    _, solution = count_solutions(board, [0] * n2, limit=1, rng=rng)
    assert solution is not None
    grid = list(solution)
    order = list(range(n2))
    rng.shuffle(order)
    clues = n2
    for i in order:
        if clues <= min_clues:
            break
        keep = grid[i]
        grid[i] = 0
        if count_solutions(board, grid, limit=2)[0] != 1:
            grid[i] = keep
        else:
            clues -= 1
    return "".join(map(str, grid)), "".join(map(str, solution))


def is_solution(board: Board, puzzle: str, answer: str) -> bool:
    """True when `answer` fills the puzzle's blanks, keeps its givens, and satisfies every unit."""
    n = board.n
    if len(answer) != n * n or any(ch not in DIGITS[1 : n + 1] for ch in answer):
        return False
    if any(p != "0" and p != a for p, a in zip(puzzle, answer, strict=True)):
        return False
    want = set(DIGITS[1 : n + 1])
    return all({answer[i] for i in unit} == want for unit in board.units())


def make_tokenizer(save_dir: str | Path | None = None):
    """A character-level tokenizer: 4 special tokens, then the digits 0-9 (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *DIGITS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters back to a string with no spaces between them
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>", sep_token="<sep>"
    )
    if save_dir is not None:
        fast.save_pretrained(save_dir)
    return fast


def puzzle_prompt(tok, puzzle: str) -> list[int]:
    """Token ids of a puzzle prompt: its digits, then <sep> (what the models were trained on)."""
    return [*tok(puzzle, add_special_tokens=False)["input_ids"], tok.sep_token_id]


@torch.inference_mode()
def solve_ar(model, tok, puzzle: str) -> str:
    """Greedy left-to-right answer of an AR model (one cached forward per cell)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    device = next(model.parameters()).device
    ids = torch.tensor([puzzle_prompt(tok, puzzle)], device=device)
    out: list[int] = []
    for _ in range(len(puzzle)):
        nxt = int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.tensor([[nxt]], device=device)
    return tok.decode(out)


@torch.inference_mode()
def solve_mdm(denoiser, tok, puzzle: str, cfg) -> tuple[str, int]:
    """(answer, denoising forwards) of a diffusion model for one puzzle, with DllmConfig `cfg`."""
    from dataclasses import replace

    from byblock.dllm.generate import diffusion_generate

    res = diffusion_generate(denoiser, puzzle_prompt(tok, puzzle), replace(cfg, max_new_tokens=len(puzzle)))
    return tok.decode(res.token_ids), res.nfe
