"""A tiny checkpoint on a loopback stand-in hub (tests/hub/stand_in_hub.py), and a hub cache filled
from it by `hybridserve download`, so that huggingface_hub itself writes the cache layout
(`models--ORG--NAME/{blobs,refs,snapshots}`) the serving tests read offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybridserve.children import hybridserve_command
from hybridserve_cli.init_model import write_random_checkpoint
from tests.gateway.conftest import SPEC
from tests.hub.stand_in_hub import Repo, StandInHub, folder_files

REPO_ID = "tiny-org/tiny-hybrid"
GATED_ID = "tiny-org/gated-hybrid"
GATED_TOKEN = "hf_stand_in_token_0123"
# Files a repo holds that no server reads: a download must leave them on the hub.
EXTRAS = {"README.md": b"# tiny hybrid\n", "pytorch_model.bin": b"not for us", "original/consolidated.pth": b"nor this"}


@dataclass(frozen=True)
class Hub:
    server: StandInHub
    main_sha: str  # main: the single-file checkpoint
    v2_sha: str  # branch v2: the same weights in two shards and an index

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        """A child's environment: this hub, a private HF_HOME (no token file), no HF_* of the caller."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
        return (
            env | {"HF_ENDPOINT": self.server.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"} | extra
        )


def run_cli(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """`hybridserve ARGS` to its end, its output captured."""
    return subprocess.run(hybridserve_command(*args), env=env, capture_output=True, text=True, timeout=timeout_s)


def reshard(src: Path, dst: Path) -> Path:
    """`src`'s checkpoint with its tensors split over two shards and an index (the same weights)."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, dst / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("hub-model") / "tiny-hybrid", SPEC, seed=3)


@pytest.fixture(scope="session")
def hub(checkpoint, tmp_path_factory) -> Iterator[Hub]:
    sharded = reshard(checkpoint, tmp_path_factory.mktemp("hub-sharded") / "tiny-hybrid")
    repo = Repo(REPO_ID)
    main_sha = repo.add_commit(folder_files(checkpoint) | EXTRAS, "main")
    v2_sha = repo.add_commit(folder_files(sharded) | EXTRAS, "v2")
    gated = Repo(GATED_ID, token=GATED_TOKEN)
    gated.add_commit(folder_files(checkpoint), "main")
    with StandInHub([repo, gated]) as server:
        yield Hub(server, main_sha, v2_sha)


@dataclass(frozen=True)
class FilledCache:
    cache: Path  # the hub cache folder (--download-dir / HF_HUB_CACHE)
    main: Path  # the snapshot folder `hybridserve download` printed for main
    v2: Path  # ... and for --revision v2


@pytest.fixture(scope="session")
def filled_cache(hub, tmp_path_factory) -> FilledCache:
    root = tmp_path_factory.mktemp("hub-cache")
    cache, env = root / "hub", hub.env(root / "home")
    printed = []
    for extra in ((), ("--revision", "v2")):
        done = run_cli("download", REPO_ID, "--download-dir", str(cache), *extra, env=env)
        assert done.returncode == 0, done.stderr
        printed.append(Path(done.stdout.strip().splitlines()[-1]))
    return FilledCache(cache, *printed)
