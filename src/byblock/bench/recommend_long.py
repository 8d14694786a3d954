"""`byblock recommend`'s long-prompt sweep: Stem sparse prefill and KV-cache options under the winning decoder.

Seed 000 §3 sends long inputs to sparse prefill and a compressed cache. None of those is lossless, so the sweep
measures each on the user's own prompts with the method the main sweep picked, beside dense attention:
time to first token (what sparse prefill buys), decode tok/s, mean request latency, KV megabytes after the
prefill (what compression buys), and the quality delta — the fraction of dense greedy tokens each setting
reproduces at the same positions. The recommendation is the lowest mean latency among settings within the
quality budget; dense always qualifies, so a long-prompt option is only recommended when it pays here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from byblock.bench.longctx import LongKind, LongSetting, apply_setting, kv_bytes_after_prefill
from byblock.errors import ByblockError

LONG_PROMPT_TOKENS = 4096  # --long auto: the sweep runs when the prompts' mean length reaches this


def long_candidates(prompt_tokens: float) -> list[LongSetting]:
    """The settings swept (dense first): Stem at two sparsities, int8 / int4 KV, SnapKV keeping a quarter."""
    budget = max(16, int(prompt_tokens) // 4)
    names = ("dense", "stem:0.5", "stem:0.75", "int8", "int4", f"snapkv:{budget}")
    return [LongSetting.parse(n) for n in names]


@dataclass(frozen=True)
class LongRow:
    """One measured long-prompt setting."""

    setting: str
    ttft_s: float  # mean time to first token
    latency_s: float  # mean request time
    decode_tok_s: float
    kv_mb: float
    agreement: float  # of dense's tokens, at the same positions
    within_budget: bool


def sweep_long(
    load: Callable[[], object],
    runner_for: Callable[[object], object],
    settings: list[LongSetting],
    prompts: list[list[int]],
    params,
    progress: Callable[[str, dict], None] = lambda name, row: None,
) -> tuple[list[dict], dict[str, str]]:
    """Each setting on a fresh model (load()), the same runner kind (runner_for(model)), every prompt ->
    (raw rows, {setting: why it was skipped}). The first setting is the reference (dense)."""
    from byblock.attention.stem import StemConfig

    stem = StemConfig(min_tokens=0)  # the user asked for the long sweep: Stem engages whatever the length
    reference: list[list[int]] = []
    rows, skipped = [], {}
    for setting in settings:
        model = load()
        try:
            apply_setting(model, setting, stem, snap_window=min(64, max(1, min(len(p) for p in prompts) // 2)))
            runner = runner_for(model)
            runner.run(prompts[0], params)  # warm-up at this shape, excluded (Stem compiles per shape)
            outs = [runner.run(ids, params) for ids in prompts]
        except ByblockError as e:
            if setting.kind is LongKind.DENSE:
                raise
            skipped[setting.name] = str(e)
            continue
        if not reference:
            reference = [r.token_ids for r in outs]
        pairs = zip(outs, reference, strict=True)
        matched = sum(sum(a == b for a, b in zip(r.token_ids, ref, strict=False)) for r, ref in pairs)
        decode_s = sum(r.total_s - r.ttft_s for r in outs)
        row = {
            "setting": setting.name,
            "ttft_s": sum(r.ttft_s for r in outs) / len(outs),
            "latency_s": sum(r.total_s for r in outs) / len(outs),
            "decode_tok_s": sum(max(0, len(r.token_ids) - 1) for r in outs) / decode_s if decode_s > 0 else 0.0,
            "kv_mb": kv_bytes_after_prefill(model, prompts[0]) / 2**20,
            "agreement": matched / max(1, sum(len(r) for r in reference)),
        }
        rows.append(row)
        progress(setting.name, row)
    return rows, skipped


def rank_long(rows: list[dict], max_drop: float) -> list[LongRow]:
    """Raw rows -> lowest mean latency first among settings within `max_drop` of dense's tokens, then the rest."""
    out = [LongRow(**r, within_budget=r["agreement"] >= 1.0 - max_drop - 1e-12) for r in rows]
    return sorted(out, key=lambda r: (not r.within_budget, r.latency_s))


def long_flags(setting: str) -> list[str]:
    """The generate / serve flags of a swept setting."""
    s = LongSetting.parse(setting)
    if s.kind is LongKind.STEM:
        return ["--sparse", "stem", "--sparsity", f"{s.a:g}", "--sparse-min-tokens", "0"]
    if s.kind in (LongKind.INT8, LongKind.INT4):
        return ["--kv-quant", s.kind.value]
    if s.kind is LongKind.SNAPKV:
        return ["--kv-snap", str(int(s.a))]
    return []


def long_table(ranked: list[LongRow]) -> str:
    """The ranked table as Markdown (ratios against dense)."""
    dense = next(r for r in ranked if r.setting == "dense")
    lines = [
        "| rank | setting | TTFT s | TTFT vs dense | latency s | decode tok/s | KV MB | agreement with dense | "
        "within budget |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(ranked, 1):
        lines.append(
            f"| {i} | {r.setting} | {r.ttft_s:.3f} | {dense.ttft_s / r.ttft_s:.2f}× | {r.latency_s:.3f} | "
            f"{r.decode_tok_s:.1f} | {r.kv_mb:.1f} | {r.agreement:.1%} | {'yes' if r.within_budget else 'no'} |"
        )
    return "\n".join(lines)
