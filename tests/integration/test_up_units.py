"""Unit tests of the pieces of `hybridserve up`: flags, endpoint lines, and the child-process helper
(start, read `listening on`, report a death, stop with SIGTERM then SIGKILL)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hybridserve.children import Child, ChildExited, Interrupted, connect_address, parse_listening
from hybridserve_cli import build_parser, up


def parse(*argv: str):
    return build_parser(only="up").parse_args(["up", *argv])


def test_flags_and_worker_pass_through(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_UP_HOME", raising=False)
    args = parse()
    assert (args.scheduler_port, args.worker_port, args.host, args.no_cache) == (50051, 50052, "127.0.0.1", False)
    assert args.home == Path("~/.cache/hybridserve") and args.model is None
    args = parse("--home", "/h", "--scheduler-port", "0", "--worker-port", "0", "--no-cache", "--",
                 "--max-num-seqs", "32", "--async-scheduling")  # fmt: skip
    assert args.home == Path("/h") and args.scheduler_port == 0 and args.no_cache
    assert up.worker_flags(args.worker_args) == ["--max-num-seqs", "32", "--async-scheduling"]
    assert up.worker_flags(parse().worker_args) == []


def test_home_defaults_to_env(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_UP_HOME", "/srv/hs")
    assert parse().home == Path("/srv/hs")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("listening on 127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("worker    | listening on 0.0.0.0:4242", ("0.0.0.0", 4242)),
        ("listening on [::1]:9", ("::1", 9)),
        ("2026 INFO loading model", None),
        ("listening on nowhere", None),
    ],
)
def test_parse_listening(line, expected):
    assert parse_listening(line) == expected


def test_connect_address_dials_loopback_for_wildcards():
    assert connect_address("0.0.0.0", 5) == "127.0.0.1:5"
    assert connect_address("::", 5) == "127.0.0.1:5"
    assert connect_address("10.1.2.3", 5) == "10.1.2.3:5"
    assert connect_address("::1", 5) == "[::1]:5"


def test_endpoints_block():
    text = up.format_endpoints(
        [("scheduler", "127.0.0.1:50051", ""), ("worker", "127.0.0.1:50052", "(Generation API)")]
    )
    lines = text.splitlines()
    assert "  scheduler  127.0.0.1:50051" in lines
    assert "  worker     127.0.0.1:50052 (Generation API)" in lines
    assert 'try: hybridserve generate "Hello"' in lines
    custom = up.format_endpoints([("worker", "127.0.0.1:6000", "")])
    assert 'try: hybridserve generate "Hello" --worker 127.0.0.1:6000' in custom


def test_worker_note_says_how_long_the_warm_up_took():
    warm = "2026-01-01 00:00:00,000 INFO hybridserve.worker: warm in 7.84 s: compile 9.7 s (attached), kernels 3.2 s"
    assert up.worker_note(["listening on 127.0.0.1:5", warm]) == "(Generation API; warmed up in 7.8 s)"
    assert up.worker_note(["listening on 127.0.0.1:5"]) == "(Generation API)"  # --serve-while-warming logs none


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(up.UpError, match="no config.json"):
        up.ensure_model(parse("--model", str(tmp_path)), up.Stack())


def python_child(code: str, name: str = "child") -> Child:
    return Child(name, [sys.executable, "-c", code])


def test_child_reports_its_address_and_relays_lines():
    relayed: list[tuple[str, str]] = []
    code = "import time; print('hello'); print('listening on 0.0.0.0:1234', flush=True); time.sleep(30)"
    child = Child("svc", [sys.executable, "-c", code], relay=lambda n, line: relayed.append((n, line)))
    try:
        assert child.wait_listening(10) == "127.0.0.1:1234"
        assert ("svc", "hello") in relayed
    finally:
        assert child.stop(5) == -15


def test_child_that_dies_before_listening_is_reported():
    child = python_child("import sys; print('bad flag --x'); sys.exit(2)", name="worker")
    with pytest.raises(ChildExited) as err:
        child.wait_listening(10)
    assert (
        "worker (pid" in str(err.value) and "exited with code 2" in str(err.value) and "bad flag --x" in str(err.value)
    )


def test_wait_is_interruptible_and_bounded():
    child = python_child("import time; time.sleep(30)")
    try:
        with pytest.raises(Interrupted):
            child.wait_listening(10, should_stop=lambda: True)
        with pytest.raises(TimeoutError, match="did not print 'listening on'"):
            child.wait_listening(0.3)
    finally:
        child.stop(5)


def test_stop_escalates_to_sigkill():
    child = python_child("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "print('listening on 127.0.0.1:1', flush=True); time.sleep(60)")  # fmt: skip
    child.wait_listening(10)
    start = time.monotonic()
    assert child.stop(timeout_s=0.5) == -9
    assert time.monotonic() - start < 5
