"""The restart policy of `hybridserve up` (hybridserve_cli/supervise.py) and the launcher's port pinning,
on real child processes: small Python servers that bind the port they are given (0 picks one) and
announce it, as the services do, and that start in a fraction of a second."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridserve.children import ChildExited
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli import build_parser, up
from hybridserve_cli.stack import Service, Stack
from hybridserve_cli.supervise import GaveUp, RestartLedger, RestartPolicy, Supervisor

# Binds --port (0: a free one) and announces it; with --die-after-first, every start after the first
# (the marker file exists) prints "boom" and exits 3 at once.
SERVER = r"""
import pathlib, socket, sys, time
args = sys.argv[1:]
port, marker = int(args[args.index("--port") + 1]), pathlib.Path(args[args.index("--marker") + 1])
if marker.exists() and "--die-after-first" in args:
    print("boom: cannot start again", flush=True)
    sys.exit(3)
marker.touch()
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen()
print(f"listening on 127.0.0.1:{sock.getsockname()[1]}", flush=True)
time.sleep(120)
"""
FAST = RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.05, max_backoff_s=0.1)


@pytest.fixture
def stack() -> Iterator[Stack]:
    with Stack(start_timeout_s=20.0, stop_timeout_s=5.0, die_with_parent=False) as s:
        yield s


def start_server(stack: Stack, tmp_path: Path, *extra: str) -> Service:
    command = [sys.executable, "-c", SERVER, "--port", "0", "--marker", str(tmp_path / "started"), *extra]
    return stack.start("svc", command)


@pytest.fixture
def supervising(stack: Stack) -> Iterator[tuple[Supervisor, threading.Thread]]:
    """A supervisor of `stack` running in a thread until the test ends."""
    stop = threading.Event()
    supervisor = Supervisor(stack, FAST)
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    yield supervisor, thread
    stop.set()
    thread.join(10)


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_delays_double_up_to_the_cap():
    policy = RestartPolicy(max_restarts=5, window_s=60.0, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.restart_delay_s(k) for k in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"max_restarts": -1}, "--max-restarts"),
        ({"window_s": 0.0}, "--restart-window-s"),
        ({"backoff_s": 2.0, "max_backoff_s": 1.0}, "--restart-backoff-s"),
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(fields, flag):
    with pytest.raises(InvalidArgumentError, match=flag):
        RestartPolicy(**fields)


def test_the_ledger_counts_restarts_within_the_window_only():
    ledger = RestartLedger(RestartPolicy(max_restarts=2, window_s=10.0))
    assert ledger.next_attempt("worker", 100.0) == 1
    ledger.record("worker", 100.0)
    ledger.record("worker", 105.0)
    assert ledger.next_attempt("worker", 106.0) is None  # two restarts in the last 10 s: give up
    assert ledger.next_attempt("gateway", 106.0) == 1  # counted per child
    assert ledger.next_attempt("worker", 110.5) == 2  # the restart at 100 s has left the window


def test_up_flags_make_the_policy_and_bad_ones_exit_2(capsys):
    args = build_parser(only="up").parse_args(
        ["up", "--max-restarts", "3", "--restart-window-s", "5", "--restart-backoff-s", "0.1"]
    )
    policy = up.settings_from_args(up.UpSettings, args).restart_policy
    assert (policy.max_restarts, policy.window_s, policy.backoff_s) == (3, 5.0, 0.1)
    assert up.run(build_parser(only="up").parse_args(["up", "--max-restarts", "-1"])) == 2
    assert "--max-restarts -1" in capsys.readouterr().err


def test_the_warm_up_wait_has_its_own_timeout_says_it_waits_and_ends_when_a_child_dies(
    stack, tmp_path, monkeypatch, caplog
):
    """The gateway's /ready is waited for under --ready-timeout (a cold compile takes minutes, more than
    --start-timeout gives a service to listen); up says it is still waiting, and a child that dies
    meanwhile ends the wait at once instead of at the timeout. The server below never answers HTTP."""
    caplog.set_level(logging.INFO, logger="hybridserve.up")
    args = build_parser(only="up").parse_args(["up", "--ready-timeout", "45", "--start-timeout", "20"])
    settings = up.settings_from_args(up.UpSettings, args)
    assert (settings.ready_timeout, settings.start_timeout) == (45.0, 20.0)
    assert up.UpSettings().ready_timeout >= 1800.0  # as long as a model process's warm-up may last
    service = start_server(stack, tmp_path)
    monkeypatch.setattr(up, "WARMING_NOTE_S", 0.5)
    with pytest.raises(up.UpError, match="within 2s of --ready-timeout"):
        up.wait_gateway_ready(service.address, 2.0, stack)
    assert "waiting for the worker's warm-up" in caplog.text
    stack.kill("svc")
    started = time.monotonic()
    with pytest.raises(ChildExited):
        up.wait_gateway_ready(service.address, 60.0, stack)
    assert time.monotonic() - started < 10.0


def test_a_service_on_port_0_comes_back_at_the_port_it_announced(stack, tmp_path):
    service = start_server(stack, tmp_path)
    address, port = service.address, service.child.port
    assert port != 0 and service.command[service.command.index("--port") + 1] == str(port)
    stack.kill("svc")
    assert stack.restart("svc") == address


def test_a_killed_child_is_restarted_and_the_restart_is_told(stack, tmp_path, supervising, caplog):
    caplog.set_level(logging.INFO, logger="hybridserve.supervise")
    service = start_server(stack, tmp_path)
    address, first_pid = service.address, service.child.pid
    stack.kill("svc")
    wait_for(lambda: "svc is back at" in caplog.text)
    assert service.child.pid != first_pid and service.child.is_running() and service.address == address
    assert f"svc (pid {first_pid}) was killed by SIGKILL; its last lines:" in caplog.text
    assert f"listening on {address}" in caplog.text  # its last lines
    assert f"restarting svc at {address} in 0.1 s (attempt 1 of 2 within 60 s)" in caplog.text


def test_a_child_that_dies_at_once_each_time_makes_the_supervisor_give_up(stack, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hybridserve.supervise")
    service = start_server(stack, tmp_path, "--die-after-first")
    stack.kill("svc")
    stop = threading.Event()
    timer = threading.Timer(30.0, stop.set)  # a supervisor that never gives up fails the test, not hangs it
    timer.start()
    try:
        with pytest.raises(GaveUp) as gave_up:
            Supervisor(stack, FAST).run(stop)
    finally:
        timer.cancel()
    message = str(gave_up.value)
    assert f"svc (pid {service.child.pid}) exited with code 3; its last lines:\n    boom" in message
    assert "svc was restarted 2 times within 60 s and died again (--max-restarts 2" in message
    assert "attempt 1 of 2" in caplog.text and "attempt 2 of 2" in caplog.text


def test_max_restarts_0_stops_at_the_first_death(stack, tmp_path):
    start_server(stack, tmp_path)
    stack.kill("svc")
    with pytest.raises(GaveUp, match="svc died and --max-restarts is 0"):
        Supervisor(stack, RestartPolicy(max_restarts=0)).run(threading.Event())


def test_one_shot_commands_are_not_supervised(stack, tmp_path):
    stack.run_once("init", [sys.executable, "-c", "pass"])
    assert [s.name for s in stack.servers()] == []


def test_the_banner_aligns_names_of_any_length():
    text = up.format_endpoints(
        [("gateway", "127.0.0.1:1", "(OpenAI HTTP API)"), ("worker metrics", "127.0.0.1:2", "(Prometheus)")]
    )
    assert "  gateway         127.0.0.1:1 (OpenAI HTTP API)" in text.splitlines()
    assert "  worker metrics  127.0.0.1:2 (Prometheus)" in text.splitlines()
