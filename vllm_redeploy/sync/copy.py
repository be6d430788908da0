"""The copies: an image (``docker save`` on the source, ``docker load`` on the target) and model
files (a tar stream, received beside the model and renamed into place), streamed either straight
between the nodes over the fabric (``ssh`` on the source) or relayed through this machine.

Nothing is deleted on a target: files only it holds stay, a replaced image keeps its layers
(untagged), and ``docker load`` tags only what it received whole.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.nodes import CommandTimedOut, NodeAccess, RemoteError
from vllm_redeploy.nodes.runner import Process
from vllm_redeploy.nodes.ssh import openssh_argv
from vllm_redeploy.safe_text import one_line
from vllm_redeploy.sync.manifest import BLOBS, STAGE, FileEntry
from vllm_redeploy.sync.plan import SyncNeed, human_bytes

Progress = Callable[[int], None]  # bytes moved so far
CHUNK = 1 << 20
DIRECT_CHECK_S = 10.0
ENDED_WAIT_S = 5.0  # for a receiver that stopped taking bytes to end and say why
# Received files go under STAGE; each is renamed into the model directory once the stream
# ended whole. Names come on stdin, each ended by a NUL (a name may hold any other byte).
# tar ends at the archive's end marker, whatever follows it: twice in full runs the receiving
# tar ended (exit 0, nothing said) while the relay still had the stream's last bytes to write,
# and a whole copy failed with a broken pipe. What follows the marker is read to the end.
RECEIVE = 'mkdir -p -- "$2" && tar -C "$2" -xf - && exec cat >/dev/null'
PROMOTE = """cd -- "$2" || exit 1
xargs -0 -r sh -c 'for f; do
  mkdir -p -- "$(dirname -- "$0/$f")" && mv -f -- "$f" "$0/$f" || exit 255
done' "$1" || exit 1
cd / && find "$2" -depth -type d -empty -delete 2>/dev/null
exit 0
"""
# A snapshot's links into the blob store, as `hf download` makes them: (path, target) pairs on
# stdin, NUL-ended; what is at the path (a plain copy of the file, an older link) is replaced.
LINK = """cd -- "$1" || exit 1
xargs -0 -r -n 2 sh -c 'mkdir -p -- "$(dirname -- "$0")" && ln -sfn -- "$1" "$0" || exit 255'
"""
# $1: the stage; the rest: files under it to remove (never anything outside it).
REMOVE_PARTIAL = 'cd -- "$1" || exit 0; shift; rm -f -- "$@"'
# --dereference: a snapshot's files are links into its blobs; the targets get the contents
# (the links were checked to stay inside the model's tree before anything was sent).
SEND = ["tar", "--dereference", "--null", "--verbatim-files-from", "-T", "-", "-cf", "-"]
COPY_TIMEOUT_S = 7 * 24 * 3600.0  # a stalled copy is caught by ssh's keepalive, not by this
MOVED = "@@moved"
MOVED_LINE = re.compile(rf"^{MOVED} (\d+)$")


class SyncFailed(RemoteError):
    """A copy to a node did not complete; the message says why and what is left as it was."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (SyncFailed, (self.node, self.message))


@dataclass(frozen=True)
class Route:
    """How the bytes travel from the source to one target."""

    direct: bool
    why: str

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True)
class Copied:
    target: str
    what: str  # "image" or "model"
    bytes: int
    seconds: float
    route: str
    already: int = 0  # the model's bytes found on the target by content: not sent

    @property
    def rate(self) -> str:
        return f"{human_bytes(self.bytes / max(self.seconds, 1e-3))}/s"


def route_between(source: NodeAccess, target: NodeAccess, config: ClusterConfig) -> Route:
    """Straight over the fabric when the source's own ssh reaches the target's fabric IP with no
    prompt (keys and host key already trusted there); else through this machine."""
    if config.sync.direct == "off":
        return Route(False, "relayed through this machine (sync.direct = off)")
    node = target.config
    try:
        found = source.runner.run(
            [*_ssh_to(config, target), "true"], check=False, timeout=DIRECT_CHECK_S
        )
    except CommandTimedOut:
        return Route(
            False,
            f"relayed through this machine ({source.name} got no SSH answer "
            f"from {node.ip} within {DIRECT_CHECK_S:g} s)",
        )
    if found.ok:
        return Route(True, f"direct from {source.name} over the fabric ({node.ip})")
    words = one_line(_last_line(found.stderr))
    return Route(
        False,
        f"relayed through this machine ({source.name} cannot SSH to {node.ip} without a prompt"
        f"{': ' + words if words else ''})",
    )


