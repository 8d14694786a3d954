"""Driving an EngineCore step by step in tests (the batched autoregressive and diffusion engines)."""

from __future__ import annotations


def drive(core, arrivals: dict, aborts: dict, max_steps: int = 3000):
    """Add `arrivals[step]` and abort `aborts[step]` before each step; returns ({id: result}, {id: streamed
    text}, the most requests one forward held)."""
    results, texts, widest, step = {}, {}, 0, 0
    while core.has_unfinished() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            core.add_request(req)
        for rid in aborts.get(step, []):
            core.abort_request(rid)
        for out in core.step():
            assert out.error is None, out.error
            if out.event is not None:
                texts[out.request_id] = texts.get(out.request_id, "") + out.event.text
            if out.result is not None:
                results[out.request_id] = out.result
        last = getattr(core, "last_step", None)  # FIFO cores: one request at a time
        widest = max(widest, last.seqs if last is not None else core.num_running())
        step += 1
        assert step < max_steps, "the engine does not finish"
    return results, texts, widest
