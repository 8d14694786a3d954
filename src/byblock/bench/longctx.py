"""Long-context settings side by side: retrieval accuracy next to time to first token, decode speed and KV memory.

`byblock bench --dataset passkey --settings dense,stem:0.75,int8,h2o:128+128 ...` loads the model once per
setting (each one swaps the attention implementation or the cache), runs every passkey prompt (bench/passkey.py)
through every method, and reports one row per (setting, method, length).

Setting grammar (one algorithm each, so the rows stay comparable):
    dense | stem:SPARSITY[/SHARE_LAYERS] | decode:BLOCKS[+WINDOW] | int8 | int4 | window:SINKS+WINDOW |
    snapkv:BUDGET | h2o:HEAVY+RECENT
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from byblock.errors import ByblockError


class LongKind(Enum):
    """The long-prompt technique a setting applies."""

    DENSE = "dense"
    STEM = "stem"
    INT8 = "int8"
    INT4 = "int4"
    WINDOW = "window"
    SNAPKV = "snapkv"
    H2O = "h2o"
    DECODE = "decode"  # sparse decode/verify (attention/sparse_decode.py): decode:BLOCKS[+WINDOW]


@dataclass(frozen=True)
class LongSetting:
    """One parsed --settings entry: the technique and its one or two sizes."""

    name: str
    kind: LongKind
    a: float = 0.0
    b: int = 0

    @staticmethod
    def parse(text: str) -> LongSetting:
        """'stem:0.75' -> LongSetting(kind=STEM, a=0.75); raises ByblockError with the grammar on bad input."""
        head, _, arg = text.partition(":")
        try:
            kind = LongKind(head)
            if kind in (LongKind.DENSE, LongKind.INT8, LongKind.INT4):
                if arg:
                    raise ValueError
                return LongSetting(text, kind)
            if kind is LongKind.STEM:  # stem:S or stem:S/N (the index shared across N layers)
                level, slash, share = arg.partition("/")
                sparsity, layers = float(level), int(share) if slash else 1
                if not 0.0 <= sparsity < 1.0 or layers < 1:
                    raise ValueError
                return LongSetting(text, kind, sparsity, layers)
            if kind is LongKind.DECODE:
                blocks, plus, window = arg.partition("+")
                setting = LongSetting(text, kind, int(blocks), int(window) if plus else 256)
                if setting.a < 1 or setting.b < 1:
                    raise ValueError
                return setting
            if kind is LongKind.SNAPKV:
                if int(arg) < 1:
                    raise ValueError
                return LongSetting(text, kind, int(arg))
            first, plus, second = arg.partition("+")
            if not plus or int(first) < 0 or int(second) < 1:
                raise ValueError
            return LongSetting(text, kind, int(first), int(second))
        except ValueError:
            raise ByblockError(
                f"bad setting '{text}': expected dense | stem:SPARSITY[/SHARE_LAYERS] | int8 | int4 | "
                "window:SINKS+WINDOW | snapkv:BUDGET | h2o:HEAVY+RECENT | decode:BLOCKS[+WINDOW]"
            ) from None


def apply_setting(model, setting: LongSetting, stem_base, snap_window: int) -> None:
    """Switch a freshly loaded TargetModel to `setting` (stem_base: a StemConfig whose sparsity is replaced)."""
    from dataclasses import replace

    from byblock.kv.kv_cache import StreamingWindow

    kind = setting.kind
    try:
        if kind is LongKind.STEM:
            from byblock.attention.hf_stem import enable_stem

            cfg = replace(stem_base, sparsity=setting.a, share_layers=max(1, setting.b), prefill=True, decode_blocks=0)
            enable_stem(model.hf, cfg)
        elif kind is LongKind.DECODE:  # prompts prefill densely; decode rows read the sinks, window and K blocks
            from byblock.attention.hf_stem import enable_stem

            enable_stem(
                model.hf, replace(stem_base, prefill=False, decode_blocks=int(setting.a), decode_window=setting.b)
            )
        elif kind in (LongKind.INT8, LongKind.INT4):
            model.kv_bits = 8 if kind is LongKind.INT8 else 4
        elif kind is LongKind.WINDOW:
            model.kv_window = StreamingWindow(int(setting.a), setting.b)
        elif kind is LongKind.SNAPKV:
            from byblock.kv.snapkv import SnapKVConfig, enable_snapkv_on

            enable_snapkv_on(model, SnapKVConfig(budget=int(setting.a), window=snap_window))
        elif kind is LongKind.H2O:
            from byblock.kv.h2o import H2OConfig, enable_h2o

            model.h2o = enable_h2o(model.hf, H2OConfig(heavy=int(setting.a), recent=setting.b))
    except ValueError as e:
        raise ByblockError(f"setting '{setting.name}': {e}") from None


def kv_bytes_after_prefill(model, ids: list[int]) -> int:
    """Bytes of the cache once `ids` are prefilled and any compression has run."""
    cache = model.new_cache()
    model.forward(torch.tensor([ids]), cache, logits_to_keep=1)
    cache.evict()
    return cache.nbytes()


@dataclass(frozen=True)
class PasskeyGrid:
    """What the passkey probe asks: prompt lengths (tokens), depths of the asked key, keys per prompt."""

    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    keys: tuple[int, ...] = (1, 3)
    seeds: int = 1  # independent prompts per (length, depth, keys) cell


def run_passkey(
    load: Callable[[], object],
    settings: list[LongSetting],
    configure: Callable[[object, LongSetting], None],
    runners_for: Callable[[object], dict],
    grid: PasskeyGrid,
    params,
    progress: Callable[[dict], None] = lambda row: None,
) -> list[dict]:
    """One row per (setting, method, length): accuracy, mean TTFT, decode tok/s, KV MB after prefill.

    load() gives a fresh TargetModel; configure(model, setting) applies the setting; runners_for(model) gives
    {method name: MethodRunner}. Prompts are identical across settings (deterministic per seed)."""
    from byblock.bench.passkey import correct, make_prompt

    rows = []
    for setting in settings:
        model = load()
        configure(model, setting)
        runners = runners_for(model)
        for length in grid.lengths:
            prompts = [
                make_prompt(model.tokenizer, length, d, k, seed)
                for seed in range(grid.seeds)
                for d in grid.depths
                for k in grid.keys
            ]
            encoded = [model.encode_prompt(p.text, chat=False) for p in prompts]
            if max(len(ids) for ids in encoded) + params.max_new_tokens > model.max_context:
                raise ByblockError(f"passkey length {length} does not fit {model.name}'s {model.max_context} context")
            for runner in runners.values():  # warm-up at this shape, excluded (Stem compiles per shape)
                runner.run(encoded[0], params)
            kv_mb = kv_bytes_after_prefill(model, encoded[0]) / 2**20  # the same for every method
            for name, runner in runners.items():
                ok, ttft, decode_s, decode_tokens, t0 = 0, [], 0.0, 0, time.perf_counter()
                for p, ids in zip(prompts, encoded, strict=True):
                    res = runner.run(ids, params)
                    ok += correct(p, model.tokenizer.decode(res.token_ids))
                    ttft.append(res.ttft_s)
                    decode_s += res.total_s - res.ttft_s
                    decode_tokens += max(0, len(res.token_ids) - 1)
                row = {
                    "setting": setting.name,
                    "method": name,
                    "length": length,
                    "prompt_tokens": round(sum(len(i) for i in encoded) / len(encoded)),
                    "n": len(prompts),
                    "correct": ok,
                    "accuracy": ok / len(prompts),
                    "ttft_s": sum(ttft) / len(ttft),
                    "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
                    "kv_mb": kv_mb,
                    "wall_s": time.perf_counter() - t0,
                }
                rows.append(row)
                progress(row)
    return rows


def wilson(ok: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion (how much a few dozen prompts can tell)."""
    if n == 0:
        return 0.0, 1.0
    p = ok / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def markdown(rows: list[dict]) -> str:
    """The RESULTS.md table: Δ accuracy, TTFT and KV against the dense row of the same method and length."""
    dense = {(r["method"], r["length"]): r for r in rows if r["setting"] == "dense"}
    lines = [
        "| setting | method | prompt tokens | accuracy (95% CI) | Δ vs dense (points) | mean TTFT s | TTFT vs dense "
        "| decode tok/s | KV MB after prefill | KV vs dense |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = dense.get((r["method"], r["length"]))
        lo, hi = wilson(r["correct"], r["n"])
        delta = f"{(r['accuracy'] - d['accuracy']) * 100:+.1f}" if d else "—"
        speed = f"{d['ttft_s'] / r['ttft_s']:.2f}×" if d else "—"
        mem = f"{r['kv_mb'] / d['kv_mb']:.2f}" if d and d["kv_mb"] else "—"
        lines.append(
            f"| {r['setting']} | {r['method']} | {r['prompt_tokens']} | {r['accuracy']:.1%} of {r['n']} "
            f"({lo:.0%}–{hi:.0%}) | {delta} | {r['ttft_s']:.2f} | {speed} | {r['decode_tok_s']:.1f} | "
            f"{r['kv_mb']:.1f} | {mem} |"
        )
    return "\n".join(lines) + "\n"
