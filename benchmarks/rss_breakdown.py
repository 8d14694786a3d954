"""Where a byblock process's resident memory goes, stage by stage and mapping by mapping (Linux /proc).

    python benchmarks/rss_breakdown.py [--model smollm2-135m] [--drafter adaptive-hybrid] [--tokens 96]

Prints RSS (anonymous / file-backed) and the peak after each stage — imports, load_model, one answer, the
drafter, an answer with it — then the largest mappings. This is how the memory items of RESULTS §12 and
dev/LOG.md (session 37) were found: a fused copy beside the mapped pages it read, a float embedding table paged
in row by row, checkpoint pages a conversion left resident, freed blocks kept by malloc.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def report(stage: str) -> None:
    """One line: the stage's RSS split and the peak so far."""
    s = status()
    print(f"{stage:28s} RSS {s['VmRSS']:5d}  anon {s['RssAnon']:5d}  file {s['RssFile']:5d}  peak {s['VmHWM']:5d} MiB")


def mappings(top: int) -> None:
    """The `top` largest resident mappings (a file's path, [heap] or [anon])."""
    rss: collections.Counter = collections.Counter()
    current = "[anon]"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
            current = fields[5] if len(fields) >= 6 else "[anon]"
        elif fields and fields[0] == "Rss:":
            rss[current] += int(fields[1])
    for name, kib in rss.most_common(top):
        print(f"  {kib / 1024:7.1f} MiB  {name}")


def main() -> None:
    """Run the stages."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="adaptive-hybrid")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    report("start")
    import torch  # noqa: F401

    report("import torch")
    import transformers  # noqa: F401

    report("import transformers")
    from byblock import SamplingParams, generate, load_model
    from byblock.drafters import DrafterSpec, build_drafter

    model = load_model(args.model)
    report("load_model")
    params = SamplingParams(max_new_tokens=args.tokens)
    generate(model, "Write a short poem about the sea.", params)
    report(f"answer ({args.tokens} tokens)")
    mappings(args.top)
    if args.drafter != "none":
        drafter = build_drafter(DrafterSpec.parse(args.drafter), model)
        report(f"build {args.drafter}")
        generate(model, "Write a short poem about the sea.", params, drafter=drafter)
        report("answer with it")
        mappings(args.top)


if __name__ == "__main__":
    main()
