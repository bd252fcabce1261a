"""A private Docker engine for one test session: `dockerd` as a child process with its own data
root, exec root and socket under a temporary folder, and no networking of its own.

`--bridge=none --iptables=false --ip-forward=false --ip-masq=false`: the engine creates no
docker0 bridge and touches no firewall or forwarding setting of the host; the compose stack runs
on host networking only. Stopping sends SIGTERM to this dockerd's PID (it stops the containerd it
started and the containers), then unmounts whatever is left under its folders.

Its folders live on a tmpfs when the machine has the memory to spare: the engine writes and then
deletes a few GB of small files (image layers), which on a disk mounted with `discard` takes
minutes to delete; unmounting a tmpfs frees it at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.deploy.host_tools import run

DOCKERD_FLAGS = ("--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false")
TMPFS_SIZE_GIB = 8  # image layers, containers, build context and the debootstrap scratch folder
TMPFS_MIN_AVAILABLE_GIB = 12  # below this much available memory the folders stay on disk


class Dockerd:
    """Start with `Dockerd.start()`; `env` points docker and docker-compose at it; `stop()` ends it."""

    def __init__(self, root: Path, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.root = root
        self.proc = proc
        self.log_path = log_path
        self.socket = root / "docker.sock"

    @classmethod
    def start(cls, timeout_s: float = 60.0) -> Dockerd:
        root = Path(tempfile.mkdtemp(prefix="hybridserve-dockerd-"))
        if available_memory_gib() >= TMPFS_MIN_AVAILABLE_GIB:
            run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE_GIB}g,mode=0700", "tmpfs", str(root)], timeout_s=30)
        log_path = root / "dockerd.log"
        command = [
            "dockerd", *DOCKERD_FLAGS,
            "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
            "--pidfile", str(root / "dockerd.pid"), "-H", f"unix://{root / 'docker.sock'}",
            "--userland-proxy=false",
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        engine = cls(root, proc, log_path)
        try:
            engine._wait_ready(timeout_s)
        except BaseException:
            engine.stop()
            raise
        return engine

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker and docker-compose: this engine, the classic builder."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0",
                "COMPOSE_DOCKER_CLI_BUILD": "0"}  # fmt: skip

    def docker(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([docker_cli(), *args], timeout_s=timeout_s, env=self.env, check=check)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists() and self.docker("version", timeout_s=10, check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"dockerd did not answer within {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to this dockerd's PID (SIGKILL after timeout_s), then unmount and remove its folders."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        unmount_under(self.root)
        subprocess.run(["umount", str(self.root)], capture_output=True, check=False)  # the tmpfs, if any
        shutil.rmtree(self.root, ignore_errors=True)

    def scratch(self, prefix: str) -> Path:
        """A temporary folder beside the engine's (on its tmpfs when it has one), removed with it."""
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root))


def available_memory_gib() -> float:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields.get("MemAvailable", "0 kB").split()[0]) / (1 << 20)


def docker_cli() -> str:
    """Debian's docker client (it matches the engine); another one earlier on PATH may not."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def mounts_under(root: Path) -> list[str]:
    """Mount points below root, deepest first (the order they can be unmounted in)."""
    prefix = str(root.resolve()) + "/"
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_under(root: Path) -> None:
    """Unmounts what the engine left mounted below root (overlay layers, netns files, shm)."""
    for point in mounts_under(root):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
