"""Schema-driven fuzz of the server's OpenAPI (schemathesis): whatever a client sends, never a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from test_server import MODEL, build_app

_, APP = build_app(max_tokens_limit=16)  # short generations: the fuzz is about inputs, not decoding
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # reach tokenization and decoding, not only the unknown-model 404
    case.call_and_validate(checks=[not_a_server_error])


def test_fuzz_reached_decoding():
    """The fuzz above is only worth something if valid bodies got through to the engine."""
    text = APP.state.metrics.render().decode()
    ok = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("byblock_requests_total") and 'status="ok"' in line
    )
    assert ok >= 5, text
