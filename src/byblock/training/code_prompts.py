"""Raw code-completion prompts derived from the target's own chat answers to coding instructions.

Why: a drafter trained only on chat answers sees a different world on raw completions (HumanEval sends a
function signature and docstring with no chat template): on HumanEval its first drafted token was accepted
24 % of the time against 49 % on chat prompts (benchmarks/RESULTS.md §3). The cure is training data in that
shape, and the training prompts already hold it: for every coding instruction the target answered during
regeneration we build a raw prompt from the instruction and the target's own code, then let the target
continue it (a second regeneration pass, `chat: false`). Nothing comes from the evaluation sets.

Two shapes, both from one answer's first fenced code block:
  * docstring — a top-level Python `def` line found in the answer, with the instruction as its docstring
    (after the imports the answer used): the HumanEval shape;
  * prefix — otherwise the block's first two lines (any language), continued as raw code.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ByblockError

FENCE = re.compile(r"```([\w+#-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
TOP_DEF = re.compile(r"^def \w+\(.*\).*:[ \t]*$", re.M)
IMPORT = re.compile(r"^(?:import \w[\w.]*(?: as \w+)?|from [\w.]+ import [\w ,*]+)[ \t]*$", re.M)
PYTHON_TAGS = frozenset({"", "python", "py", "python3"})


@dataclass(frozen=True)
class CodePrompt:
    """One raw prompt: `id` names where it came from (a training prompt, or a source file and function)."""

    id: str
    prompt: str
    shape: str  # "docstring" or "prefix"
    source: str = "code-derived"  # "python-source": cut from source files (source_prompts.py)

    def row(self) -> dict:
        """The JSONL row (`chat: false`: sent without the chat template, as HumanEval is)."""
        return {"id": self.id, "source": self.source, "shape": self.shape, "prompt": self.prompt, "chat": False}


def docstring_prompt(instruction: str, code: str) -> str | None:
    """`imports + def line + docstring(instruction)` from the first top-level def in `code`, else None."""
    m = TOP_DEF.search(code)
    if m is None:
        return None
    imports = IMPORT.findall(code[: m.start()])
    text = " ".join(instruction.split())
    body = textwrap.fill(text, width=96, initial_indent="    ", subsequent_indent="    ")
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return f'{head}{m.group(0).rstrip()}\n    """ {body.lstrip()}\n    """\n'


def prefix_prompt(code: str, lines: int = 2) -> str | None:
    """The first `lines` non-empty lines of `code` (None if the block is too short to continue)."""
    rows = [r for r in code.splitlines() if r.strip()]
    if len(rows) <= lines:
        return None
    return "\n".join(rows[:lines]) + "\n"


def derive(instruction: str, answer: str, prompt_id: str) -> CodePrompt | None:
    """The raw prompt for one (instruction, target answer) pair, or None when the answer has no code."""
    m = FENCE.search(answer)
    if m is None:
        return None
    tag, code = m.group(1).lower(), m.group(2)
    if tag in PYTHON_TAGS:
        text = docstring_prompt(instruction, code)
        if text is not None:
            return CodePrompt(f"{prompt_id}-doc", text, "docstring")
    text = prefix_prompt(code)
    return None if text is None else CodePrompt(f"{prompt_id}-pre", text, "prefix")


def derive_from_regen(
    regen_dir: str | Path, prompts_path: str | Path, tokenizer, source: str = "codealpaca"
) -> list[CodePrompt]:
    """Derived prompts for every regenerated answer to a `source` instruction, in shard order, deduplicated."""
    from safetensors.torch import load_file

    rows = _rows(prompts_path)
    shards = sorted(Path(regen_dir).glob("shard_*.safetensors"))
    if not shards:
        raise ByblockError(f"{regen_dir} holds no regenerated shards (run the regenerate stage first)")
    out: list[CodePrompt] = []
    seen: set[str] = set()
    for path in shards:
        d = load_file(str(path))
        off, plens, index = d["offsets"].tolist(), d["prompt_lens"].tolist(), d["prompt_index"].tolist()
        for i, (plen, k) in enumerate(zip(plens, index, strict=True)):
            row = rows[k]
            if row.get("source") != source:
                continue
            answer = tokenizer.decode(d["tokens"][off[i] + plen : off[i + 1]].tolist(), skip_special_tokens=True)
            cp = derive(row["prompt"], answer, str(row.get("id", k)))
            if cp is not None and cp.prompt not in seen:
                seen.add(cp.prompt)
                out.append(cp)
    return out


def _rows(path: str | Path) -> list[dict]:
    """The JSON objects of a prompts file, blank lines skipped (the indexing regeneration used)."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ByblockError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    return rows


def write_jsonl(prompts: list[CodePrompt], path: str | Path) -> Path:
    """Write the prompts as JSONL (atomically: a killed run leaves the old file or none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for p in prompts:
            f.write(json.dumps(p.row()) + "\n")
    os.replace(tmp, path)
    return path
