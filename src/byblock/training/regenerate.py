"""Stage 1 of drafter training: the target answers the training prompts, and we keep what it saw.

One batched pass per shard produces everything training needs, so training never runs the target again:
  tokens      prompt + response ids (the response ends with EOS unless it hit max_new_tokens)
  hidden      the target's hidden states at `layer_ids` for every token but the last (bf16)
  topk        the target's top-k next-token log-probs for every response token (distillation targets)

Resumable: the plan (which prompts go in which shard) is fixed by the config and written first; a shard is
written to a temporary file and renamed, so a killed run loses at most the shard in flight.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from byblock.errors import ByblockError
from byblock.training.regen_decode import ContinuousDecoder, DecodeSettings

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class RegenConfig:
    """What to regenerate and how. Everything that changes the data is part of the manifest."""

    target: str
    prompts: str
    layer_ids: tuple[int, ...]
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    batch_size: int = 64  # sequences per shard
    topk: int = 8
    temperature: float = 0.0  # 0 = greedy responses (what greedy speculative decoding will verify)
    seed: int = 0
    limit: int | None = None  # use only the first `limit` prompts of the shuffled order
    # The target's weights while regenerating. bf16 matches how byblock serves it by default and its GEMMs are
    # ~2.7x faster on AVX512-BF16 CPUs; features and top-k are stored in bf16 / fp32 either way.
    dtype: str = "float32"
    # Rows decoded together (continuous batching, training/regen_decode.py): the answers do not depend on it, so
    # a resumed run may change it.
    rows: int = 128

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "topk", "rows"):
            if getattr(self, name) < 1:
                raise ByblockError(f"regenerate: {name} must be at least 1, got {getattr(self, name)}")

    def manifest_key(self) -> dict:
        """The fields a resumed run must agree on (limit may grow: shards are a prefix of one order)."""
        d = asdict(self)
        d.pop("limit")
        d.pop("rows")
        d["prompts"] = Path(self.prompts).name  # the same file may sit elsewhere in another checkout
        d["layer_ids"] = list(self.layer_ids)
        return d


def build_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """DFlash's default feature layers: evenly spaced over [1, L-3] (one feature: the middle layer)."""
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(1, num_target_layers - 3)
    return tuple(round(start + i * (end - start) / (num_features - 1)) for i in range(num_features))