def _ssh_to(config: ClusterConfig, target: NodeAccess) -> list[str]:
    """The source's ssh to the target's fabric IP as the target's login user, with the key and
    known_hosts ``[sync]`` names on the source (its user's own by default)."""
    node = target.config
    return openssh_argv(
        node.ip,
        node.ssh_port,
        user=node.ssh_user or config.ssh.user,
        key_file=config.sync.ssh_key_file,
        known_hosts=config.sync.known_hosts,
        connect_timeout_s=config.ssh.connect_timeout_s,
        keepalive_s=config.ssh.keepalive_s,
    )


def disk_room(target: NodeAccess, path: str) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing parent);
    None when `df` cannot tell (then the copy itself finds out)."""
    script = 'p=$1; while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done; df -P -B1 -- "$p"'
    found = target.runner.run(["sh", "-c", script, "sh", path], check=False)
    lines = found.stdout.strip().splitlines()
    fields = lines[-1].split() if found.ok and len(lines) > 1 else []
    return int(fields[3]) if len(fields) > 3 and fields[3].isdigit() else None


def _docker_env(access: NodeAccess) -> dict[str, str]:
    """The `docker` CLI on a node reaches the engine the configuration names (local nodes)."""
    host = access.config.docker_host if access.config.transport == "local" else None
    return {"DOCKER_HOST": host} if host else {}


def copy_image(
    source: NodeAccess,
    target: NodeAccess,
    config: ClusterConfig,
    image_id: str,
    route: Route,
    on_bytes: Progress,
) -> Copied:
    """The source's image, with its tag, onto the target; what it is there (its content ID,
    comparable across image stores) equals ``image_id``."""
    ref = config.vllm.image
    started = time.monotonic()
    if route.direct:
        send = 'docker save "$1"'
        script = _pipeline(send, config, target, "docker load")
        argv = ["bash", "-c", script, "bash", ref]
        moved = _direct(source, target, argv, None, on_bytes, _docker_env(source))
        moved = max(moved, source.docker.image_size(ref))  # the last count is a sample
    else:
        moved = _relay(
            source.runner.start(
                ["docker", "save", ref], stall_s=config.sync.stall_s, env=_docker_env(source)
            ),
            target.runner.start(
                ["docker", "load"], stall_s=config.sync.stall_s, env=_docker_env(target)
            ),
            source.name,
            target.name,
            on_bytes,
        )
    found = target.docker.image_id(ref)
    if found != image_id:
        raise SyncFailed(
            target.name,
            f"after the copy, {target.name}'s {ref} is {found or 'absent'}, not the source's "
            f"{image_id[:19]} (the tag moved on the source meanwhile?): run again",
        )
    return Copied(target.name, "image", moved, time.monotonic() - started, route.why)


def copy_model(
    source: NodeAccess,
    target: NodeAccess,
    config: ClusterConfig,
    need: SyncNeed,
    route: Route,
    on_bytes: Progress,
) -> Copied:
    """The files ``need`` names from the source's model directory into the target's, received
    under STAGE and renamed into place once whole (those an earlier, cut copy received whole are
    only renamed); then, in the Hugging Face layout, the snapshot's links into the blobs, and
    last the rest (``refs/main`` among them: the revision is named once its files are there)."""
    model = config.vllm.source.tree
    stage = f"{model.rstrip('/')}/{STAGE}"
    files = need.files
    names = b"".join(f.path.encode() + b"\0" for f in files)
    started = time.monotonic()
    moved = 0
    if files and route.direct:
        receive = shlex.join(["sh", "-c", RECEIVE, "sh", model, stage])
        script = _pipeline(
            f'cd -- "$1" && {shlex.join(SEND)}', config, target, shlex.quote(receive)
        )
        moved = _direct(source, target, ["bash", "-c", script, "bash", model], names, on_bytes)
        moved = max(moved, sum(f.size for f in files))  # the last count is a sample
    elif files:
        sender = source.runner.start(
            ["sh", "-c", f'cd -- "$1" && exec {shlex.join(SEND)}', "sh", model],
            stall_s=config.sync.stall_s,
        )
        sender.write(names)
        sender.close_stdin()
        moved = _relay(
            sender,
            target.runner.start(
                ["sh", "-c", RECEIVE, "sh", model, stage], stall_s=config.sync.stall_s
            ),
            source.name,
            target.name,
            on_bytes,
        )
    received = [*need.staged, *(f.path for f in files)]
    blobs = [path for path in received if path.startswith(f"{BLOBS}/")]
    _finish(target, PROMOTE, [model, stage], blobs, f"move them from {stage} into {model}")
    pairs = [part for link in need.links for part in link]
    _finish(target, LINK, [model], pairs, f"link the snapshot's files to the blobs in {model}")
    rest = [path for path in received if not path.startswith(f"{BLOBS}/")]
    _finish(target, PROMOTE, [model, stage], rest, f"move them from {stage} into {model}")
    return Copied(target.name, "model", moved, time.monotonic() - started, route.why, need.already)


def _finish(target: NodeAccess, script: str, args: list[str], items: list[str], what: str) -> None:
    """Run a placing ``script`` (PROMOTE, LINK) on the target with ``items`` on its stdin."""
    if not items:
        return
    done = target.runner.run(
        ["sh", "-c", script, "sh", *args],
        stdin=b"".join(item.encode() + b"\0" for item in items),
        check=False,
    )
    if not done.ok:
        raise SyncFailed(
            target.name,
            f"{target.name} received the model's files but could not {what}: "
            f"{one_line(done.stderr or done.stdout or f'exit code {done.exit_code}')}",
        )


def _pipeline(send: str, config: ClusterConfig, target: NodeAccess, receive: str) -> str:
    """The source's bash script: ``send`` | ssh to the target's fabric IP running ``receive``
    (one quoted word), with the bytes ssh has read so far printed on stderr four times a second
    (its /proc/PID/io: counting them in the stream would copy every byte once more)."""
    ssh = shlex.join(_ssh_to(config, target))
    return f"""set -o pipefail
