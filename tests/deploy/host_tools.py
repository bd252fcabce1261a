"""What the deployment tests need from the host: root, apt, Debian's docker.io, docker-compose and
debootstrap, and the Debian mirror apt is configured with. Nothing here starts a daemon."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

DOCKER_PACKAGES = ("docker.io", "docker-compose")
BASE_IMAGE_PACKAGES = ("debootstrap",)
APT_SOURCES = Path("/etc/apt")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
# Where downloaded or built inputs (base rootfs tarball, wheelhouse) are kept between runs.
CACHE_DIR = Path(os.environ.get("HYBRIDSERVE_DOCKER_TEST_CACHE", Path.home() / ".cache/hybridserve/docker-test"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def cannot_run_docker() -> str | None:
    """Why Docker cannot run on this machine, or None when it can (root, with apt to install it)."""
    if os.geteuid() != 0:
        return "dockerd and apt-get need root; this test runs as a normal user"
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine to install Debian's docker.io and docker-compose"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip outside CI; in CI (CI=true) the deployment must be tested, so a missing tool fails."""
    if in_ci():
        pytest.fail(f"deployment test cannot run in CI: {reason}")
    pytest.skip(reason)


def run(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None, check: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs a command, capturing its output; on failure the assertion message carries the output."""
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
            f"stderr:\n{result.stderr[-4000:]}"
        )
    return result


def is_installed(package: str) -> bool:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return result.returncode == 0 and result.stdout.strip().endswith(" installed")


def apt_install(packages: tuple[str, ...]) -> None:
    """Installs the Debian packages that are missing (apt-get update first, as apt requires)."""
    reason = cannot_run_docker()
    if reason is not None:
        skip_or_fail(reason)
    missing = [p for p in packages if not is_installed(p)]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], timeout_s=300, env=env)
    with services_kept_stopped():
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], timeout_s=600, env=env)


@contextmanager
def services_kept_stopped() -> Iterator[None]:
    """Debian's policy-rc.d hook (exit 101: action forbidden) while packages install, so that
    docker.io's install never starts the system dockerd, which would make a docker0 bridge."""
    if POLICY_RC_D.exists():  # the machine already has a policy; leave it alone
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# written by hybridserve's deployment tests while apt installs\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def debian_mirror(suite: str = "bookworm") -> str:
    """The URI of the Debian archive apt uses for `suite` (deb822 .sources or one-line lists), so
    the base image comes from the same mirror as every other package on this machine."""
    for path in sorted(APT_SOURCES.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, flags=re.MULTILINE))
            if "deb" in fields.get("Types", "").split() and suite in fields.get("Suites", "").split():
                uri = _debian_uri(fields.get("URIs", "").split())
                if uri:
                    return uri
    lists = [APT_SOURCES / "sources.list", *sorted(APT_SOURCES.glob("sources.list.d/*.list"))]
    for path in (p for p in lists if p.is_file()):
        for line in path.read_text().splitlines():
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line.strip())
            if match and match.group(2) == suite and _debian_uri([match.group(1)]):
                return match.group(1)
    raise AssertionError(f"no Debian {suite} archive found in the apt sources under {APT_SOURCES}")


def _debian_uri(uris: list[str]) -> str | None:
    """The first URI that serves the main archive (not -security or another vendor's repository)."""
    return next((u for u in uris if u.rstrip("/").endswith("/debian")), None)
