"""`hybridserve up` end to end, as an operator runs it: installed into a fresh virtual environment
(`pip install -e` of this checkout, so the `hybridserve` entry point itself is exercised), started on
free ports, asked for a completion by `hybridserve generate`, then stopped with SIGTERM; no child may
outlive it. Also: a worker that dies at start-up takes the stack down with a message naming it."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import site
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")
ENDPOINT = re.compile(r"^\s+(scheduler|worker)\s+(\S+:\d+)", re.MULTILINE)
START_TIMEOUT_S = 240.0  # first run writes the default model; the worker imports torch and loads it

pytestmark = pytest.mark.slow
needs_worker = pytest.mark.skipif(
    importlib.util.find_spec("gpu_worker.api.server") is None,
    reason="gpu_worker/api/server.py (`hybridserve worker`) has not landed yet",
)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with this checkout installed editable, no dependencies downloaded.

    `--system-site-packages` exposes the base interpreter's packages, not those of the venv running
    the tests, so a .pth file adds the latter (torch, grpc, setuptools, pip, ...) behind the new
    venv's own. `--without-pip`: ensurepip would put Python's bundled setuptools 65 in front, which
    cannot build an editable wheel offline; the parent's pip installs into the new venv instead."""
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)],
                   check=True, timeout=180)  # fmt: skip
    new_site = next(env_dir.glob("lib/python*/site-packages"))
    (new_site / "zz_test_parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
               "--no-index", "-e", str(ROOT)]  # fmt: skip
    subprocess.run(install, check=True, timeout=300, cwd=env_dir)
    assert (env_dir / "bin" / "hybridserve").exists()
    return env_dir


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybridserve-home")


class UpProcess:
    """`hybridserve up` with both pipes drained into strings."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd="/", env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        for pipe, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda p=pipe, s=sink: s.extend(p), daemon=True).start()

    @property
    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def endpoints(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = dict(ENDPOINT.findall("".join(self.out)))
            if "worker" in found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"`hybridserve up` did not come up:\n{self.text}")

    def child_pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in STARTED.findall("".join(self.err))}

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_gone(pids: dict[str, int], output: str) -> None:
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = {name: pid for name, pid in pids.items() if is_alive(pid)}
    for pid in alive.values():
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"children outlived `hybridserve up`: {alive}\n{output}"


@needs_worker
def test_up_generate_and_stop(venv: Path, home: Path):
    up = UpProcess([str(venv / "bin" / "hybridserve"), "up", "--home", str(home), "--scheduler-port", "0",
                    "--worker-port", "0", "--cache-port", "0", "--gateway-port", "0",
                    "--gateway-grpc-port", "0"])  # fmt: skip
    try:
        endpoints = up.endpoints(START_TIMEOUT_S)
        assert re.search(r"hybridserve is up:\n\s+gateway\s", "".join(up.out)), up.text  # the front door first
        assert (home / "models" / "default" / "config.json").is_file()
        generate = [str(venv / "bin" / "hybridserve"), "generate", "--worker", endpoints["worker"]]
        result = subprocess.run([*generate, "Hello", "--max-tokens", "8"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr + up.text
        assert re.search(r"completion_tokens=8\b|finish_reason=(stop|eos)", result.stderr), result.stderr
        # A prompt longer than one 256-token block, then the same prefix again: the second is a hit.
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 7
        for suffix, cached in (("", "0"), (" And again.", "256")):
            result = subprocess.run(
                [*generate, long_prompt + suffix, "--max-tokens", "4"], capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, result.stdout + result.stderr + up.text
            assert f"cached_tokens={cached} " in result.stderr, result.stderr
    finally:
        code = up.stop()
    assert code == 0, up.text
    pids = up.child_pids()
    assert {"gateway", "scheduler", "worker", "cache", "redis"} <= set(pids), up.text
    assert_gone(pids, up.text)


def test_a_worker_that_dies_stops_the_stack(home: Path):
    command = [sys.executable, "-m", "hybridserve_cli", "up", "--home", str(home), "--scheduler-port", "0",
               "--worker-port", "0", "--gateway-port", "0", "--gateway-grpc-port", "0", "--no-cache", "--",
               "--no-such-worker-flag"]  # fmt: skip
    up = UpProcess(command)
    try:
        code = up.proc.wait(START_TIMEOUT_S)
    finally:
        up.stop()
    time.sleep(0.2)  # the drain threads read the last lines
    assert code == 1, up.text
    assert re.search(r"error: worker \(pid \d+\) exited with code \d+; its last lines:", up.text), up.text
    pids = up.child_pids()
    assert "scheduler" in pids, up.text
    assert_gone(pids, up.text)
