"""Bench reports: a terminal table, a markdown report, a JSON file, PNG plots, and RESULTS.md sections."""

from __future__ import annotations

import json
import re
from pathlib import Path

from byblock.bench.methods import engine_plain

REPORT_VERSION = 1


def lossless_cell(row: dict, greedy: bool, is_reference: bool) -> str:
    """'yes' / 'NO (k of n turns differ)' / '—' (reference or sampling)."""
    if is_reference or not greedy:
        return "—"
    bad = row["mismatched_turns"]
    return "yes" if bad == 0 else f"NO ({bad} of {row['turns']} turns differ)"


def _fmt(v, spec: str = ".2f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def table_rows(report: dict) -> list[list[str]]:
    """Rows for the terminal and markdown tables."""
    rows = []
    greedy = report["params"]["temperature"] == 0
    for ds, block in report["datasets"].items():
        for name, row in block["methods"].items():
            rows.append(
                [
                    ds,
                    name,
                    str(row["tokens"]),
                    _fmt(row["tok_s"]),
                    _fmt(row["speedup"], ".3f") + ("×" if row["speedup"] is not None else ""),
                    _fmt(row["tau"]),
                    _fmt(row["ttft_s_p50"], ".3f"),
                    _fmt(row["draft_fraction"], ".0%"),
                    _fmt(row.get("round_cost_ratio"), ".2f"),
                    lossless_cell(row, greedy, name == report["reference"]),
                ]
            )
    return rows


HEADERS = [
    "dataset",
    "method",
    "tokens",
    "tok/s",
    "speedup",
    "τ",
    "TTFT p50 s",
    "draft share",
    "round cost",
    "lossless",
]


def terminal_table(report: dict) -> str:
    """A fixed-width table."""
    rows = [HEADERS, *table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _peer_lines(report: dict) -> list[str]:
    """Batch size and other engines, when the run had them."""
    lines = []
    if report.get("batch", 1) > 1:
        lines.append(
            f"Batch {report['batch']}: byblock's methods decode each batch of prompts together on the batched engine, "
            "other engines get it as one call (their own batching); tok/s = a batch's tokens ÷ its wall time."
        )
    for name, engine in report.get("peers", {}).items():
        plain = engine_plain(name)
        if plain != name and plain in report["methods"] and report["params"]["temperature"] == 0:
            diffs = [
                f"{row['mismatched_vs_engine']} turns of {ds} differ from plain `{plain}`"
                for ds, block in report["datasets"].items()
                if (row := block["methods"].get(name, {})).get("mismatched_vs_engine")
            ]
            note = "; ".join(diffs) or f"token-identical to plain `{plain}` on every turn"
            lines.append(f"`{name}`: {engine}, fed byblock's prompt token ids ({note}).")
        else:
            lines.append(f"`{name}`: {engine}, fed byblock's prompt token ids.")
    return ["", "  ".join(lines)] if lines else []


def markdown(report: dict, per_position: bool = True) -> str:
    """The markdown report: context, the main table, per-position acceptance (unless `per_position` is off)."""
    p = report["params"]
    out = [
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}  ",
        f"Date: {report['date']}; model `{report['model']}` ({report['dtype']}); temperature {p['temperature']}, "
        f"max {p['max_new_tokens']} new tokens, seed {p['seed']}; speedup vs `{report['baseline']}`; "
        f"lossless = token-identical to `{report['reference']}` (greedy only); round cost = (draft + verify time "
        f"per round) ÷ the baseline's time per token, i.e. the τ at which a method breaks even.",
        *_peer_lines(report),
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in table_rows(report)]
    pos_lines = []
    for ds, block in report["datasets"].items():
        for name, row in block["methods"].items():
            if row["per_position_acceptance"]:
                acc = " ".join(f"{a:.2f}" for a in row["per_position_acceptance"])
                pos_lines.append(f"| {ds} | {name} | {acc} |")
    if pos_lines and per_position:
        out += ["", "Per-position acceptance (P(depth d accepted | drafted to d), d = 1, 2, …):", ""]
        out += ["| dataset | method | d = 1 … |", "|---|---|---|", *pos_lines]
    return "\n".join(out) + "\n"


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """speedup.png (per dataset and method), tau_hist.png (acceptance histograms), speedup_vs_size.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    datasets = list(report["datasets"])
    methods = list(next(iter(report["datasets"].values()))["methods"]) if datasets else []
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * max(1, len(datasets))), 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [report["datasets"][d]["methods"][m]["speedup"] or 0 for d in datasets]
        ax.bar([i + j * width for i in range(len(datasets))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel(f"speedup vs {report['baseline']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=110)
    plt.close(fig)
    files.append("speedup.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for d in datasets:
        for m, row in report["datasets"][d]["methods"].items():
            hist = row["acceptance_histogram"]
            if hist and sum(hist):
                ax.plot(range(len(hist)), [h / sum(hist) for h in hist], marker="o", label=f"{d}/{m}")
    ax.set_xlabel("draft tokens accepted per round")
    ax.set_ylabel("share of rounds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "tau_hist.png", dpi=110)
    plt.close(fig)
    files.append("tau_hist.png")

    sweeps: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for d in datasets:
        for m, row in report["datasets"][d]["methods"].items():
            size = report["method_sizes"].get(m)
            if size is not None and row["speedup"] is not None:
                sweeps.setdefault((d, m.split("@")[0]), []).append((size, row["speedup"]))
    sweeps = {k: sorted(v) for k, v in sweeps.items() if len(v) > 1}
    if sweeps:
        fig, ax = plt.subplots(figsize=(7, 4))
        for (d, base), pts in sweeps.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{d}/{base}")
        ax.set_xlabel("block size / node budget (@K)")
        ax.set_ylabel(f"speedup vs {report['baseline']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "speedup_vs_size.png", dpi=110)
        plt.close(fig)
        files.append("speedup_vs_size.png")
    return files


def write_all(report: dict, out_dir: Path, plots: bool = True) -> dict[str, str]:
    """Plots, then report.md and report.json (which lists every file) into out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out_dir / "report.json"), "markdown": str(out_dir / "report.md")}
    if plots:
        for name in write_plots(report, out_dir):
            files[name.removesuffix(".png")] = str(out_dir / name)
    report["files"] = files
    (out_dir / "report.md").write_text(markdown(report))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return files


def replace_section(results_md: Path, section: str, body_markdown: str) -> None:
    """Replace (or append) the block between `<!-- bench:SECTION -->` markers with `body_markdown`."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = f"{begin}\n{body_markdown}{end}"
    text = results_md.read_text() if results_md.is_file() else "# byblock benchmark results\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    results_md.write_text(text)


def write_table_report(out: str | None, report: dict, table: str, results_md: str | None, section: str | None) -> Path:
    """For table-shaped reports (diffusion frontier, passkey): write report.json + report.md to `out`
    (default bench-out/<timestamp>), optionally a RESULTS.md section, print the table and a last JSON line."""
    import datetime
    import json

    out_dir = Path(out or f"bench-out/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(table)
    if results_md:
        replace_section(
            Path(results_md), section or "", f"Measured {report['date']}, `{report['command']}`.\n\n{table}"
        )
    print(table, end="")
    print(json.dumps({"report": str(out_dir / "report.json")}))
    return out_dir


def update_results(results_md: Path, section: str, report: dict, per_position: bool = True) -> None:
    """Write a bench report's markdown into its section of RESULTS.md (or any markdown file with the markers)."""
    replace_section(results_md, section, markdown(report, per_position))
