"""`byblock export`: write a drafter in the layout a serving engine loads as is.

byblock export --drafter dflash --format vllm --out exports/smollm2-dflash-vllm
byblock export --drafter dflash:runs/x/export --target runs/target --format vllm --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from byblock.errors import ByblockError
from byblock.models.registry import DEFAULT_MODEL

FORMATS = ("vllm",)  # SGLang and llama.cpp layouts: not built yet (issue 32)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock export`."""
    parser.add_argument("--drafter", default="dflash", help="dflash[:PATH] (default: the drafter shipped for --target)")
    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model the drafter serves")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the engine whose layout to write")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")


def run(args: argparse.Namespace) -> int:
    """Resolve the drafter and the target's head, write the engine's layout, print one JSON line."""
    from byblock.drafters import DrafterKind, DrafterSpec, shipped_dflash_dir
    from byblock.drafters.dflash_format import WEIGHTS

    spec = DrafterSpec.parse(args.drafter)
    if spec.kind is not DrafterKind.DFLASH:
        raise ByblockError(f"export takes a DFlash drafter (dflash[:PATH]), not '{args.drafter}'")
    src = Path(spec.model).expanduser() if spec.model else shipped_dflash_dir(args.target)
    if not (src / "config.json").is_file() or not (src / WEIGHTS).is_file():
        raise ByblockError(f"{src} is not a DFlash checkpoint (needs config.json and {WEIGHTS})")
    from byblock.handoff.vllm import export_vllm
    from byblock.models.loading import load_model, resolve_checkpoint

    target = load_model(args.target, device="cpu", relayout=False, row_invariant=False)
    head = target.hf.get_output_embeddings().weight.detach()
    out = export_vllm(src, Path(args.out), head)
    config = json.loads((out / "config.json").read_text())
    k = int(config.get("block_size", 16)) - 1
    speculative = {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": k}
    sys.stderr.write(f"byblock export: wrote {out} ({args.format}); serve it with\n")
    checkpoint = resolve_checkpoint(args.target)  # the HF directory vLLM opens (a built-in's de-quantized cache)
    sys.stderr.write(f"  vllm serve {checkpoint} --speculative-config '{json.dumps(speculative)}'\n")
    print(json.dumps({"out": str(out), "format": args.format, "target": checkpoint, "speculative_config": speculative}))
    return 0
