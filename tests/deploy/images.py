"""The project image, built with no registry and no network inside the build.

- Base: Debian bookworm (minbase) with python3 and python3-venv, made by debootstrap from the
  Debian mirror apt is configured with, packed as a tarball and `docker import`ed.
- Wheelhouse: hybridserve and every dependency as wheels, made by pip on the host with pip's own
  configuration (the CPU torch wheel comes from its find-links), so the Dockerfile installs with
  `pip install --no-index --find-links`.
Both are kept under CACHE_DIR between runs (the dependencies' wheels are rebuilt when
pyproject.toml changes; the project's own wheel every run, so the image has the code under test)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

from tests.deploy.dockerd import Dockerd, unmount_under
from tests.deploy.host_tools import CACHE_DIR, debian_mirror, run

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv")
BASE_TAG = "hybridserve-test-base:bookworm"
# What the build context holds, the same set as the repository's .dockerignore lets through.
CONTEXT_PATHS = ("pyproject.toml", "README.md", ".dockerignore", "hybridserve", "scheduler_svc", "gpu_worker",
                 "cache_svc", "deploy")  # fmt: skip
WHEELHOUSE_IN_CONTEXT = "deploy/wheelhouse"


def base_rootfs_tarball() -> Path:
    """A tarball of a minbase bookworm root with Python, debootstrapped once and then reused."""
    tarball = CACHE_DIR / f"rootfs-{SUITE}-minbase-{'-'.join(BASE_PACKAGES)}.tar"
    if tarball.is_file():
        return tarball
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE_DIR))
    try:
        rootfs = work / "rootfs"
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs),
             debian_mirror(SUITE)], timeout_s=900)  # fmt: skip
        unmount_under(rootfs)  # debootstrap may leave /proc mounted when it fails half-way
        partial = work / "rootfs.tar"
        run(["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./proc/*", "--exclude=./sys/*",
             "--exclude=./dev/*", "--exclude=./var/cache/apt/archives/*.deb", "-cf", str(partial), "."],
            timeout_s=300)  # fmt: skip
        partial.rename(tarball)
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def import_base_image(engine: Dockerd) -> str:
    engine.docker("import", "--change", "ENV LANG=C.UTF-8", str(base_rootfs_tarball()), BASE_TAG, timeout_s=300)
    return BASE_TAG


def dependency_wheels() -> Path:
    """Wheels of every dependency of the project, for the host's Python (the image's is the same
    minor version: bookworm's 3.11), rebuilt when pyproject.toml changes."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as pyproject:
        dependencies = tomllib.load(pyproject)["project"]["dependencies"]
    digest = hashlib.sha256(json.dumps(dependencies).encode()).hexdigest()[:16]
    folder = CACHE_DIR / f"wheels-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    if (folder / ".complete").is_file():
        return folder
    partial = Path(tempfile.mkdtemp(prefix="wheels-", dir=_ensure(CACHE_DIR)))
    try:
        run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(partial), str(REPO_ROOT)], timeout_s=1200)
        for wheel in partial.glob("hybridserve-*.whl"):
            wheel.unlink()  # the project's own wheel is built fresh every run
        (partial / ".complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def build_context(work: Path) -> Path:
    """A build context: the sources the Dockerfile copies plus a wheelhouse in deploy/wheelhouse."""
    context = work / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "wheelhouse", "secrets.env")
    for name in CONTEXT_PATHS:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=ignore)
        else:
            shutil.copy2(source, context / name)
    wheelhouse = context / WHEELHOUSE_IN_CONTEXT
    wheelhouse.mkdir()
    for wheel in dependency_wheels().glob("*.whl"):
        _link_or_copy(wheel, wheelhouse / wheel.name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheelhouse), str(REPO_ROOT)],
        timeout_s=300)  # fmt: skip
    return context


def build_project_image(engine: Dockerd, base_tag: str, tag: str, work: Path) -> None:
    """`docker build --network host` of deploy/Dockerfile on the imported base, from the wheelhouse."""
    context = build_context(work)
    engine.docker(
        "build", "--network", "host", "-f", str(context / "deploy/Dockerfile"), "-t", tag,
        "--build-arg", f"BASE_IMAGE={base_tag}", "--build-arg", f"WHEELHOUSE={WHEELHOUSE_IN_CONTEXT}",
        str(context), timeout_s=1200,
    )  # fmt: skip
    shutil.rmtree(context, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
