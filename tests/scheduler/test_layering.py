"""The planning core stays pure: importing it loads no edge library."""

from __future__ import annotations

import subprocess
import sys

EDGE = ("grpc", "google.protobuf", "torch", "redis", "opentelemetry")


def test_core_imports_no_edge_library():
    code = (
        "import sys, scheduler_svc.core, scheduler_svc.core.planner;"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {[e.split('.')[0] for e in EDGE]!r}"
        " and not m.startswith('google.') or m.startswith('google.protobuf')];"
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"the core imported: {result.stdout or result.stderr}"
