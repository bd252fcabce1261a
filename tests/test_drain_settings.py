"""`--drain-timeout-s` of the scheduler and the cache service: a flag and a variable, 30 s by default,
reaching the settings the servers drain with; a negative value is refused with its name."""

from __future__ import annotations

import pytest

from cache_svc.server import CacheServerSettings
from hybridserve.errors import InvalidArgumentError
from hybridserve.settings import settings_from_args
from hybridserve_cli import build_parser
from scheduler_svc.server import SchedulerServerSettings

CASES = [("scheduler", SchedulerServerSettings, "SCHEDULER"), ("cache", CacheServerSettings, "CACHE")]


@pytest.mark.parametrize(("command", "cls", "service"), CASES)
def test_drain_timeout_flag_variable_and_default(command, cls, service, monkeypatch):
    def parsed(*argv: str) -> float:
        args = build_parser(only=command).parse_args([command, *argv])
        return settings_from_args(cls, args).drain_timeout_s

    monkeypatch.delenv(f"HYBRIDSERVE_{service}_DRAIN_TIMEOUT_S", raising=False)
    assert parsed() == 30.0
    assert parsed("--drain-timeout-s", "2.5") == 2.5
    monkeypatch.setenv(f"HYBRIDSERVE_{service}_DRAIN_TIMEOUT_S", "7")
    assert parsed() == 7.0
    assert parsed("--drain-timeout-s", "1") == 1.0  # the flag wins


@pytest.mark.parametrize(("command", "cls", "service"), CASES)
def test_a_negative_or_nan_drain_timeout_is_refused(command, cls, service):
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidArgumentError, match="--drain-timeout-s"):
            cls(drain_timeout_s=bad)
