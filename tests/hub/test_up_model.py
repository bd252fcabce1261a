"""`hybridserve up --model ORG/NAME`: the id is resolved once by `up`, and its children are told the
id pinned to the commit it resolved to, offline, so they read the snapshot `up` checked."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.hub.conftest import REPO_ID

RESOLVE = """
import json, sys
from hybridserve_cli import up
from hybridserve.settings import settings_from_args
import argparse
parser = argparse.ArgumentParser()
up.add_arguments(parser)
settings = settings_from_args(up.UpSettings, parser.parse_args(sys.argv[1:]))
try:
    model = up.given_model(settings)
except up.UpError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"spec": model.spec, "flags": list(model.flags), "env": dict(model.env)}))
"""


def given_model(*args: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", RESOLVE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_up_pins_an_id_to_its_resolved_commit_and_serves_it_offline(hub, filled_cache, tmp_path) -> None:
    env = hub.env(tmp_path / "home")
    got = given_model("--model", REPO_ID, "--revision", "v2", "--download-dir", str(filled_cache.cache), env=env)
    assert got == {
        "spec": REPO_ID,
        "flags": ["--revision", hub.v2_sha, "--download-dir", str(filled_cache.cache)],
        "env": {"HF_HUB_OFFLINE": "1"},
    }
    assert filled_cache.v2.name == hub.v2_sha  # the snapshot the children then read


def test_up_stops_on_an_unknown_id_with_the_hub_message(hub, tmp_path) -> None:
    got = given_model("--model", "tiny-org/no-such-model", "--download-dir", str(tmp_path / "c"),
                      env=hub.env(tmp_path / "home"))  # fmt: skip
    assert "tiny-org/no-such-model" in got["error"] and "\n" not in got["error"]


def test_up_refuses_a_folder_without_a_config(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    got = given_model("--model", str(tmp_path / "empty"), env={"PATH": "/usr/bin:/bin"})
    assert "no config.json" in got["error"]
