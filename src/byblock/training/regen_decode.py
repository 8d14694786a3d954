"""Continuous batching for regeneration: a running batch of decoding rows, refilled as answers finish.

Decoding a fixed batch to completion leaves rows idle once their answers end (a batch runs as long as its
longest answer), and one decode step at batch b costs far less than b steps at batch 1 on a CPU, so idle rows
are lost throughput. Here a row that finishes is dropped at once and, whenever at least `refill` rows are free,
the next prompts are prefilled as a left-padded mini-batch and merged into the running cache.

Layout: every row's cache slots are [left padding | prompt | answer so far], all rows `length` slots long, the
padding masked out (`attn` [b, length] bool). New rows are left-padded to the running length (or, rarely, the
running rows to theirs); slots every row has as padding are dropped when there are `compact` of them, so the
cache stays about as long as the longest live row. K/V live in preallocated buffers (kv/kv_buffer.py).

Per row the result is what decoding it alone would give (greedy; up to the fp32 summation-order effects of batch
composition that every batched decoder has), and sampled rows draw from their own seeded generator, so a row's
sample does not depend on which rows shared its steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from byblock.kv.kv_buffer import buffered_cache


@dataclass(frozen=True)
class DecodeSettings:
    """What every row is decoded with."""

    layer_ids: tuple[int, ...]
    eos_ids: frozenset[int]
    pad_id: int
    max_new_tokens: int
    topk: int
    temperature: float
    rows: int = 128  # running batch size
    refill: int = 16  # prefill new prompts once this many rows are free (a merge copies the whole cache)
    compact: int = 64  # drop shared leading padding once it is this many slots


@dataclass
class _Row:
    """A live sequence: its prompt, what it has produced, and its sampler."""

    key: int
    prompt: list[int]
    generator: torch.Generator | None
    response: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # bf16 [n, kH] chunks
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_lp: list[torch.Tensor] = field(default_factory=list)

    def result(self) -> dict[str, torch.Tensor]:
        return {
            "tokens": torch.tensor(self.prompt + self.response, dtype=torch.int32, device="cpu"),
            # results go to disk: moved off the model's device once per finished row
            "hidden": torch.cat(self.hidden).cpu(),  # [P + R - 1, kH]: every token but the last was fed
            "topk_ids": torch.stack(self.top_ids).cpu(),  # [R, k]
            "topk_logp": torch.stack(self.top_lp).cpu(),  # [R, k]
        }


class ContinuousDecoder:
    """Decodes (key, prompt ids, seed) jobs with a refilled running batch; yields (key, result) as rows end."""

    def __init__(self, hf_model: torch.nn.Module, settings: DecodeSettings) -> None:
        self.hf = hf_model
        self.s = settings
        self.dev = dev = next(hf_model.parameters()).device  # every batch tensor lives beside the model
        self.rows: list[_Row] = []
        self.cache = None
        self.attn = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [b, L] which slots each row may attend to
        self.next_pos = torch.zeros(0, dtype=torch.long, device=dev)  # [b] position of the token each row feeds next
        self.logits = torch.zeros(0, 0, device=dev)  # [b, V] each row's next-token logits

    def _features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat([hidden_states[i + 1] for i in self.s.layer_ids], dim=-1)  # [b, T, kH]

    @torch.inference_mode()
    def _admit(self, jobs: list[tuple[int, list[int], int]]) -> None:
        """Prefill `jobs` as a left-padded mini-batch and merge them into the running batch."""
        prompts = [p for _, p, _ in jobs]
        width = max(len(p) for p in prompts)
        rows = [[self.s.pad_id] * (width - len(p)) + p for p in prompts]
        ids = torch.tensor(rows, dtype=torch.long, device=self.dev)  # [n, P]
        lens = torch.tensor([len(p) for p in prompts], device=self.dev)
        attn = torch.arange(width, device=self.dev)[None, :] >= (width - lens)[:, None]  # [n, P]
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)  # [n, P]
        # Explicit 4-D boolean masks: with a 2-D padding mask transformers builds its own and decode steps run
        # ~7x slower on CPU. A padding query sees itself so no row is empty (an all-masked row would put NaN
        # into the cache).
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=self.dev))
        mask = (causal[None] & attn[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.dev)[None]
        cache = buffered_cache()
        out = self.hf(
            input_ids=ids,
            attention_mask=mask[:, None],  # [n, 1, P, P]
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=True,
        )
        feats = self._features(out.hidden_states)  # [n, P, kH]
        for i, (key, p, seed) in enumerate(jobs):
            gen = torch.Generator(device=self.dev).manual_seed(seed) if self.s.temperature > 0 else None
            row = _Row(key, p, gen)
            row.hidden.append(feats[i, width - len(p) :].to(torch.bfloat16))
            self.rows.append(row)
        logits = out.logits[:, -1].float()  # [n, V]
        next_pos = lens
        if self.cache is None:
            self.cache, self.attn, self.next_pos, self.logits = cache, attn, next_pos, logits
            return
        grow_old, grow_new = max(0, width - self.attn.shape[1]), max(0, self.attn.shape[1] - width)
        for old_layer, new_layer in zip(self.cache.layers, cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(old_layer, name), getattr(new_layer, name)
                a = torch.nn.functional.pad(a, (0, 0, grow_old, 0))  # left-pad the slot axis
                b = torch.nn.functional.pad(b, (0, 0, grow_new, 0))
                setattr(old_layer, name, torch.cat([a, b]))
        self.attn = torch.cat(
            [
                torch.nn.functional.pad(self.attn, (grow_old, 0)),
                torch.nn.functional.pad(attn, (grow_new, 0)),
            ]
        )
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.logits = torch.cat([self.logits, logits])

    def _choose(self, logp: torch.Tensor) -> torch.Tensor:
        """Each row's next token from its log-probs [b, V]: argmax, or a Gumbel-max sample from the row's own
        stream."""
        if self.s.temperature <= 0:
            return logp.argmax(-1)
        vocab = logp.shape[-1]
        u = torch.stack([torch.rand(vocab, generator=r.generator, device=self.dev) for r in self.rows])
        u = u.clamp_min(1e-20)
        return (logp / self.s.temperature - torch.log(-torch.log(u))).argmax(-1)

    @torch.inference_mode()
    def _step(self) -> list[_Row]:
        """Pick every row's token; drop finished rows; feed the rest one token. Returns the finished rows."""
        logp = torch.log_softmax(self.logits, dim=-1)  # [b, V]
        nxt = self._choose(logp)  # [b]
        lp, li = logp.topk(self.s.topk, dim=-1)  # [b, k]
        keep: list[int] = []
        done: list[_Row] = []
        picked = nxt.tolist()  # one host sync per step for the whole batch
        for r, row in enumerate(self.rows):
            tok = picked[r]
            row.response.append(tok)
            row.top_ids.append(li[r].to(torch.int32))
            row.top_lp.append(lp[r].to(torch.float16))
            if tok in self.s.eos_ids or len(row.response) >= self.s.max_new_tokens:
                done.append(row)
            else:
                keep.append(r)
        if not keep:
            self.rows, self.cache = [], None
            return done
        if done:
            idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
            self.rows = [self.rows[r] for r in keep]
            self.attn, self.next_pos, nxt = self.attn[idx], self.next_pos[idx], nxt[idx]
            self.cache.batch_select_indices(idx)
        lead = int((~self.attn).long().cumprod(-1).sum(-1).min())  # padding slots every row has in front
        if lead >= self.s.compact:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., lead:, :], layer.values[..., lead:, :]
            self.attn = self.attn[:, lead:]
        self.attn = torch.cat([self.attn, torch.ones(len(self.rows), 1, dtype=torch.bool, device=self.dev)], dim=-1)
        out = self.hf(
            input_ids=nxt[:, None],
            attention_mask=self.attn[:, None, None, :],  # [b, 1, 1, L+1]
            position_ids=self.next_pos[:, None],
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        feats = self._features(out.hidden_states)  # [b, 1, kH]
        for r, row in enumerate(self.rows):
            row.hidden.append(feats[r].to(torch.bfloat16))
        self.logits = out.logits[:, -1].float()
        self.next_pos = self.next_pos + 1
        return done

    def run(self, jobs: Iterable[tuple[int, list[int], int]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Decode every job (key, prompt ids, sampling seed); yields (key, result) in the order rows finish."""
        pending = iter(jobs)
        exhausted = False
        while True:
            free = self.s.rows - len(self.rows)
            if not exhausted and (free >= self.s.refill or not self.rows):
                batch = [job for _, job in zip(range(free), pending, strict=False)]
                exhausted = len(batch) < free
                if batch:
                    self._admit(batch)
            if not self.rows:
                return
            for row in self._step():
                yield row.key, row.result()
