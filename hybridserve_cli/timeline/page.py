"""The timeline as one self-contained HTML page: page.html with page.js and the view model (JSON)
inlined. Nothing in it refers to the network, except the trace links when a Jaeger URL is given."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Any

from hybridserve_cli.timeline.view import Timeline


def view_json(timeline: Timeline, source: str, jaeger_url: str = "") -> dict[str, Any]:
    """What the page's script reads: the view model plus where it came from."""
    return {"source": source, "jaeger_url": jaeger_url.rstrip("/"), **dataclasses.asdict(timeline)}


def _inline_json(value: Any) -> str:
    """JSON safe inside a <script> element: no "</" can close it early."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def render_page(timeline: Timeline, source: str, jaeger_url: str = "") -> str:
    files = resources.files(__package__ or "hybridserve_cli.timeline")
    template = files.joinpath("page.html").read_text(encoding="utf-8")
    script = files.joinpath("page.js").read_text(encoding="utf-8")
    data = _inline_json(view_json(timeline, source, jaeger_url))
    # data last, so a request id that spells a placeholder cannot be replaced
    return template.replace("__TIMELINE_SCRIPT__", script).replace("__TIMELINE_DATA__", data)
