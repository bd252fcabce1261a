"""Regenerates the committed protobuf/gRPC modules under hybridserve/v1 from protos/.

    python -m hybridserve.protogen            # rewrite hybridserve/v1/*_pb2*.py{,i}
    python -m hybridserve.protogen --check    # exit 1 when the committed files are stale

The generated code is committed so that installing needs no code generator; the pinned
grpcio-tools in the `test` extra makes the output reproducible, and a test runs --check.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
OUT_PACKAGE = "hybridserve/v1"


def generate(out_root: Path) -> list[Path]:
    """Runs protoc over every .proto under protos/ into out_root; returns the generated files."""
    from grpc_tools import protoc  # test/dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_root / OUT_PACKAGE).iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args(argv)
    committed = REPO_ROOT / OUT_PACKAGE
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (committed / p.name).exists() or not filecmp.cmp(p, committed / p.name, shallow=False)
        ]
        if args.check:
            if stale:
                print(f"stale generated code: {', '.join(stale)}; run python -m hybridserve.protogen")
                return 1
            print("generated code is up to date")
            return 0
        for p in fresh:
            shutil.copyfile(p, committed / p.name)
        print(f"wrote {len(fresh)} files to {committed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