exec 3<&0
{{ {send}; }} <&3 | {ssh} {receive} &
job=$!
while kill -0 "$job" 2>/dev/null; do
  sed -n 's/^rchar: /{MOVED} /p' "/proc/$job/io" >&2 2>/dev/null
  sleep 0.25
done
wait "$job"
"""


def _direct(
    source: NodeAccess,
    target: NodeAccess,
    argv: list[str],
    stdin: bytes | None,
    on_bytes: Progress,
    env: dict[str, str] | None = None,
) -> int:
    """Run the source's pipeline, which reports the bytes as they go."""
    moved = 0
    words: list[str] = []

    def line(text: str, stream: str) -> None:
        nonlocal moved
        if (counted := MOVED_LINE.match(text)) is not None:
            moved = int(counted.group(1))
            on_bytes(moved)
        elif text.strip():
            words.append(text.strip())

    found = source.runner.run(
        argv, check=False, stdin=stdin, env=env, on_line=line, timeout=COPY_TIMEOUT_S
    )
    if not found.ok:
        why = one_line("; ".join(words[-3:]) or f"exit code {found.exit_code}")
        raise SyncFailed(
            target.name,
            f"the copy from {source.name} to {target.name} over the fabric broke off after "
            f"{human_bytes(moved)}: {why}",
        )
    return moved


