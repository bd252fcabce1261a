"""The gateway's routing and request rules stay pure: importing them loads no network, web or model
library, and the gateway as a whole never loads torch (it holds no model)."""

from __future__ import annotations

import subprocess
import sys

PURE = (
    "gateway.routing",
    "gateway.affinity",
    "gateway.openai_request",
    "gateway.chat_messages",
    "gateway.api_errors",
    "hybridserve.auth",
    "gateway.structured",
    "gateway.tool_calls",
    "gateway.tool_constraint",
    "gateway.tool_parsers",
    "gateway.chat_output",
    "gateway.reasoning",
    "gateway.responses_request",
)
EDGE = ("grpc", "aiohttp", "torch", "opentelemetry", "google", "jinja2")


def loaded_roots(*modules: str) -> set[str]:
    code = f"import sys; import {', '.join(modules)}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_pure_modules_import_no_edge_library():
    assert loaded_roots(*PURE) & set(EDGE) == set()


def test_the_gateway_command_never_loads_torch():
    assert "torch" not in loaded_roots("gateway.server")
