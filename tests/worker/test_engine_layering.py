"""The engine stays behind its edges: importing it loads no gRPC or protobuf (wire conversion is
gpu_worker/api/convert.py's), and the prefix cache never imports the engine (it has its own protocol)."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = ("gpu_worker.engine.engine", "gpu_worker.engine.admission", "gpu_worker.engine.records")


def loaded_after(imports: tuple[str, ...]) -> list[str]:
    code = f"import sys; import {', '.join(imports)}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_engine_imports_no_grpc_or_protobuf():
    bad = [m for m in loaded_after(ENGINE_MODULES) if m.split(".")[0] == "grpc" or m.startswith("google.protobuf")]
    assert not bad, f"the engine imported: {bad[:5]}"


def test_the_prefix_cache_does_not_import_the_engine():
    bad = [m for m in loaded_after(("gpu_worker.cache.manager",)) if m.startswith("gpu_worker.engine")]
    assert not bad, f"the prefix cache imported: {bad}"
