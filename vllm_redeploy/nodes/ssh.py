"""The SSH transport (paramiko), with host keys verified against known_hosts.

One connection per node, opened lazily on the first command and reused; if it turns out to
be dead when a command starts, it is reopened once. A connection that drops while a command
runs is reported (``ConnectionLost``), not retried here: only the caller knows whether the
command is safe to run twice.

Every command, stream and Docker API connection is a channel of that one connection, and
OpenSSH's sshd refuses more than ``MaxSessions`` (10 by default) at once: at most
``MAX_CHANNELS`` are open at a time, the others wait for one to close, and a channel the node
refuses all the same (a lower MaxSessions) is asked for again, never taken for a dead link.

Closing a channel stops nothing on the node: sshd signals no command that runs without a pty (it
only closes the command's pipes, and ``sleep`` or a hung tool never notices). So each command
starts under a few lines of ``sh`` that first tell, on stderr, the process group sshd made for
the session and its leader's start time (that line is taken out of the command's stderr), then
exec it; a command that timed out, was killed, or still runs when the runner closes is stopped by
signalling that group over a channel of its own: TERM, then KILL after ``STOP_GRACE_S``. Through
``sudo -n`` too: sudo keeps the login's real uid, so the login may signal it, and it hands TERM on
to what it runs as root. A group number whose leader now started at another time went to a
newcomer once ours ended (process IDs wrap around, at 32768 by default): it is left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex

import paramiko

from vllm_redeploy.nodes.errors import (
    AuthenticationFailed,
    ConnectionLost,
    HostKeyRejected,
    NodeUnreachable,
)
from vllm_redeploy.nodes.local import LocalRunner
from vllm_redeploy.nodes.result import Stream
from vllm_redeploy.nodes.runner import DEFAULT_TIMEOUT_S, OutputCapture, Process, Runner
from vllm_redeploy.safe_text import one_line

EXIT_NO_STATUS = (
    -1
)  # paramiko's value when the remote side sent no exit status (killed by a signal)
READ_CHUNK = 65536
EOF_GRACE_S = 2.0  # after the exit status, how long to wait for EOF (the rest of the output)
POLL_S = 0.5  # backstop for select(); data and channel close wake us at once
# Below OpenSSH's default MaxSessions (10), leaving room for a person's own session.
MAX_CHANNELS = 8
REFUSED_RETRY_S = 0.1  # how soon a channel the node refused is asked for again
# $0 is the runner's mark, "$@" the command. sshd makes each session the leader of its own
# session and process group: only such a group (group = session) is ever named, with its
# leader's start time (/proc/PID/stat field 22, in clock ticks since boot) to tell it from a
# later process that got the same number.
LEAD = (
    'lead() { read -r line </proc/$$/stat || return; set -- ${line##*) }; [ "$3" = "$4" ] '
    '|| return; g=$3; read -r line </proc/"$g"/stat || return; set -- ${line##*) }; '
    'printf "%s %s:%s\\n" "$mark" "$g" "${20}" >&3; }; mark=$0; lead 3>&2 2>/dev/null; exec "$@"'
)
STOP_GRACE_S = 2.0  # after TERM, how long a command may take to end before KILL
# TERM to each group ("$@"), KILL to those with a live process after the grace; a zombie is not
# live (kill -0 counts it, and an orphan waits for a reaper that may be slow).
# Each argument is GROUP:START. A group whose leader is alive with another start time is not
# ours; one whose leader is gone keeps its number while any member lives (the kernel reuses no
# number still naming a group), so its members are ours. TERM to ours, KILL to those with a
# live process after the grace; a zombie is not live (kill -0 counts it, and an orphan waits
# for a reaper that may be slow).
STOP = f"""live() {{
  for stat in /proc/[0-9]*/stat; do
    read -r line <"$stat" || continue
    set -- ${{line##*) }}
    [ "$3" = "$want" ] && [ "$1" != Z ] && return 0
  done 2>/dev/null
  return 1
}}
ours=
for pair; do
  g=${{pair%%:*}}
  if {{ read -r line </proc/"$g"/stat; }} 2>/dev/null; then
    set -- ${{line##*) }}
    [ "${{20}}" = "${{pair#*:}}" ] || continue
  fi
  ours="$ours $g"
done
for g in $ours; do kill -TERM "-$g"; done 2>/dev/null
n=0
for g in $ours; do
  want=$g
  while live; do
    [ "$n" -ge {int(STOP_GRACE_S * 10)} ] && {{ kill -KILL "-$g"; break; }} 2>/dev/null
    sleep 0.1
    n=$((n + 1))
  done
done
"""
STOP_TIMEOUT_S = STOP_GRACE_S + 10.0
_GROUP_TOKEN = re.compile(rb"[0-9]+:[0-9]+")
MARK_LINE_MAX = 4096  # stderr bytes held back while looking for the group's line


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to reach one node over SSH."""

    host: str
    port: int = 22
    user: str | None = None
    key_file: Path | None = None
    key_passphrase: str | None = field(default=None, repr=False)  # a secret: never printed
    known_hosts: Path = Path("~/.ssh/known_hosts")
    trust_on_first_use: bool = False
    connect_timeout_s: float = 10.0
    # Keepalive every 5 s; paramiko closes the transport when the peer stops answering,
    # so a vanished node shows as a dead connection instead of a hang.
    keepalive_s: int = 5

    @property
    def known_hosts_entry(self) -> str:
        """How OpenSSH names this host in known_hosts."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


class _RejectUnknownHost(paramiko.MissingHostKeyPolicy):
    """Refuse an unknown host key, saying how to check and trust it."""

    def __init__(self, node: str, target: SSHTarget) -> None:
        self._node = node
        self._target = target

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        known_hosts = self._target.known_hosts.expanduser()
        port_flag = f"-p {self._target.port} " if self._target.port != 22 else ""
        raise HostKeyRejected(
            self._node,
            f"its SSH host key ({key.get_name()} {key.fingerprint}) is not in {known_hosts}",
            f"Check the fingerprint on the node (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), "
            f"then add it with `ssh-keyscan {port_flag}{self._target.host} >> {known_hosts}`, "
            f"or set ssh.trust_on_first_use = true to record it on the first connection",
        )


class _RecordOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Trust-on-first-use: append an unknown host key to known_hosts. A changed key is still
    refused, because paramiko raises BadHostKeyException before consulting any policy."""

    def __init__(self, known_hosts: Path) -> None:
        self._known_hosts = known_hosts

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        self._known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self._known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RefuseRevoked(paramiko.MissingHostKeyPolicy):
    """A key known_hosts marks ``@revoked`` is refused, even on first use; others go on to
    ``then``. (Revoked keys are never loaded as known, so they always come here.)"""

    def __init__(
        self, node: str, known_hosts: Path, revoked: set[str], then: paramiko.MissingHostKeyPolicy
    ) -> None:
        self._node, self._known_hosts, self._revoked, self._then = node, known_hosts, revoked, then

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if key.get_base64() in self._revoked:
            raise HostKeyRejected(
                self._node,
                f"its SSH host key ({key.get_name()} {key.fingerprint}) is marked @revoked in "
                f"{self._known_hosts}",
                "Someone may be intercepting the connection, or the node still offers a key "
                "that was withdrawn: give it a new host key, and trust that one",
            )
        self._then.missing_host_key(client, hostname, key)


def _load_known_hosts(client: paramiko.SSHClient, path: Path, node: str) -> set[str]:
    """Load ``path`` as OpenSSH reads it, into ``client``; the keys it marks ``@revoked``.
    paramiko's own loader knows no markers: an ``@cert-authority`` or ``@revoked`` line made
    it raise InvalidHostKey. Host certificates are not checked here (paramiko has none), so a
    ``@cert-authority`` line is skipped: such a node needs its own key listed."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        raise HostKeyRejected(node, f"cannot read {path}: {exc.strerror}", "") from None
    entries: list[tuple[str, paramiko.hostkeys.HostKeyEntry]] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        marker = ""
        if line.startswith("@"):
            marker, _, line = line.partition(" ")
            line = line.strip()
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError) as exc:
            raise HostKeyRejected(
                node,
                f"line {number} of {path} cannot be read ({one_line(exc) or type(exc).__name__})",
                "Fix or remove that line (`ssh-keygen -F HOST -f FILE` shows which host a line "
                "is for)",
            ) from None
        if entry is not None and entry.key is not None:  # else a key type paramiko lacks
            entries.append((marker, entry))
    revoked = {e.key.get_base64() for marker, e in entries if marker == "@revoked"}
    known = client.get_host_keys()
    for marker, entry in entries:
        if not marker and entry.key.get_base64() not in revoked:
            for name in entry.hostnames:
                known.add(name, entry.key.get_name(), entry.key)
    return revoked


class ChannelLease:
    """An open channel holding one of its connection's ``MAX_CHANNELS`` places until closed."""

    def __init__(self, channel: paramiko.Channel, places: threading.Semaphore | None) -> None:
        self.channel = channel
        self._places: threading.Semaphore | None = places
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the channel and give its place back (once; a dead connection's is a no-op)."""
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            self.channel.close()
        self.release()

    def release(self) -> None:
        with self._lock:
            places, self._places = self._places, None
        if places is not None:
            places.release()


class SSHRunner(Runner):
    """Runs argv on a node over one reused SSH connection."""

    def __init__(
        self,
        node: str,
        target: SSHTarget,
        secrets: tuple[str, ...] = (),
        default_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        passphrase = (target.key_passphrase,) if target.key_passphrase else ()
        super().__init__(node, secrets + passphrase, default_timeout)
        self.target = target
        self._client: paramiko.SSHClient | None = None
        self._places = threading.Semaphore(MAX_CHANNELS)  # the connection's open channels
        self._lock = threading.Lock()
        self._openssh_tried = False
        self._openssh_argv: tuple[str, ...] | None = None
        self._mark = f"@@vrd-group-{token_hex(6)}"  # no command's output can forge it
        self._running: set[_GroupLine] = set()  # the commands on channels now, by their group
        self._running_lock = threading.Lock()
        self._stop_place = threading.Semaphore(1)  # one channel beyond MAX_CHANNELS, to stop

    def __repr__(self) -> str:
        user = f"{self.target.user}@" if self.target.user else ""
        port = f":{self.target.port}" if self.target.port != 22 else ""
        return f"<SSHRunner {self.node} {user}{self.target.host}{port}>"

    @property
    def is_connected(self) -> bool:
        transport = self._client.get_transport() if self._client else None
        return bool(transport and transport.is_active())

    def _still_connected(self, settle_s: float = 0.2) -> bool:
        """Is the connection alive after a command ended without an exit status? When the link
        drops, paramiko closes the channels a moment before it marks the transport inactive:
        wait that moment, so a cut is not mistaken for a command killed by a signal."""
        deadline = time.monotonic() + settle_s
        while self.is_connected and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.is_connected

    def client(self) -> paramiko.SSHClient:
        """The live paramiko client, connecting (or reconnecting) if needed."""
        with self._lock:
            if self._client is None or not self.is_connected:
                self._drop()
                self._client = self._connect()
                # A new connection: the old one's channels died with it, places and all.
                self._places = threading.Semaphore(MAX_CHANNELS)
            return self._client

    def close(self) -> None:
        """Stop the commands still running on the node's channels, then drop the connection."""
        with self._running_lock:
            groups = [g.group for g in self._running if g.group is not None]
        self._stop_groups(groups)
        self._disconnect()

    def _disconnect(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _connect(self) -> paramiko.SSHClient:
        t = self.target
        known_hosts = t.known_hosts.expanduser()
        client = paramiko.SSHClient()
        revoked = (
            _load_known_hosts(client, known_hosts, self.node) if known_hosts.exists() else set()
        )
        policy: paramiko.MissingHostKeyPolicy = (
            _RecordOnFirstUse(known_hosts)
            if t.trust_on_first_use
            else _RejectUnknownHost(self.node, t)
        )
        client.set_missing_host_key_policy(_RefuseRevoked(self.node, known_hosts, revoked, policy))
        try:
            client.connect(
                hostname=t.host,
                port=t.port,
                username=t.user,
                key_filename=str(t.key_file.expanduser()) if t.key_file else None,
                passphrase=t.key_passphrase,
                allow_agent=True,
                look_for_keys=t.key_file is None,
                timeout=t.connect_timeout_s,
                banner_timeout=t.connect_timeout_s,
                auth_timeout=t.connect_timeout_s,
                channel_timeout=t.connect_timeout_s,
            )
        except NodeUnreachable:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyRejected(
                self.node,
                f"its SSH host key CHANGED: known_hosts ({known_hosts}) expects "
                f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the node offered "
                f"{exc.key.get_name()} {exc.key.fingerprint}",
                "If the node was reinstalled, check the new fingerprint on its console, then "
                f"`ssh-keygen -R '{t.known_hosts_entry}' -f {known_hosts}` and trust the new key; "
                "otherwise someone may be intercepting the connection",
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            key = f"key {t.key_file}" if t.key_file else "the agent's and default keys"
            raise AuthenticationFailed(
                self.node,
                f"SSH authentication as {t.user or 'the current user'} failed with {key} ({exc})",
                "Check nodes[].ssh_user and nodes[].ssh_key_file, and that the public key is in "
                "the node's ~/.ssh/authorized_keys",
            ) from None
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            client.close()
            raise NodeUnreachable(
                self.node,
                f"connection refused at {t.host}:{t.port} ({_first_reason(exc)})",
                "Is the node up and sshd running on that port?",
            ) from None
        except TimeoutError:
            client.close()
            raise NodeUnreachable(
                self.node,
                f"no answer from {t.host}:{t.port} within {t.connect_timeout_s:g} s",
                "Is the node powered on and the address right?",
            ) from None
        except socket.gaierror as exc:
            client.close()
            raise NodeUnreachable(
                self.node, f"cannot resolve {t.host!r} ({exc.strerror})"
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            hint = ""
            if "banner" in str(exc).lower():
                hint = (
                    "Something answers on that port but does not speak SSH: check the node's "
                    "ssh_port, and that no proxy or other service sits in front of sshd"
                )
            raise NodeUnreachable(
                self.node, f"SSH to {t.host}:{t.port} failed: {exc}", hint
            ) from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(t.keepalive_s)
        return client

    def open_channel(self) -> ChannelLease:
        """A new session channel, once one of the connection's places is free; reconnecting
        once if the cached connection has died. A channel the node refuses on a live
        connection (its sshd's MaxSessions is lower than ours) is asked for again until one
        closes. (paramiko keeps one failure per connection, which concurrent opens may take from
        each other: a live connection is what tells a refusal from a dead link.)"""
        refused_until: float | None = None
        attempt = 1
        while True:
            client = self.client()
            places = self._places
            places.acquire()
            transport = client.get_transport()
            try:
                assert transport is not None
                channel = transport.open_session(timeout=self.target.connect_timeout_s)
                return ChannelLease(channel, places)
            except (paramiko.SSHException, EOFError, OSError, AssertionError) as exc:
                places.release()
                if transport is None or not transport.is_active():
                    self._disconnect()
                    if attempt == 2:
                        raise NodeUnreachable(
                            self.node, f"cannot open an SSH session: {exc}"
                        ) from None
                    attempt += 1
                    continue
                now = time.monotonic()
                refused_until = refused_until or now + self.target.connect_timeout_s * 3
                if now >= refused_until:
                    raise NodeUnreachable(
                        self.node,
                        "its sshd keeps refusing a new session on the connection "
                        f"({exc or type(exc).__name__})",
                        f"Its MaxSessions is below {MAX_CHANNELS + 2}: raise it in the node's "
                        "sshd_config (OpenSSH's default is 10)",
                    ) from None
                time.sleep(REFUSED_RETRY_S)

    def _start(self, argv: tuple[str, ...], *, env: dict[str, str], stall_s: float) -> Process:
        """A stream of bulk data (an image, a model): through this machine's OpenSSH client when
        it can log in with no prompt (C crypto: two to three times paramiko's rate here), else on
        a channel of our own connection."""
        client = self._openssh()
        if client is not None:
            line = _command_line(argv, env)
            return LocalRunner(self.node)._start((*client, line), env={}, stall_s=stall_s)
        lease = self.open_channel()
        stderr = bytearray()
        group = self._group_line(lambda _stream, data: stderr.extend(data))
        try:
            lease.channel.exec_command(self._led(argv, env))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            lease.close()
            self._forget(group)
            self._disconnect()
            raise ConnectionLost(self.node, f"the SSH connection dropped: {exc}", "") from None
        lease.channel.settimeout(stall_s)
        return _ChannelProcess(self, lease, group, stderr)

    def _openssh(self) -> tuple[str, ...] | None:
        """``ssh`` with this runner's host, port, user, key and known_hosts (host keys checked,
        never added), once it was seen to log in with no prompt; else None."""
        with self._lock:
            if not self._openssh_tried:
                self._openssh_tried = True
                t = self.target
                argv = openssh_argv(
                    t.host,
                    t.port,
                    user=t.user,
                    key_file=str(t.key_file.expanduser()) if t.key_file else None,
                    known_hosts=str(t.known_hosts.expanduser()),
                    connect_timeout_s=t.connect_timeout_s,
                    keepalive_s=t.keepalive_s,
                )
                probe = LocalRunner(self.node).run([*argv, "true"], check=False, timeout=30)
                self._openssh_argv = tuple(argv) if probe.ok else None
            return self._openssh_argv

    def _execute(
        self,
        argv: tuple[str, ...],
        *,
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout
        lease = self.open_channel()
        group = self._group_line(capture.feed)
        try:
            status = self._exchange(lease.channel, self._led(argv, env), stdin, deadline, group)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._disconnect()
            raise ConnectionLost(self.node, f"the SSH connection dropped: {exc}", "") from None
        finally:
            lease.close()
            self._forget(group)
        if status is None:  # closing its channel stopped nothing: stop its process group
            self._stop_groups([group.group] if group.group is not None else [])
            return None, True
        return status, False

    def _exchange(
        self,
        channel: paramiko.Channel,
        line: str,
        stdin: bytes | None,
        deadline: float,
        feed: Callable[[Stream, bytes], None],
    ) -> int | None:
        """Run ``line`` on ``channel``, its output to ``feed``: the exit status, or None when
        ``deadline`` passed first."""
        channel.exec_command(line)
        if stdin is not None:
            channel.sendall(stdin)
        channel.shutdown_write()
        exited_at: float | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            select.select([channel], [], [], min(remaining, POLL_S))
            while channel.recv_ready():
                feed("stdout", channel.recv(READ_CHUNK))
            while channel.recv_stderr_ready():
                feed("stderr", channel.recv_stderr(READ_CHUNK))
            if channel.exit_status_ready() and not (
                channel.recv_ready() or channel.recv_stderr_ready()
            ):
                # sshd may send the exit status before the last of the output: read on until
                # EOF (or a short grace, for a background child that keeps the pipe open).
                exited_at = exited_at or time.monotonic()
                if channel.eof_received or time.monotonic() - exited_at > EOF_GRACE_S:
                    break
        status = channel.recv_exit_status()
        if status == EXIT_NO_STATUS and not self._still_connected():
            raise ConnectionLost(self.node, "the SSH connection dropped while the command ran", "")
        return status

    def _led(self, argv: tuple[str, ...], env: dict[str, str]) -> str:
        """The command line that runs argv under LEAD, which names its process group first."""
        return _command_line(("sh", "-c", LEAD, self._mark, *_env_prefix(env), *argv), {})

    def _group_line(self, feed: Callable[[Stream, bytes], None]) -> _GroupLine:
        """A filter for one command's output that finds its group's line; counted as running
        (``close`` stops it) until ``_forget``."""
        group = _GroupLine(self._mark, feed)
        with self._running_lock:
            self._running.add(group)
        return group

    def _forget(self, group: _GroupLine) -> None:
        group.finish()
        with self._running_lock:
            self._running.discard(group)

    def _stop_groups(self, groups: list[str]) -> None:
        """Stop what runs in these process groups on the node (STOP), over a channel outside
        the commands' places (a timed-out command's channel may have been the last free one).
        Best effort: a dead connection has nobody to tell, a node that refuses the channel
        keeps the command."""
        client = self._client
        transport = client.get_transport() if client is not None else None
        if not groups or transport is None or not transport.is_active():
            return
        with self._stop_place:
            try:
                lease = ChannelLease(
                    transport.open_session(timeout=self.target.connect_timeout_s), None
                )
            except (paramiko.SSHException, EOFError, OSError):
                return
            try:
                line = _command_line(("sh", "-c", STOP, "sh", *groups), {})
                self._exchange(
                    lease.channel, line, None, time.monotonic() + STOP_TIMEOUT_S, _ignore
                )
            except (ConnectionLost, paramiko.SSHException, EOFError, OSError):
                pass
            finally:
                lease.close()


class _GroupLine:
    """Takes the line LEAD writes on stderr before the command starts (its process group on the
    node) out of the command's stderr; lines a login script wrote before it pass through."""

    def __init__(self, mark: str, feed: Callable[[Stream, bytes], None]) -> None:
        self._prefix = f"{mark} ".encode()
        self._feed = feed
        self._held = b""
        self._looking = True
        self.group: str | None = None  # GROUP:START, as STOP takes it

    def __call__(self, stream: Stream, data: bytes) -> None:
        if stream == "stdout" or not self._looking:
            self._feed(stream, data)
            return
        self._held += data
        while self._looking and b"\n" in self._held:
            line, _, self._held = self._held.partition(b"\n")
            number = line.removeprefix(self._prefix)
            if number != line and _GROUP_TOKEN.fullmatch(number):
                self.group, self._looking = number.decode(), False
            else:
                self._feed("stderr", line + b"\n")
        if len(self._held) > MARK_LINE_MAX:
            self._looking = False
        if not self._looking:
            self.finish()

    def finish(self) -> None:
        """Hand on what is held (the command ended, or no group's line came)."""
        held, self._held = self._held, b""
        if held:
            self._feed("stderr", held)


def _ignore(_stream: Stream, _data: bytes) -> None:
    """The stop's own output: nobody reads it."""


class _ChannelProcess(Process):
    """A command on one SSH channel of the node's connection, its stdin and stdout streamed."""

    def __init__(
        self, runner: SSHRunner, lease: ChannelLease, group: _GroupLine, stderr: bytearray
    ) -> None:
        self._runner = runner
        self._lease = lease
        self._channel = lease.channel
        self._group = group  # it writes the command's stderr, less its group's line, to stderr
        self._stderr = stderr

    def read(self, size: int) -> bytes:
        try:
            return self._channel.recv(size)
        except TimeoutError:
            raise
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None

    def write(self, data: bytes) -> None:
        try:
            self._channel.sendall(data)
        except TimeoutError:
            raise
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> ConnectionLost:
        why = str(exc) or type(exc).__name__
        return ConnectionLost(self._runner.node, f"the SSH connection dropped ({why})", "")

    def close_stdin(self) -> None:
        self._channel.shutdown_write()

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while not self._channel.exit_status_ready():
            self._drain_stderr()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        self._drain_stderr()
        status = self._channel.recv_exit_status()
        self._lease.release()  # it ended: the channel no longer counts against MaxSessions
        self._runner._forget(self._group)
        if status == EXIT_NO_STATUS and not self._runner._still_connected():
            raise ConnectionLost(self._runner.node, "the SSH connection dropped while it ran", "")
        return status

    def stderr_text(self) -> str:
        self._drain_stderr()
        if self._channel.exit_status_ready():
            self._group.finish()
        return self._stderr.decode("utf-8", "replace")

    def _drain_stderr(self) -> None:
        while self._channel.recv_stderr_ready():
            self._group("stderr", self._channel.recv_stderr(READ_CHUNK))

    def kill(self) -> None:
        # Closing the channel stops nothing (sshd signals no command without a pty): the
        # command's process group is stopped over another channel, unless it ended already.
        self._drain_stderr()  # its group's line, if it has not been read yet
        ended = self._channel.exit_status_ready()
        self._lease.close()
        self._runner._forget(self._group)
        group = self._group.group
        if not ended and group is not None:
            self._runner._stop_groups([group])


def _first_reason(exc: paramiko.ssh_exception.NoValidConnectionsError) -> str:
    for error in exc.errors.values():
        return error.strerror or str(error)
    return str(exc)


def openssh_argv(
    host: str,
    port: int,
    *,
    user: str | None,
    key_file: str | None,
    known_hosts: str | None,
    connect_timeout_s: float,
    keepalive_s: int,
) -> list[str]:
    """OpenSSH's client by our rules, up to the host (the remote command follows): never a
    prompt, host keys checked and never added, a dead peer noticed within 3 keepalives.
    ``key_file`` and ``known_hosts`` are paths where the client runs (None: its defaults)."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
    argv += ["-o", f"ConnectTimeout={int(connect_timeout_s)}", "-p", str(port)]
    argv += ["-o", f"ServerAliveInterval={keepalive_s}", "-o", "ServerAliveCountMax=3"]
    if known_hosts:
        argv += ["-o", f"UserKnownHostsFile={known_hosts}"]
    if key_file:
        argv += ["-i", key_file, "-o", "IdentitiesOnly=yes"]
    if user:
        argv += ["-l", user]
    return [*argv, "--", host]


def _command_line(argv: tuple[str, ...], env: dict[str, str]) -> str:
    """sshd drops protocol env unless AcceptEnv allows it, so env is inlined with `env`. The
    whole line is quoted by shlex.join: the remote login shell sees one word per arg."""
    return shlex.join([*_env_prefix(env), *argv])


def _env_prefix(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
