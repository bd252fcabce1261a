"""`hybridserve timeline STEPS.jsonl -o steps.html [--perfetto steps.json] [--jaeger-url URL]`:
recorded steps (`hybridserve worker --record-steps STEPS.jsonl`) as a page to debug scheduling by
eye, and as Chrome trace-event JSON for Perfetto. Exit status 2 on a bad file or flag."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.timeline.page import render_page
from hybridserve_cli.timeline.perfetto import trace_events
from hybridserve_cli.timeline.records import load_records
from hybridserve_cli.timeline.view import build_timeline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="JSONL written by `hybridserve worker --record-steps FILE`")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the HTML page to write")
    parser.add_argument("--perfetto", type=Path, default=None, help="also write Chrome trace-event JSON here")
    parser.add_argument(
        "--jaeger-url",
        default="",
        help="link each trace id to URL/trace/ID (e.g. http://localhost:16686); without it the page has no links",
    )


def check_jaeger_url(url: str) -> str:
    if url and not url.startswith(("http://", "https://")):
        raise InvalidArgumentError(
            f"--jaeger-url {url!r}: expected http://HOST:PORT or https://..., e.g. http://localhost:16686"
        )
    return url


def run(args: argparse.Namespace) -> int:
    try:
        jaeger_url = check_jaeger_url(args.jaeger_url)
        timeline = build_timeline(load_records(args.file))
    except (InvalidArgumentError, OSError, ValueError) as exc:
        print(f"timeline: {exc}", file=sys.stderr)
        return 2
    if not timeline.steps:
        print(f"timeline: {args.file} holds no recorded steps", file=sys.stderr)
        return 2
    args.output.write_text(render_page(timeline, args.file.name, jaeger_url), encoding="utf-8")
    print(f"wrote {args.output}: {len(timeline.steps)} steps, {len(timeline.lanes)} requests")
    if args.perfetto is not None:
        args.perfetto.write_text(json.dumps(trace_events(timeline)), encoding="utf-8")
        print(f"wrote {args.perfetto}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0
