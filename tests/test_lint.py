"""Ruff over the tree and mypy (strict on every package: hybridserve, hybridserve_cli, scheduler_svc,
cache_svc, gateway and gpu_worker; pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None and run("ruff", "--version").returncode != 0, reason="ruff missing")
def test_ruff_clean():
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_clean():
    result = run("mypy", "scheduler_svc", "hybridserve", "hybridserve_cli", "cache_svc", "gateway", "gpu_worker")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_merge_conflict_markers():
    """No tracked text file keeps a merge's conflict markers (they can survive in prose unnoticed)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".safetensors", ".pyc"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if line.startswith(markers)]
    assert not found, f"merge conflict markers left in: {found}"
