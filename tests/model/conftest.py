"""Fixtures for the model tests: tiny random HF checkpoints of every family (transformers is the oracle)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from scheduler_svc.server import create_server
from tests.model.model_helpers import FAMILY_SPECS, MTP_SPECS, SPECS, add_mtp_head, make_hf_model, save_hf_model

hf_logging.set_verbosity_error()
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """name -> (HF model in float32 eval mode, folder it was saved to), one per spec in SPECS."""
    out = {}
    for name, spec in SPECS.items():
        model = make_hf_model(spec)
        out[name] = (model, save_hf_model(model, tmp_path_factory.mktemp(name)))
    return out


@pytest.fixture(params=sorted(SPECS))
def checkpoint(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[object, Path]]) -> tuple[object, Path]:
    return checkpoints[request.param]


@pytest.fixture
def small_checkpoint(checkpoints: dict[str, tuple[object, Path]]) -> tuple[object, Path]:
    return checkpoints["gqa_groups2"]


@pytest.fixture(params=FAMILY_SPECS)
def family_checkpoint(
    request: pytest.FixtureRequest, checkpoints: dict[str, tuple[object, Path]]
) -> tuple[object, Path]:
    """One checkpoint per family (Bamba, Granite dense and MoE, Nemotron-H dense and MoE)."""
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def mtp_checkpoints(
    checkpoints: dict[str, tuple[object, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[object, Path]]:
    """The Nemotron-H checkpoints with an MTP head added, trained on the model's own greedy continuations
    (model_helpers.add_mtp_head): name -> (the HF model of the checkpoint, which leaves the head unread,
    the folder)."""
    out = {}
    for name in MTP_SPECS:
        hf, path = checkpoints[name]
        out[name] = (hf, add_mtp_head(path, tmp_path_factory.mktemp(name + "_mtp") / "model", train_steps=150))
    return out


@pytest.fixture(scope="module")
def scheduler_address() -> Iterator[str]:
    """A Scheduler service on a free port, for the module's workers."""
    server, port, _ = create_server("127.0.0.1", 0)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)
