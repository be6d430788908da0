"""Whether sudoers lets a login run a command as root without a password, read from what
`sudo -n -ll` lists (issue 50, item 2). The fixtures are real sudo 1.9.13 output (Debian 12),
for a login in the `sudo` group (`%sudo ALL=(ALL:ALL) ALL`, a password) plus one line each:
the sudoers line preflight recommends, `NOPASSWD: ALL`, none, `Defaults !authenticate`, and a
wildcard with a negated command. `sudo -n -l COMMAND` exits 0 for every command of the first
case, which is why it is not the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_redeploy.nodes.privilege import SudoPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "sudo"
SYSTEMCTL = "/usr/bin/systemctl"


def policy(name: str) -> SudoPolicy:
    return SudoPolicy.parse((FIXTURES / f"{name}.txt").read_text())


@pytest.mark.parametrize(
    ("fixture", "argv", "verdict"),
    [
        ("units-line", [SYSTEMCTL, "stop", "glm-server.service"], None),
        ("units-line", [SYSTEMCTL, "disable", "--no-reload", "glm-server.service"], None),
        ("units-line", [SYSTEMCTL, "stop", "a,b:c=d.service"], None),
        (
            "units-line",
            [SYSTEMCTL, "stop", "other-stack.service"],
            "sudoers allows it only with a password (no NOPASSWD)",
        ),
        (
            "units-line",
            [SYSTEMCTL, "disable", "glm-server.service"],
            "sudoers allows it only with a password (no NOPASSWD)",
        ),
        ("nopasswd-all", [SYSTEMCTL, "stop", "anything.service"], None),
        ("defaults-no-authenticate", [SYSTEMCTL, "stop", "anything.service"], None),
        ("negated", [SYSTEMCTL, "stop", "glm-server.service"], None),
        ("negated", [SYSTEMCTL, "stop", "dbus.service"], "sudoers forbids it (a ! entry)"),
        (
            "negated",
            ["/usr/local/bin/systemctl", "stop", "glm-server.service"],
            "sudoers allows it only with a password (no NOPASSWD)",
        ),
    ],
)
def test_the_last_matching_entry_decides(
    fixture: str, argv: list[str], verdict: str | None
) -> None:
    assert policy(fixture).verdict(argv) == verdict


def test_an_empty_listing_allows_nothing() -> None:
    assert SudoPolicy.parse("").verdict([SYSTEMCTL, "stop", "a.service"]) == (
        "sudoers lists no entry for it"
    )
