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
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.dockerd import Dockerd, unmount_under
from tests.deploy.host_tools import CACHE_DIR, debian_mirror, run

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv")
BASE_TAG = "hybridserve-test-base:bookworm"
# The build context: what the Dockerfile copies (the packages are those pyproject.toml installs).
CONTEXT_FILES = ("pyproject.toml", "README.md", ".dockerignore", "deploy")
WHEELHOUSE_IN_CONTEXT = "deploy/wheelhouse"


def base_rootfs_tarball(work: Path) -> Path:
    """A tarball of a minbase bookworm root with Python, debootstrapped (in `work`) once and then
    reused."""
    tarball = CACHE_DIR / f"rootfs-{SUITE}-minbase-{'-'.join(BASE_PACKAGES)}.tar"
    if tarball.is_file():
        return tarball
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    partial = CACHE_DIR / f".{tarball.name}.partial-{os.getpid()}"
    try:
        rootfs = work / "rootfs"
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs),
             debian_mirror(SUITE)], timeout_s=900)  # fmt: skip
        unmount_under(rootfs)  # debootstrap may leave /proc mounted when it fails half-way
        run(["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./proc/*", "--exclude=./sys/*",
             "--exclude=./dev/*", "--exclude=./var/cache/apt/archives/*.deb", "-cf", str(partial), "."],
            timeout_s=300)  # fmt: skip
        partial.rename(tarball)
    finally:
        partial.unlink(missing_ok=True)
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def import_base_image(engine: Dockerd) -> str:
    tarball = base_rootfs_tarball(engine.scratch("rootfs-"))
    engine.docker("import", "--change", "ENV LANG=C.UTF-8", str(tarball), BASE_TAG, timeout_s=300)
    return BASE_TAG


def dependency_wheels(target_python: str) -> Path:
    """Wheels of every dependency of the project for the image's Python (`target_python`, e.g.
    3.11.2), rebuilt when the project's dependencies change. pip resolves for the host's Python,
    so requirements whose markers hold only for the image's patch release (redis needs
    async-timeout below 3.11.3) are added afterwards."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as pyproject:
        dependencies = tomllib.load(pyproject)["project"]["dependencies"]
    digest = hashlib.sha256(json.dumps(dependencies).encode()).hexdigest()[:16]
    folder = CACHE_DIR / f"wheels-py{target_python}-{digest}"
    if (folder / ".complete").is_file():
        return folder
    partial = Path(tempfile.mkdtemp(prefix="wheels-", dir=_ensure(CACHE_DIR)))
    try:
        _pip_wheel(partial, str(REPO_ROOT))
        for wheel in partial.glob("hybridserve-*.whl"):
            wheel.unlink()  # the project's own wheel is built fresh every run
        while missing := requirements_missing_for(partial, target_python):
            _pip_wheel(partial, *missing)
        (partial / ".complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def requirements_missing_for(wheelhouse: Path, target_python: str) -> list[str]:
    """Requirements of the wheels here that hold on `target_python` and that no wheel here meets
    (extras are left to pip: they do not depend on the patch release)."""
    env = {key: str(value) for key, value in default_environment().items()}
    env.update(python_full_version=target_python, python_version=".".join(target_python.split(".")[:2]))
    present = {canonicalize_name(w.name.split("-")[0]) for w in wheelhouse.glob("*.whl")}
    missing = set()
    for wheel in wheelhouse.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = archive.read(name).decode("utf-8", errors="replace")
        for line in metadata.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            marker = requirement.marker
            if marker is None or "extra" in str(marker) or not marker.evaluate(env):
                continue
            if canonicalize_name(requirement.name) not in present:
                missing.add(f"{requirement.name}{requirement.specifier}")
    return sorted(missing)


def image_python_version(engine: Dockerd, image: str) -> str:
    result = engine.docker("run", "--rm", "--network", "host", image, "python3", "-c",
                           "import platform; print(platform.python_version())", timeout_s=120)  # fmt: skip
    return result.stdout.strip()


def _pip_wheel(folder: Path, *requirements: str) -> None:
    """pip wheel with this machine's pip configuration (its find-links hold the CPU torch wheel)."""
    run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(folder), *requirements], timeout_s=1200)


def build_context(work: Path, target_python: str) -> Path:
    """A build context: the sources the Dockerfile copies plus a wheelhouse in deploy/wheelhouse."""
    context = work / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "wheelhouse", "secrets.env")
    for name in (*CONTEXT_FILES, *package_folders()):
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=ignore)
        else:
            shutil.copy2(source, context / name)
    wheelhouse = context / WHEELHOUSE_IN_CONTEXT
    wheelhouse.mkdir()
    for wheel in dependency_wheels(target_python).glob("*.whl"):
        _link_or_copy(wheel, wheelhouse / wheel.name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheelhouse), str(REPO_ROOT)],
        timeout_s=300)  # fmt: skip
    return context


def build_project_image(engine: Dockerd, base_tag: str, tag: str, work: Path) -> None:
    """`docker build --network host` of deploy/Dockerfile on the imported base, from the wheelhouse."""
    context = build_context(work, image_python_version(engine, base_tag))
    engine.docker(
        "build", "--network", "host", "-f", str(context / "deploy/Dockerfile"), "-t", tag,
        "--build-arg", f"BASE_IMAGE={base_tag}", "--build-arg", f"WHEELHOUSE={WHEELHOUSE_IN_CONTEXT}",
        str(context), timeout_s=1200,
    )  # fmt: skip
    shutil.rmtree(context, ignore_errors=True)


def package_folders() -> list[str]:
    """The top-level package folders pyproject.toml's package search includes (hybridserve, ...)."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as pyproject:
        patterns = tomllib.load(pyproject)["tool"]["setuptools"]["packages"]["find"]["include"]
    names = {pattern.rstrip("*").rstrip(".") for pattern in patterns}
    return sorted(name for name in names if (REPO_ROOT / name / "__init__.py").is_file())


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
