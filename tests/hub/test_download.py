"""`hybridserve download` against the loopback stand-in hub: the cache layout huggingface_hub writes,
only the files a worker reads, revisions by branch, offline re-resolution; and every way an id can
fail giving one line on stderr, naming the id, with exit code 2 (download, worker, gateway)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.model_source import ModelSourceError, is_repo_id, resolve_model
from tests.hub.conftest import EXTRAS, GATED_ID, GATED_TOKEN, REPO_ID, run_cli
from tests.hub.stand_in_hub import folder_files


def test_download_fills_the_hub_cache_with_the_worker_files_only(hub, filled_cache, checkpoint) -> None:
    repo_folder = filled_cache.cache / "models--tiny-org--tiny-hybrid"
    assert filled_cache.main == repo_folder / "snapshots" / hub.main_sha
    assert filled_cache.v2 == repo_folder / "snapshots" / hub.v2_sha  # --revision v2: a branch
    assert (repo_folder / "refs" / "main").read_text() == hub.main_sha
    assert (repo_folder / "refs" / "v2").read_text() == hub.v2_sha
    assert folder_files(filled_cache.main) == folder_files(checkpoint)  # every file the checkpoint has, as it is
    assert all((filled_cache.main / name).is_symlink() for name in folder_files(checkpoint))  # into blobs/
    sharded = set(folder_files(filled_cache.v2))
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors"} <= sharded
    assert "model.safetensors" not in sharded
    assert not set(EXTRAS) & hub.server.fetched_files(), "files no server reads stay on the hub"


def test_download_again_offline_resolves_from_the_cache(hub, filled_cache, tmp_path) -> None:
    env = hub.env(tmp_path, HF_HUB_OFFLINE="1")
    before = len(hub.server.requests)
    for extra, snapshot in (((), filled_cache.main), (("--revision", "v2"), filled_cache.v2)):
        done = run_cli("download", REPO_ID, "--download-dir", str(filled_cache.cache), *extra, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(snapshot)
    assert len(hub.server.requests) == before, "offline: not one request"


def test_gated_repo_downloads_with_hf_token(hub, tmp_path) -> None:
    done = run_cli(
        "download", GATED_ID, "--download-dir", str(tmp_path / "hub"), env=hub.env(tmp_path, HF_TOKEN=GATED_TOKEN)
    )
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip())
    assert snapshot.parent == tmp_path / "hub" / "models--tiny-org--gated-hybrid" / "snapshots"
    assert (snapshot / "model.safetensors").is_file()
    sent = {auth for method, path, auth in hub.server.requests if path.startswith(f"/{GATED_ID}/resolve/")}
    assert f"Bearer {GATED_TOKEN}" in sent, "HF_TOKEN reaches the hub through huggingface_hub"


def _one_line_exit_2(done, *words: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "env_extra", "words"),
    [
        (("tiny-org/no-such-model",), {}, ("tiny-org/no-such-model", "no such model", "HF_TOKEN")),
        ((GATED_ID,), {}, (GATED_ID, "gated", "HF_TOKEN")),
        ((GATED_ID,), {"HF_TOKEN": "hf_wrong"}, (GATED_ID, "gated", "no access")),
        ((REPO_ID, "--revision", "no-such-branch"), {}, (REPO_ID, "no revision 'no-such-branch'", "--revision")),
        ((REPO_ID,), {"HF_HUB_OFFLINE": "1"}, (REPO_ID, "HF_HUB_OFFLINE", "hybridserve download")),
        (("no-slash",), {}, ("no-slash", "ORG/NAME")),
    ],
    ids=["missing-id", "gated-no-token", "gated-wrong-token", "missing-revision", "offline-not-cached", "not-an-id"],
)
def test_download_errors_are_one_line_and_exit_2(hub, tmp_path, args, env_extra, words) -> None:
    done = run_cli("download", *args, "--download-dir", str(tmp_path / "hub"), env=hub.env(tmp_path, **env_extra))
    _one_line_exit_2(done, *words)
    assert not done.stdout


def test_worker_and_gateway_give_the_same_one_line_errors(hub, tmp_path) -> None:
    offline = hub.env(tmp_path, HF_HUB_OFFLINE="1")
    done = run_cli(
        "worker", "--model", REPO_ID, "--download-dir", str(tmp_path / "empty"), "--device", "cpu", env=offline
    )
    _one_line_exit_2(done, "hybridserve worker:", REPO_ID, "HF_HUB_OFFLINE")
    env = hub.env(tmp_path)
    done = run_cli("gateway", "--workers", "127.0.0.1:1", "--model", "tiny-org/no-such-model", "--port", "0", env=env)
    _one_line_exit_2(done, "hybridserve gateway:", "tiny-org/no-such-model", "no such model")
    done = run_cli("gateway", "--workers", "127.0.0.1:1", "--model", str(tmp_path / "no-such-folder"), env=env)
    _one_line_exit_2(done, "hybridserve gateway:", "no-such-folder", "does not exist")


@pytest.mark.parametrize(
    ("spec", "is_id"),
    [("ORG/NAME", True), ("ibm-granite/granite-4.0-h-tiny", True), ("a_b/c.d-e", True), ("gpt2", False),
     ("/abs/path", False), ("./rel/path", False), ("a/b/c", False), ("a/../b", False), ("a--b/c", False),
     (".hidden/x", False), ("org/", False), ("~/models/x", False)],
)  # fmt: skip
def test_repo_id_shape(spec: str, is_id: bool) -> None:
    assert is_repo_id(spec) is is_id


def test_an_existing_path_is_a_folder_even_when_shaped_like_an_id(checkpoint, monkeypatch) -> None:
    monkeypatch.chdir(checkpoint.parent.parent)
    spec = f"{checkpoint.parent.name}/{checkpoint.name}"  # ORG/NAME-shaped, and a folder here
    source = resolve_model(spec)
    assert (source.path, source.repo_id, source.served_name) == (checkpoint.relative_to(checkpoint.parent.parent),
                                                                 None, checkpoint.name)  # fmt: skip
    with pytest.raises(ModelSourceError, match="--revision v1 applies to a Hugging Face repo id"):
        resolve_model(spec, revision="v1")
    with pytest.raises(ModelSourceError, match="is a file"):
        resolve_model(checkpoint / "config.json")
