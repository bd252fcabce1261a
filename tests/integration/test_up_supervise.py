"""`hybridserve up` keeps its stack alive, on real processes and a tiny model: every port 0, so the
banner must show the ports the children announced (and a request to them must work); a worker, the
gateway and the embedded Redis killed with SIGKILL come back at their addresses, up says which died
and how, and a request through the gateway succeeds again; a gateway that cannot start again (its
model folder gone) makes up give up after --max-restarts tries, stop the stack and exit 1.

One `up` serves the whole module (one model load); the tests run in file order and the last one ends it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hybridserve.children import Child, hybridserve_command
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

pytestmark = pytest.mark.slow

SPEC = ModelSpec(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3), mamba_n_heads=4,
    mamba_d_state=16,
)  # fmt: skip
MAX_RESTARTS = 2
START_TIMEOUT_S = 180.0
STARTED = re.compile(r"started (\S+)(?: again)? \(pid (\d+)\)")
BANNER = re.compile(r"^\s+(\w+)\s+(\S+:\d+)(.*)$", re.MULTILINE)
GRPC_NOTE = re.compile(r"gRPC Generation API on (\S+:\d+)")


class Up:
    """`hybridserve up` as a child; stdout (the banner) and stderr (relayed lines, up's log) in one."""

    def __init__(self, *args: str) -> None:
        self.child = Child("up", hybridserve_command("up", *args), keep_lines=100_000, die_with_parent=False)

    @property
    def text(self) -> str:
        return self.child.output

    def wait_for(self, pattern: str, timeout_s: float, start: int = 0) -> re.Match[str]:
        """The first match of `pattern` in up's output after its line number `start`."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, "\n".join(list(self.child.lines)[start:]), re.MULTILINE)
            if found is not None:
                return found
            assert self.child.is_running(), f"up exited ({self.child.proc.returncode}):\n{self.text}"
            assert time.monotonic() < deadline, f"no {pattern!r} in up's output:\n{self.text}"
            time.sleep(0.1)

    def pid(self, name: str) -> int:
        return [int(pid) for child, pid in STARTED.findall(self.text) if child == name][-1]

    def banner(self) -> dict[str, tuple[str, str]]:
        block = self.text[self.text.index("hybridserve is up:") :]
        return {name: (address, note) for name, address, note in BANNER.findall(block.split("stop with")[0])}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("up-supervise") / "tiny", SPEC, seed=3)


@pytest.fixture(scope="module")
def up(model: Path) -> Iterator[Up]:
    proc = Up("--home", str(model.parent), "--model", str(model), "--scheduler-port", "0", "--worker-port", "0",
              "--cache-port", "0", "--gateway-port", "0", "--gateway-grpc-port", "0", "--stop-timeout", "10",
              "--max-restarts", str(MAX_RESTARTS), "--restart-backoff-s", "0.2",
              "--", "--device", "cpu", "--memory-budget-mb", "24", "--max-num-seqs", "2", "--block-size", "16",
              "--mamba-block-size", "8", "--model-process", "off")  # fmt: skip
    try:
        proc.wait_for(r"^stop with Ctrl-C", START_TIMEOUT_S)
        yield proc
    finally:
        proc.child.stop(30.0)


def complete(gateway: str, timeout_s: float = 60.0) -> dict:
    """A completion through the gateway's OpenAI API, retried while it answers 503 (no worker ready)."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(f"http://{gateway}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"no completion from {gateway}: {exc}") from None
        time.sleep(0.2)


def kill_and_wait_back(up: Up, name: str) -> int:
    """SIGKILL `name`; returns its pid once up says it is back, having told the death and the restart."""
    pid, mark = up.pid(name), len(up.child.lines)
    os.kill(pid, signal.SIGKILL)
    up.wait_for(rf"{name} is back at \S+ \(pid \d+, attempt 1\)", START_TIMEOUT_S, mark)
    told = "\n".join(list(up.child.lines)[mark:])
    assert f"{name} (pid {pid}) was killed by SIGKILL; its last lines:" in told, told
    assert re.search(rf"restarting {name} at \S+:\d+ in 0\.2 s \(attempt 1 of {MAX_RESTARTS} within 60 s\)", told)
    return pid


def test_the_banner_shows_the_announced_ports_and_they_serve(up):
    banner = up.banner()
    gateway, note = banner["gateway"]
    grpc_address = GRPC_NOTE.search(note).group(1)
    assert not gateway.endswith(":0") and not grpc_address.endswith(":0"), up.text
    assert f"gateway   | listening on {gateway}" in up.text, up.text  # as the gateway announced them
    assert f"gateway   | grpc listening on {grpc_address}" in up.text, up.text
    assert f"--workers {banner['worker'][0]}" in up.text  # the gateway was handed the worker's announced address
    assert complete(gateway)["usage"]["completion_tokens"] == 4
    request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(grpc_address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4


def test_a_killed_worker_is_restarted_and_the_stack_serves_again(up):
    worker = up.banner()["worker"][0]
    kill_and_wait_back(up, "worker")
    assert re.search(rf"worker is back at {re.escape(worker)} ", up.text)  # the port it got first
    assert complete(up.banner()["gateway"][0])["usage"]["completion_tokens"] == 4


def test_a_killed_gateway_comes_back_on_both_its_ports(up):
    gateway, note = up.banner()["gateway"]
    kill_and_wait_back(up, "gateway")
    assert complete(gateway)["usage"]["completion_tokens"] == 4
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    with grpc.insecure_channel(GRPC_NOTE.search(note).group(1)) as channel:
        assert list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))


def test_a_killed_redis_is_restarted(up):
    kill_and_wait_back(up, "redis")
    assert complete(up.banner()["gateway"][0])["usage"]["completion_tokens"] == 4


def test_a_child_that_cannot_start_again_makes_up_give_up(up, model):
    """Runs last: it ends the module's `up`. The model folder moved away, a killed gateway dies at
    once each time it is started again (its --model names nothing)."""
    pids = {name: up.pid(name) for name in ("gateway", "scheduler", "redis", "cache", "worker")}
    model.rename(model.with_name("moved"))
    os.kill(pids["gateway"], signal.SIGKILL)
    code = up.child.wait_exit(START_TIMEOUT_S)
    assert code == 1, up.text
    assert f"attempt {MAX_RESTARTS} of {MAX_RESTARTS} within 60 s" in up.text, up.text
    assert re.search(r"error: gateway \(pid \d+\) exited with code 2; its last lines:\n(    .*\n)*"
                     rf"    hybridserve gateway: .*{re.escape(str(model))}", up.text), up.text  # fmt: skip
    assert (f"gateway was restarted {MAX_RESTARTS} times within 60 s and died again (--max-restarts "
            f"{MAX_RESTARTS}, --restart-window-s 60): giving up, stopping the stack") in up.text  # fmt: skip
    for name, pid in pids.items():
        assert _has_exited(pid), f"{name} outlived up:\n{up.text}"


def _has_exited(pid: int) -> bool:
    """True once `pid` has exited (a zombie not yet reaped, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True