def _relay(
    sender: Process,
    receiver: Process,
    source: str,
    target: str,
    on_bytes: Progress,
) -> int:
    """Pump the sender's stdout into the receiver's stdin through this machine (inside the
    kernel when both are local ssh processes)."""
    moved = 0
    try:
        while True:
            count = sender.move_into(receiver, CHUNK)
            if count is None:
                chunk = sender.read(CHUNK)
                receiver.write(chunk)
                count = len(chunk)
            if not count:
                break
            moved += count
            on_bytes(moved)
        receiver.close_stdin()
        sent, received = sender.wait(60), receiver.wait(3600)
    except (TimeoutError, RemoteError, OSError) as exc:
        if isinstance(exc, TimeoutError):
            why = "no byte moved for a while (a cut link or a hung side)"
        elif isinstance(exc, RemoteError):
            why = one_line(exc)
        else:  # the receiver's end of the pipe closed: it ended, and says why
            why = _ended(receiver, exc)
        sender.kill()
        receiver.kill()
        raise SyncFailed(
            target,
            f"the copy from {source} to {target} broke off after {human_bytes(moved)}: {why}",
        ) from None
    if sent != 0 or received != 0:
        side, text = (
            (source, sender.stderr_text()) if sent != 0 else (target, receiver.stderr_text())
        )
        sender.kill()
        receiver.kill()
        raise SyncFailed(
            target,
            f"the copy from {source} to {target} broke off after {human_bytes(moved)}: "
            f"{side} said {one_line(_last_line(text) or 'nothing')}",
        )
    return moved


def _ended(receiver: Process, exc: OSError) -> str:
    """Why the receiver stopped taking bytes: its last line on stderr, else its exit code. It
    is given a moment to end first, since what it said arrives with its end."""
    code = receiver.wait(ENDED_WAIT_S)
    said = _last_line(receiver.stderr_text())
    if said:
        return f"{one_line(said)} ({one_line(exc)})"
    if code is not None:
        return f"it ended with exit code {code} and said nothing ({one_line(exc)})"
    return one_line(exc)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def planned_bytes(source: NodeAccess, need: SyncNeed, image: str | None) -> int:
    """What copying ``need`` streams: the image's size unpacked (``image``: the source's tag,
    None when it has none), and the model files'."""
    size = source.docker.image_size(image) if need.image and image else 0
    return size + need.model_bytes


def check_room(
    source: NodeAccess,
    target: NodeAccess,
    config: ClusterConfig,
    need: SyncNeed,
    image_id: str | None,
) -> None:
    """Refuse before the first byte when the target's disk cannot take the copy."""
    wants = []
    if need.model_bytes:
        wants.append((config.vllm.source.tree, need.model_bytes, "the model's files"))
    if need.image and image_id:
        size = source.docker.image_size(config.vllm.image)
        wants.append((target.docker.root_dir(), size, f"the image {config.vllm.image}"))
    for path, size, what in wants:
        free = disk_room(target, path)
        if free is not None and size > free:
            raise SyncFailed(
                target.name,
                f"{target.name} has {human_bytes(free)} free on the disk of {path}, but {what} "
                f"need {human_bytes(size)}: nothing was copied; free space there, or set "
                '[sync] image or model = "off" and copy by hand',
            )


def remove_partial(target: NodeAccess, config: ClusterConfig, files: tuple[FileEntry, ...]) -> None:
    """Remove files under the model's STAGE that an earlier copy did not receive whole."""
    if not files:
        return
    stage = f"{config.vllm.source.tree.rstrip('/')}/{STAGE}"
    argv = ["sh", "-c", REMOVE_PARTIAL, "sh", stage, *(f.path for f in files)]
    removed = target.runner.run(argv, check=False)
    if not removed.ok:
        raise SyncFailed(
            target.name,
            f"could not remove what a cut copy left under {stage} on {target.name}: "
            f"{one_line(removed.stderr or removed.stdout)}",
        )


def sync_target(
    source: NodeAccess,
    target: NodeAccess,
    config: ClusterConfig,
    need: SyncNeed,
    image_id: str | None,
    route: Route,
    on_bytes: Progress,
) -> list[Copied]:
    """Everything ``need`` names, in order: what a cut copy left half-received goes, then room
    is checked, then the image, then the model's files. ``on_bytes`` counts across both."""
    remove_partial(target, config, need.partial)
    check_room(source, target, config, need, image_id)
    copied: list[Copied] = []
    if need.image and image_id:
        copied.append(copy_image(source, target, config, image_id, route, on_bytes))
    if need.model:
        before = sum(c.bytes for c in copied)
        copied.append(
            copy_model(
                source,
                target,
                config,
                need,
                route,
                lambda moved: on_bytes(before + moved),
            )
        )
    return copied
