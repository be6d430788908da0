"""What needs root on a node, run as its login: as it is when the login is root, else through
``sudo -n`` (never a prompt: nobody types a password for a nightly run), checked before anything
is done.

A login that is not root cannot stop or disable a system unit itself: systemd asks polkit, which
over SSH has no agent to ask and fails ("Interactive authentication required"). Whether sudoers
lets the login run exactly a command without a password is read, without running it, from the
entries ``sudo -n -ll`` lists; sudoers names commands by their absolute path, so the tools are
looked up first.
"""

from __future__ import annotations

import fnmatch
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
    lets it run each without a password); else which cannot, and why. One round trip: the
    login's sudoers entries as ``sudo -n -ll`` lists them, judged here. (``sudo -n -l
    COMMAND`` is no such check: it lists a command sudoers permits with a password too, and
    with one NOPASSWD entry the listing itself needs none.)"""
    if access.is_root or not commands:
        return None
    listing = runner.run(["sudo", "-n", "-ll"], check=False, timeout=30)
    if not listing.ok:
        words = (listing.stderr or listing.stdout).strip().splitlines()
        if listing.exit_code == 127:
            reason = "sudo is not installed there"
        else:
            reason = one_line(words[-1]) if words else "sudo -n -ll failed"
        return Refusal(tuple(tuple(c) for c in commands), reason)
    policy = SudoPolicy.parse(listing.stdout)
    verdicts = {tuple(c): policy.verdict(access.command(c)) for c in commands}
    refused = tuple(c for c, verdict in verdicts.items() if verdict is not None)
    if not refused:
        return None
    return Refusal(refused, str(verdicts[refused[0]]))


@dataclass(frozen=True)
class SudoEntry:
    """One entry of ``sudo -ll``: who it runs as, whether it asks a password, its commands."""

    runas: tuple[str, ...]
    authenticate: bool | None  # None: as the Defaults say
    commands: tuple[str, ...]


@dataclass(frozen=True)
class SudoPolicy:
    """The login's sudoers as ``sudo -n -ll`` lists them (its Defaults, then each entry)."""

    authenticate: bool  # the Defaults' (sudo's own default: a password is asked)
    entries: tuple[SudoEntry, ...]

    @classmethod
    def parse(cls, text: str) -> SudoPolicy:
        """Its sections: "Matching Defaults entries ..." (options, comma-separated, wrapped),
        then per "Sudoers entry:" its fields (``    Key: value``) and, under ``Commands:``,
        one command per tab-indented line."""
        defaults: list[str] = []
        blocks: list[dict[str, list[str]]] = []
        section, key = "", ""
        for line in text.splitlines():
            if line.startswith("Matching Defaults entries"):
                section = "defaults"
            elif line.startswith("Sudoers entry"):
                section, key = "entry", ""
                blocks.append({})
            elif not line.strip() or not line[0].isspace():  # a blank, or "User ... may run"
                section = "" if section == "defaults" else section
            elif section == "defaults":
                defaults += [d.strip() for d in line.split(",") if d.strip()]
            elif section == "entry" and line.startswith("\t"):
                blocks[-1].setdefault(key, []).append(line.strip())
            elif section == "entry":
                key, _, value = line.strip().partition(":")
                blocks[-1].setdefault(key, []).extend([value.strip()] if value.strip() else [])
        return cls("!authenticate" not in defaults, tuple(_entry(b) for b in blocks))

    def verdict(self, argv: Sequence[str]) -> str | None:
        """None when sudo runs ``argv`` as root without a password; else why not. The last
        entry that matches decides, as in sudoers."""
        why: str | None = "sudoers lists no entry for it"
        for entry in self.entries:
            if not {"ALL", "root"} & set(entry.runas):
                continue
            for pattern in entry.commands:
                negated = pattern.startswith("!")
                if not _command_matches(pattern.removeprefix("!").strip(), argv):
                    continue
                if negated:
                    why = "sudoers forbids it (a ! entry)"
                elif entry.authenticate if entry.authenticate is not None else self.authenticate:
                    why = "sudoers allows it only with a password (no NOPASSWD)"
                else:
                    why = None
        return why


def _entry(fields: dict[str, list[str]]) -> SudoEntry:
    def listed(key: str, default: str = "") -> list[str]:
        joined = ",".join(fields.get(key, [default]))
        return [item.strip() for item in joined.split(",") if item.strip()]

    options = listed("Options")
    authenticate: bool | None = None  # the Defaults decide
    if "!authenticate" in options:
        authenticate = False
    elif "authenticate" in options:
        authenticate = True
    return SudoEntry(tuple(listed("RunAsUsers", "root")), authenticate,
                     tuple(fields.get("Commands", [])))  # fmt: skip


def _command_matches(pattern: str, argv: Sequence[str]) -> bool:
    """Does a sudoers command (as ``sudo -ll`` prints it) match ``argv``: ALL; a path alone
    (any arguments); a path with ``""`` (none); else path and arguments, with wildcards."""
    if pattern == "ALL":
        return True
    path, _, args = pattern.partition(" ")
    if not _path_matches(path, argv[0]):
        return False
    args = args.strip()
    given = " ".join(argv[1:])
    if not args:
        return True
    if args == '""':
        return not given
    return fnmatch.fnmatchcase(given, re.sub(r"\\(.)", r"\1", args))


def _path_matches(pattern: str, path: str) -> bool:
    """A sudoers path: its wildcards never match a ``/``."""
    wanted, found = pattern.split("/"), path.split("/")
    return len(wanted) == len(found) and all(
        fnmatch.fnmatchcase(f, w) for w, f in zip(wanted, found, strict=True)
    )


def sudoers_line(access: RootAccess, commands: Sequence[Sequence[str]]) -> str:
    """The sudoers line that lets the login run exactly ``commands`` as root, no password."""
    allowed = ", ".join(" ".join(map(_sudoers_word, access.command(c))) for c in commands)
    return f"{access.user} ALL=(root) NOPASSWD: {allowed}"


def _sudoers_word(word: str) -> str:
    # sudoers gives , : = \ and spaces a meaning inside a command list: escape them.
    return re.sub(r"([,:=\\ ])", r"\\\1", word)
