"""The worker pool: a name that resolves to several addresses is several workers, re-resolved."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.pool import WorkerPool, split_host_port


def test_a_name_stands_for_every_address_it_resolves_to(monkeypatch):
    answers = {"workers.svc": ["10.0.0.1", "10.0.0.2"]}

    async def getaddrinfo(host, port, **_kwargs):
        if host not in answers:
            raise socket.gaierror("unknown name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    async def scenario() -> list[list[str]]:
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
        pool = WorkerPool(["workers.svc:50052", "127.0.0.1:7000"])
        seen = []
        await pool._resolve()
        seen.append(sorted(pool.workers))
        answers["workers.svc"] = ["10.0.0.2", "10.0.0.3"]  # one replaced (a pod rescheduled)
        await pool._resolve()
        seen.append(sorted(pool.workers))
        del answers["workers.svc"]  # DNS hiccup: keep the last answer
        await pool._resolve()
        seen.append(sorted(pool.workers))
        await pool.close()
        return seen

    first, replaced, kept = asyncio.run(scenario())
    assert first == ["10.0.0.1:50052", "10.0.0.2:50052", "127.0.0.1:7000"]
    assert replaced == ["10.0.0.2:50052", "10.0.0.3:50052", "127.0.0.1:7000"]
    assert kept == replaced


def test_addresses_must_be_host_and_port():
    assert split_host_port("[::1]:50052") == ("::1", 50052)
    for bad in ("localhost", ":50052", "host:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_host_port(bad)
