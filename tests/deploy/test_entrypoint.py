"""deploy/entrypoint.sh, the image's entry point, run by sh with a stand-in `hybridserve` on PATH that
records how it was called: the default model is written once, a repo id is downloaded into the hub
cache before the worker starts offline, and a folder or an offline start is passed through."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[2] / "deploy" / "entrypoint.sh"
STAND_IN = """#!/bin/sh
echo "$* | offline=${HF_HUB_OFFLINE:-}" >> "$CALLS"
if [ "$1" = init-model ]; then mkdir -p "$2" && touch "$2/config.json"; fi
"""


@pytest.fixture
def run(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hybridserve").write_text(STAND_IN)
    (bin_dir / "hybridserve").chmod(0o755)
    calls = tmp_path / "calls"

    def entrypoint(*args: str, **env: str) -> list[str]:
        base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "HYBRIDSERVE_HOME": str(tmp_path)}
        command = ["sh", str(ENTRYPOINT), *args]
        done = subprocess.run(command, env=base | env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        lines = calls.read_text().splitlines()
        calls.unlink()
        return lines

    return entrypoint


def test_no_model_writes_the_default_once(run, tmp_path: Path) -> None:
    default = tmp_path / "default"
    init, serve = run("worker", "--port", "1")
    assert init.startswith(f"init-model {default}.partial-") and (default / "config.json").is_file()
    assert serve == f"worker --model {default} --port 1 | offline="
    assert run("worker", "--port", "1") == [f"worker --model {default} --port 1 | offline="]  # written once


@pytest.mark.parametrize(
    ("args", "env", "download"),
    [
        ((), {"HYBRIDSERVE_WORKER_MODEL": "org/name"}, "download org/name"),
        ((), {"HYBRIDSERVE_WORKER_MODEL": "org/name", "HYBRIDSERVE_WORKER_REVISION": "v2"},
         "download org/name --revision v2"),
        (("--model", "org/name", "--revision=abc"), {}, "download org/name --revision abc"),
    ],
)  # fmt: skip
def test_a_repo_id_is_downloaded_then_served_offline(run, args, env, download) -> None:
    calls = run("worker", *args, "--port", "1", **env)
    assert calls == [f"{download} | offline=", f"worker {' '.join((*args, '--port', '1'))} | offline=1"]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("--model", "/models/mine"), {}),  # a folder
        (("--model", "org/name"), {"HF_HUB_OFFLINE": "1"}),  # already downloaded (an init container)
    ],
)
def test_a_folder_or_an_offline_start_is_passed_through(run, args, env) -> None:
    offline = env.get("HF_HUB_OFFLINE", "")
    assert run("worker", *args, **env) == [f"worker {' '.join(args)} | offline={offline}"]


def test_other_commands_are_passed_through(run) -> None:
    assert run("gateway", "--model", "org/name") == ["gateway --model org/name | offline="]
