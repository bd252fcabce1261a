"""A real browser renders the timeline of a recorded run of real processes: headless Chromium
dumps the page's DOM (every recorded step and every request's lane drawn; the selected step's
plan exactly as `hybridserve replay --step N` prints it) and takes a screenshot; the Perfetto JSON
of the same run is valid trace-event format with one event per executed slice."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from collections import Counter, defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest

import hybridserve_cli as cli
from hybridserve_cli.timeline.records import load_records
from hybridserve_cli.timeline.view import build_timeline
from tests.observability.timeline_run import RecordedRun, record_run

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip


def chromium_binary() -> str:
    """Debian's chromium, installed with apt-get when missing; a skip only where that is
    impossible, and never in CI."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        install = "apt-get update && apt-get install -y chromium"
        subprocess.run(install, shell=True, capture_output=True, timeout=1200, check=False)
        found = shutil.which("chromium")
    if found is not None:
        return found
    reason = "chromium is missing and cannot be installed here (needs root and apt-get: apt-get install chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "chromium-profile"
    cmd = [chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> RecordedRun:
    return record_run(tmp_path_factory.mktemp("timeline-run"))


@pytest.fixture(scope="module")
def pages(run) -> tuple[Path, Path]:
    html, perfetto = run.steps_path.with_suffix(".html"), run.steps_path.with_suffix(".perfetto.json")
    assert cli.main(["timeline", str(run.steps_path), "-o", str(html), "--perfetto", str(perfetto)]) == 0
    return html, perfetto


class Dom(HTMLParser):
    """The parts of the dumped DOM the test reads."""

    def __init__(self) -> None:
        super().__init__()
        self.step_ids: list[str] = []  # data-step of each step column, in order
        self.lane_ids: list[str] = []
        self.hidden_lane_ids: list[str] = []
        self.untipped = 0  # drawn slices without a tooltip
        self.slices: Counter[str] = Counter()  # drawn prefill/decode slices per lane
        self.selected = ""
        self.selected_request = ""
        self.plan = ""
        self.summary = ""
        self._lane = ""
        self._into = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "g" and "step" in classes:
            self.step_ids.append(a["data-step"])
        if tag == "div" and "lane" in classes:
            self._lane = a["data-request-id"]
            self.lane_ids.append(self._lane)
            if "display: none" in a.get("style", ""):
                self.hidden_lane_ids.append(self._lane)
        if tag == "rect" and "seg" in classes and ("prefill" in classes or "decode" in classes):
            self.slices[self._lane] += 1
            self.untipped += "data-tip" not in a
        if a.get("id") == "selected-step":
            self.selected = a["data-step"]
        if a.get("id") in ("plan", "summary", "selected-request"):
            self._into = a["id"]

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "span", "h2"):
            self._into = ""

    def handle_data(self, data: str) -> None:
        if self._into == "plan":
            self.plan += data
        elif self._into == "summary":
            self.summary += data
        elif self._into == "selected-request":
            self.selected_request += data


def test_chromium_draws_every_step_and_lane_and_the_replayed_plan(run, pages, tmp_path, capsys):
    html, _ = pages
    records = load_records(run.steps_path)
    timeline = build_timeline(records)
    assert any(s.micro_sliced for s in timeline.steps), "the run was meant to micro-slice"
    notable = [s for s in timeline.steps if s.stalled or s.preempted_request_ids]
    assert notable, "the small KV pool was meant to stall or preempt"
    chosen = notable[0].step_index

    dom = Dom()
    dom.feed(chromium(tmp_path, "--dump-dom", f"{html.as_uri()}#step={chosen}").stdout)

    assert dom.step_ids == [str(r.step_index) for r in records]
    assert sorted(dom.lane_ids) == sorted(run.request_ids) == sorted(lane.request_id for lane in timeline.lanes)
    drawn = {lane.request_id: sum(s.kind in ("prefill", "decode") for s in lane.segments) for lane in timeline.lanes}
    assert dict(dom.slices) == drawn and all(n > 0 for n in drawn.values()) and dom.untipped == 0
    assert dom.hidden_lane_ids == []
    assert f"{len(records)} steps, {len(run.request_ids)} of {len(run.request_ids)} requests" in dom.summary

    assert cli.main(["replay", str(run.steps_path), "--step", str(chosen)]) == 0
    printed = capsys.readouterr().out
    assert dom.selected == str(chosen)
    assert dom.plan == printed[: printed.rindex("1 steps replayed")]  # the plan, as replay prints it
    assert "stalled yes" in dom.plan or "preempted: -" not in dom.plan


def test_the_search_box_filters_lanes_by_request_id_and_a_request_shows_its_details(run, pages, tmp_path):
    html, _ = pages
    wanted = run.request_ids[2]
    dom = Dom()
    dom.feed(chromium(tmp_path, "--dump-dom", f"{html.as_uri()}#q={wanted[:-1].upper()}&request={wanted}").stdout)
    assert dom.selected_request == f"request {wanted}"
    assert sorted(dom.lane_ids) == sorted(run.request_ids)
    assert sorted(dom.hidden_lane_ids) == sorted(set(run.request_ids) - {wanted})
    assert f"1 of {len(run.request_ids)} requests" in dom.summary


def png_size_and_colours(path: Path) -> tuple[int, int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, offset = b"", 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        if data[offset + 4 : offset + 8] == b"IDAT":
            idat += data[offset + 8 : offset + 8 + length]
        offset += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def test_chromium_screenshot_of_the_timeline(pages, tmp_path):
    html, _ = pages
    shot = tmp_path / "timeline.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,640", html.as_uri())
    width, height, colours = png_size_and_colours(shot)
    assert (width, height) == (1400, 640)
    assert colours > 50, "the screenshot is blank"
    print(f"screenshot: {shot}")


def test_perfetto_json_of_the_run_is_trace_event_format_with_one_event_per_slice(run, pages):
    _, perfetto = pages
    events = json.loads(perfetto.read_text())["traceEvents"]
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["ts"], int | float) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():  # complete events on one track never overlap (they nest nowhere here)
        spans.sort()
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    records = load_records(run.steps_path)
    timeline = build_timeline(records)
    slices = [e for e in events if e.get("cat") in ("prefill", "decode")]
    pairs = Counter((e["args"]["request_id"], e["args"]["step_index"]) for e in slices)
    assert max(pairs.values()) == 1
    planned = sum(len(r.plan.slices) for r in records)
    assert len(slices) == planned - sum(s.num_skipped_slices for s in timeline.steps)
    assert sum(e.get("cat") == "step" for e in events) == len(records)
