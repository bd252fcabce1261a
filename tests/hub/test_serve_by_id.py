"""Serving by repo id from the hub cache, offline: a real worker given `--model ORG/NAME` (the cache
that `hybridserve download` filled, HF_HUB_OFFLINE=1) generates the tokens the same worker generates
on the checkpoint folder, under the id; pinned to a commit (`--revision SHA`, HF_HUB_CACHE instead of
--download-dir) it serves that commit's snapshot (the same weights in two shards), with the same tokens."""

from __future__ import annotations

import grpc

from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import scheduler, worker_args  # noqa: F401  (scheduler: the shared fixture)
from tests.hub.conftest import REPO_ID
from tests.procs import ServerProcess

SMALL = ("--model-process", "off", "--cpu-warm-rows", "0")  # one process, no kernel warm-up: a quick start
PROMPTS = ["Hello, hub!", "def f(x):\n    return x", "\u00e9t\u00e9 \u2014 caf\u00e9"]


def served(address: str) -> tuple[pb.GetInfoResponse, list[list[int]]]:
    """The worker's GetInfo and its greedy tokens for PROMPTS."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        outputs = []
        for prompt in PROMPTS:
            request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True))
            outputs.append([t for m in stub.Generate(request, timeout=60) for t in m.token_ids])
        return stub.GetInfo(pb.GetInfoRequest(), timeout=10), outputs


def test_serve_by_id_offline_equals_the_folder_and_a_pinned_revision(
    scheduler,  # noqa: F811
    hub,
    filled_cache,
    checkpoint,
    tmp_path,
) -> None:
    before = len(hub.server.requests)
    offline = hub.env(tmp_path, HF_HUB_OFFLINE="1")  # HF_ENDPOINT still names the stand-in: any request shows
    with ServerProcess(worker_args(checkpoint, scheduler.address, 0, *SMALL), timeout_s=120, env=offline) as worker:
        folder_info, folder_tokens = served(worker.address)
    by_id = worker_args(REPO_ID, scheduler.address, 0, *SMALL, "--download-dir", str(filled_cache.cache))
    with ServerProcess(by_id, timeout_s=120, env=offline) as worker:
        id_info, id_tokens = served(worker.address)
        id_log = worker.output
    pinned = worker_args(REPO_ID, scheduler.address, 0, *SMALL, "--revision", hub.v2_sha)
    with ServerProcess(pinned, timeout_s=120, env=offline | {"HF_HUB_CACHE": str(filled_cache.cache)}) as worker:
        pinned_info, pinned_tokens = served(worker.address)
        pinned_log = worker.output
    assert len(hub.server.requests) == before, "offline workers never reach the hub"

    assert folder_info.model == checkpoint.name
    assert all(len(t) == 12 for t in folder_tokens)
    assert (id_info.model, id_info.model_fingerprint) == (REPO_ID, folder_info.model_fingerprint)
    assert id_tokens == folder_tokens
    assert str(filled_cache.main) in id_log  # the snapshot huggingface_hub resolved main to
    assert (pinned_info.model, pinned_info.model_fingerprint) == (REPO_ID, folder_info.model_fingerprint)
    assert pinned_tokens == folder_tokens
    assert str(filled_cache.v2) in pinned_log and str(filled_cache.main) not in pinned_log
