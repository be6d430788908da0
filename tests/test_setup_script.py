"""scripts/setup.sh on machines shaped like real controllers: it finds tools by what they do,
never installs Debian's docker.io beside an existing engine, and says what it installs first.

Each test runs the real script with a PATH of its own: the host's tools it needs, linked, plus
stand-ins for apt-get (records what it was asked to install) and, where the case needs one, for a
Docker engine from Docker's own packages (dockerd/docker on PATH, no docker.io package)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
# What the script itself calls, besides what it probes for.
HOST_TOOLS = ("env", "basename", "dirname", "grep", "id", "ldd", "python3", "printf", "cat")
PROBED = ("busybox", "ps", "pkill", "ip", "ss", "ssh-keygen", "systemd-analyze", "fc-list",
          "chromium", "chromium-browser", "postgres", "faketime")  # fmt: skip

RECORDER = """#!/bin/sh
echo "$(basename "$0") $*" >> {log}
{body}
"""


def _path_dir(tmp_path: Path, standins: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in (*HOST_TOOLS, *PROBED):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    for tool, body in {"apt-get": "exit 0", **standins}.items():
        script = bin_dir / tool
        script.write_text(RECORDER.format(log=tmp_path / "calls.log", body=body))
        script.chmod(0o755)
    return bin_dir


def _setup(tmp_path: Path, *args: str, **standins: str) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir = _path_dir(tmp_path, {k.replace("_", "-"): v for k, v in standins.items()})
    done = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(SCRIPT), *args],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls


# What docker-ce's binaries answer (Docker's own packages, not Debian's).
DOCKERD_CE = 'echo "Docker version 27.3.1, build 41ca978"'
DOCKER_CE = 'echo "Docker version 27.3.1, build ce12230"'


# dpkg-query -W for the packages asked about: one of them installed, the rest unknown (as dpkg
# answers for a package it has never seen: on stderr, exit 1).
DPKG_QUERY = """for p in "$@"; do case "$p" in -*) ;; {installed}) echo "{installed} installed" ;;
  *) echo "dpkg-query: no packages found matching $p" >&2 ;; esac; done"""
NO_PACKAGES = DPKG_QUERY.format(installed="none-of-them")


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("apt-get") and " install " in f" {c} "]


def test_an_existing_docker_engine_is_left_alone(tmp_path: Path) -> None:
    done, calls = _setup(tmp_path, "--system-only", dockerd=DOCKERD_CE, docker=DOCKER_CE)

    assert done.returncode == 0, done.stderr
    assert "left as it is" in done.stdout
    assert not any("docker.io" in c for c in calls), calls
    # Docker was asked what it is and nothing else: not started, stopped or reconfigured.
    asked = {c for c in calls if c.startswith(("dockerd", "docker "))}
    assert "dockerd --version" in asked
    assert asked <= {"dockerd --version", "docker --version", "docker compose version"}, asked


def test_a_machine_without_docker_gets_docker_io_and_is_told_first(tmp_path: Path) -> None:
    done, calls = _setup(tmp_path, "--system-only")

    assert done.returncode == 0, done.stderr
    plan_at = done.stdout.index("would install")
    assert "docker.io" in done.stdout[plan_at:]
    installs = _installs(calls)
    assert len(installs) == 1 and "docker.io" in installs[0].split(), calls
    # Said before it was done: the plan names every package handed to apt-get.
    for package in installs[0].split()[installs[0].split().index("--no-install-recommends") + 1 :]:
        assert package in done.stdout[plan_at:]


def test_a_lone_static_docker_client_gets_the_engine_beside_it(tmp_path: Path) -> None:
    """This machine image's shape: a static docker CLI in /usr/local/bin that no package owns,
    no dockerd, no Docker package: Debian's engine installs beside the client."""
    done, calls = _setup(tmp_path, "--system-only", docker=DOCKER_CE, dpkg_query=NO_PACKAGES)

    assert done.returncode == 0, done.stderr
    installs = _installs(calls)
    assert len(installs) == 1 and "docker.io" in installs[0].split(), calls


@pytest.mark.parametrize("package", ["docker-ce-cli", "containerd.io", "moby-engine"])
def test_docker_packages_of_another_source_without_an_engine_stop_with_the_fix(
    tmp_path: Path, package: str
) -> None:
    dpkg_query = DPKG_QUERY.format(installed=package)
    done, calls = _setup(tmp_path, "--system-only", docker=DOCKER_CE, dpkg_query=dpkg_query)

    assert done.returncode == 1
    assert f"({package})" in done.stderr and "docker-ce" in done.stderr, done.stderr
    assert _installs(calls) == [] and "Traceback" not in done.stderr


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    done, calls = _setup(tmp_path, "--dry-run")

    assert done.returncode == 0, done.stderr
    assert "docker.io" in done.stdout
    assert not any(c.startswith("apt-get") for c in calls)
    assert not (tmp_path / ".venv").exists()


@pytest.mark.parametrize("arg", ["--yes", "install"])
def test_an_unknown_option_is_named(tmp_path: Path, arg: str) -> None:
    done, calls = _setup(tmp_path, arg)

    assert done.returncode == 2 and f"'{arg}'" in done.stderr
    assert calls == []
