"""Flags and HYBRIDSERVE_<SERVICE>_<FIELD> variables derived from the settings dataclasses."""

from __future__ import annotations

import argparse
import enum
import os
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from hybridserve.settings import Flag, add_settings_arguments, env_name, settings_from_args
from hybridserve_cli import build_parser


class Mode(enum.IntEnum):
    NONE = 0
    ALIGN = 1


@dataclass(frozen=True, slots=True)
class Example:
    port: int = 50051
    ratio: float = 0.5
    name: str = "a"
    folder: Path | None = None
    enabled: bool = True
    mode: Mode = Mode.ALIGN
    addresses: tuple[str, ...] = ("h:1",)
    budget_bytes: int = 4 << 20


FLAGS = {"budget_bytes": Flag("budget, MiB", name="--budget-mb", scale=1 << 20)}


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Example:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, Example, "DEMO", flags=FLAGS, environ=environ or {})
    return settings_from_args(Example, parser.parse_args(argv))


def test_defaults_come_from_the_dataclass():
    assert parse([]) == Example()


def test_flags_parse_each_type():
    got = parse(["--port", "7", "--ratio", "0.25", "--name", "b", "--folder", "/x", "--no-enabled",
                 "--mode", "none", "--addresses", "h:1, h:2", "--budget-mb", "3"])  # fmt: skip
    assert got == Example(7, 0.25, "b", Path("/x"), False, Mode.NONE, ("h:1", "h:2"), 3 << 20)


def test_variables_use_the_field_name_and_unit_and_lose_to_flags():
    environ = {"HYBRIDSERVE_DEMO_PORT": "9", "HYBRIDSERVE_DEMO_ENABLED": "off", "HYBRIDSERVE_DEMO_MODE": "NONE",
               "HYBRIDSERVE_DEMO_BUDGET_BYTES": "1024", "HYBRIDSERVE_DEMO_NAME": ""}  # fmt: skip
    got = parse([], environ)
    assert (got.port, got.enabled, got.mode, got.budget_bytes, got.name) == (9, False, Mode.NONE, 1024, "a")
    assert parse(["--port", "10"], environ).port == 10


@pytest.mark.parametrize(("variable", "value"), [("PORT", "seven"), ("ENABLED", "maybe"), ("MODE", "fast")])
def test_a_bad_variable_names_itself(variable, value):
    with pytest.raises(SystemExit, match=f"HYBRIDSERVE_DEMO_{variable}"):
        parse([], {f"HYBRIDSERVE_DEMO_{variable}": value})


def test_services_sharing_one_environment_do_not_collide(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_WORKER_PORT", "6001")
    monkeypatch.setenv("HYBRIDSERVE_WORKER_BLOCK_SIZE", "512")
    monkeypatch.setenv("HYBRIDSERVE_CACHE_PORT", "6003")
    monkeypatch.setenv("HYBRIDSERVE_UP_WORKER_PORT", "6004")
    ports = {c: build_parser(only=c).parse_args([c]).port for c in ("scheduler", "worker", "cache")}
    assert ports == {"scheduler": 50051, "worker": 6001, "cache": 6003}
    assert build_parser(only="worker").parse_args(["worker"]).block_size == 512
    assert build_parser(only="up").parse_args(["up"]).worker_port == 6004


def test_worker_flag_defaults_are_the_dataclass_defaults(monkeypatch):
    from gpu_worker.api.server import settings_from_args as worker_settings
    from gpu_worker.engine.settings import EngineSettings
    from gpu_worker.runner.settings import RunnerConfig
    from scheduler_svc.core import SchedulerConfig

    for name in [n for n in os.environ if n.startswith("HYBRIDSERVE_")]:
        monkeypatch.delenv(name)
    settings = worker_settings(build_parser(only="worker").parse_args(["worker"]))
    names = [f.name for f in fields(SchedulerConfig) if f.name != "stop_at_last_boundary"]
    defaults = SchedulerConfig()
    assert [getattr(settings.scheduler, n) for n in names] == [getattr(defaults, n) for n in names]
    runner = RunnerConfig()
    assert (settings.runner.memory_budget_bytes, settings.runner.num_checkpoint_slots, settings.runner.max_num_seqs) \
        == (runner.memory_budget_bytes, runner.num_checkpoint_slots, runner.max_num_seqs)  # fmt: skip
    assert settings.max_queue_len == next(f.default for f in fields(EngineSettings) if f.name == "max_queue_len")


def test_env_name_scheme():
    assert env_name("worker", "block_size") == "HYBRIDSERVE_WORKER_BLOCK_SIZE"
    assert env_name("CACHE", "redis_url") == "HYBRIDSERVE_CACHE_REDIS_URL"
