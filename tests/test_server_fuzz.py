"""Schema-driven fuzz of the server's OpenAPI (schemathesis): whatever a client sends, never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from test_server import MODEL, build_app

_, APP = build_app(max_tokens_limit=16)  # short generations: the fuzz is about inputs, not decoding
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
OPERATIONS = {result.ok().label: result.ok() for result in SCHEMA.get_all_operations()}
# One plain pytest item per operation, not `SCHEMA.parametrize()`: under pytest-xdist schemathesis's subtests ran
# only the first operation (all six serially) while reporting a pass. The set records what was actually called;
# `--dist loadfile` keeps this file's tests in one process, in order, so the last test can read it.
CALLED: set[str] = set()


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_errors(label: str):
    @given(case=OPERATIONS[label].as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # reach tokenization and decoding, not only the unknown-model 404
        case.call_and_validate(checks=[not_a_server_error])
        CALLED.add(label)

    fuzz()


def test_fuzz_reached_decoding():
    """The fuzz above is only worth something if it called every operation and valid bodies reached the engine."""
    text = APP.state.metrics.render().decode()
    ok = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("byblock_requests_total") and 'status="ok"' in line
    )
    assert ok >= 5, text
    assert len(OPERATIONS) >= 5 and set(OPERATIONS) == CALLED, (sorted(OPERATIONS), sorted(CALLED))
