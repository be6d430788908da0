"""What needs root on a node, run as its login: as it is when the login is root, else through
``sudo -n`` (never a prompt: nobody types a password for a nightly run), checked before anything
is done.

A login that is not root cannot stop or disable a system unit itself: systemd asks polkit, which
over SSH has no agent to ask and fails ("Interactive authentication required"). ``sudo -n -l
COMMAND`` tells, without running it, whether sudoers allows exactly that command without a
password; sudoers names commands by their absolute path, so the tools are looked up first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_redeploy.nodes.runner import Runner
from vllm_redeploy.safe_text import one_line

# The node's tools the redeploy may run as root (stop-autostart's units).
ROOT_TOOLS = ("systemctl",)
SUDO = ("sudo", "-n")
SUDOERS_FILE = "/etc/sudoers.d/vllm-redeploy"


@dataclass(frozen=True)
class RootAccess:
    """Who the node's login is, and how it runs a command as root."""

    user: str
    is_root: bool
    paths: Mapping[str, str] = field(default_factory=dict)  # tool -> its path on the node

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run as root: itself for root, else through ``sudo -n`` by its full path."""
        if self.is_root:
            return list(argv)
        return [*SUDO, self.paths.get(argv[0], argv[0]), *argv[1:]]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with its tool's full path: what sudo and sudoers see."""
        return [self.paths.get(argv[0], argv[0]), *argv[1:]]


def probe_root(runner: Runner, tools: Sequence[str] = ROOT_TOOLS) -> RootAccess:
    """The login's name and uid, and where ``tools`` are on the node: one round trip."""
    found = runner.run_all(
        [["id", "-un"], ["id", "-u"]]
        + [["sh", "-c", 'command -v -- "$1"', "sh", tool] for tool in tools],
        timeout=30,
    )
    user, uid = found[0].stdout.strip(), found[1].stdout.strip()
    paths = {t: r.stdout.strip() for t, r in zip(tools, found[2:], strict=True) if r.ok}
    return RootAccess(user or "?", uid == "0", paths)


@dataclass(frozen=True)
class Refusal:
    """The commands ``sudo -n`` would not run as root for the login, and sudo's words."""

    commands: tuple[tuple[str, ...], ...]
    reason: str


def refused_as_root(
    runner: Runner, access: RootAccess, commands: Sequence[Sequence[str]]
) -> Refusal | None:
    """None when every command of ``commands`` can run as root (the login is root, or sudoers
    allows each without a password); else which cannot: one round trip, two on a refusal."""
    if access.is_root or not commands:
        return None
    checks = runner.run_all(
        [["sudo", "-n", "-l", *access.command(c)] for c in commands], timeout=30
    )
    refused = tuple(tuple(c) for c, r in zip(commands, checks, strict=True) if not r.ok)
    if not refused:
        return None
    again = runner.run(["sudo", "-n", "-l", *access.command(refused[0])], check=False, timeout=30)
    words = (again.stderr or again.stdout).strip().splitlines()
    if again.exit_code == 127:
        reason = "sudo is not installed there"
    elif words:
        reason = one_line(words[-1])
    else:
        reason = "sudoers does not allow it without a password"
    return Refusal(refused, reason)


def sudoers_line(access: RootAccess, commands: Sequence[Sequence[str]]) -> str:
    """The sudoers line that lets the login run exactly ``commands`` as root, no password."""
    allowed = ", ".join(" ".join(map(_sudoers_word, access.command(c))) for c in commands)
    return f"{access.user} ALL=(root) NOPASSWD: {allowed}"


def _sudoers_word(word: str) -> str:
    # sudoers gives , : = \ and spaces a meaning inside a command list: escape them.
    return re.sub(r"([,:=\\ ])", r"\\\1", word)