def plan_shards(lengths: list[int], batch_size: int, seed: int, window: int = 8) -> list[list[int]]:
    """Prompt indices per shard: a seeded shuffle (any prefix of shards is a fair sample of the sources),
    then length-sorting inside windows of `window` shards so a batch's left padding stays small."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    shards: list[list[int]] = []
    span = batch_size * window
    for w in range(0, len(order), span):
        chunk = sorted(order[w : w + span], key=lambda i: lengths[i])
        shards.extend(chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size))
    return shards


def shard_path(out_dir: Path, index: int) -> Path:
    """Where shard `index` lives."""
    return out_dir / f"shard_{index:05d}.safetensors"


def pack_shard(seqs: list[dict[str, torch.Tensor]], prompt_lens: list[int], prompt_index: list[int]) -> dict:
    """Concatenate sequences into flat tensors plus offsets (one safetensors file per shard)."""
    lens = torch.tensor([len(s["tokens"]) for s in seqs])
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    return {
        "tokens": torch.cat([s["tokens"] for s in seqs]),
        "offsets": offsets,
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.long),
        "prompt_index": torch.tensor(prompt_index, dtype=torch.long),
        "hidden": torch.cat([s["hidden"] for s in seqs]).contiguous(),
        "topk_ids": torch.cat([s["topk_ids"] for s in seqs]).contiguous(),
        "topk_logp": torch.cat([s["topk_logp"] for s in seqs]).contiguous(),
    }


def _check_manifest(out_dir: Path, cfg: RegenConfig, extra: dict) -> None:
    path = out_dir / MANIFEST
    want = {**cfg.manifest_key(), **extra}
    if path.is_file():
        have = {"dtype": "float32", **json.loads(path.read_text())}  # manifests before `dtype` were fp32
        if have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            raise ByblockError(f"{out_dir} holds data regenerated with different settings ({', '.join(diff)})")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(want, indent=2))
    os.replace(tmp, path)


def _add_stats(out_dir: Path, sequences: int, tokens: int, seconds: float) -> None:
    """Accumulate the data volume and wall time behind the shards (stats.json, replaced atomically)."""
    path = out_dir / "stats.json"
    stats = json.loads(path.read_text()) if path.is_file() else {"sequences": 0, "response_tokens": 0, "seconds": 0.0}
    stats["sequences"] += sequences
    stats["response_tokens"] += tokens
    stats["seconds"] = round(stats["seconds"] + seconds, 2)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, path)


def regenerate(cfg: RegenConfig, out_dir: str | Path, progress: bool = True, device: str = "auto") -> dict:
    """Run (or resume) regeneration into `out_dir` on `device`; return a summary (shards, sequences, tokens).

    The device is not part of the manifest: a run may resume on another one (greedy answers may then differ at
    near-ties, as any two kernels' may; sampled answers draw from the device's own generator)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from byblock.bench.datasets import load_jsonl
    from byblock.models.loading import load_model

    out_dir = Path(out_dir)
    # Batched regeneration is not a verify path: plain kernels (row invariance would only slow it down).
    target = load_model(cfg.target, device=device, dtype=cfg.dtype, relayout=False, row_invariant=False)
    bad = [i for i in cfg.layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ByblockError(f"layer ids {bad} out of range for a {target.num_layers}-layer target")
    prompts = load_jsonl(cfg.prompts)
    encoded = [target.encode_prompt(p.text, chat=p.chat) for p in prompts]
    usable = [i for i, e in enumerate(encoded) if len(e) <= cfg.max_prompt_tokens]
    extra = {"num_prompts": len(prompts), "hidden_size": target.hidden_size, "num_layers": target.num_layers}
    _check_manifest(out_dir, cfg, extra)
    shards = plan_shards([len(encoded[i]) for i in usable], cfg.batch_size, cfg.seed)
    shards = [[usable[j] for j in s] for s in shards]
    if cfg.limit is not None:
        shards = shards[: max(1, -(-cfg.limit // cfg.batch_size))]
    todo = [k for k in range(len(shards)) if not shard_path(out_dir, k).is_file()]
    log.info(
        "regenerate: %d prompts (%d over %d tokens skipped), %d shards, %d to do",
        len(prompts),
        len(prompts) - len(usable),
        cfg.max_prompt_tokens,
        len(shards),
        len(todo),
    )
    pad_id = target.tokenizer.pad_token_id
    pad_id = int(pad_id if pad_id is not None else min(target.eos_token_ids))
    settings = DecodeSettings(
        layer_ids=cfg.layer_ids,
        eos_ids=target.eos_token_ids,
        pad_id=pad_id,
        max_new_tokens=cfg.max_new_tokens,
        topk=cfg.topk,
        temperature=cfg.temperature,
        rows=cfg.rows,
        refill=max(1, cfg.rows // 8),
    )
    # Prompts stream through one running batch in shard order; a shard is written once all its answers are in.
    # A sampled answer's seed is its prompt's index, so it does not depend on which rows shared its steps.
    jobs = ((i, encoded[i], cfg.seed * 1_000_003 + i) for k in todo for i in shards[k])
    shard_of = {i: k for k in todo for i in shards[k]}
    answers: dict[int, dict[int, dict[str, torch.Tensor]]] = {k: {} for k in todo}
    made_tokens, t_start = 0, time.perf_counter()
    t_last = t_start
    bar = tqdm(total=len(todo), desc="regenerate", unit="shard", disable=not progress, dynamic_ncols=True)
    for i, answer in ContinuousDecoder(target.hf, settings).run(jobs):
        k = shard_of[i]
        answers[k][i] = answer
        if len(answers[k]) < len(shards[k]):
            continue
        done = answers.pop(k)
        seqs = [done[j] for j in shards[k]]
        packed = pack_shard(seqs, [len(encoded[j]) for j in shards[k]], shards[k])
        final = shard_path(out_dir, k)
        tmp = final.with_name(final.name + ".tmp")
        save_file(packed, str(tmp))
        os.replace(tmp, final)
        tokens = sum(len(s["topk_ids"]) for s in seqs)
        made_tokens += tokens
        now = time.perf_counter()
        _add_stats(out_dir, len(seqs), tokens, now - t_last)
        t_last = now
        rate = made_tokens / (now - t_start)
        bar.update(1)
        bar.set_postfix(resp_tok_s=f"{rate:.0f}")
        log.info("shard %d: %d sequences, %d response tokens total, %.1f tok/s", k, len(seqs), made_tokens, rate)
    bar.close()
    done = [k for k in range(len(shards)) if shard_path(out_dir, k).is_file()]
    return {"shards": len(done), "planned": len(shards), "new_response_tokens": made_tokens}
