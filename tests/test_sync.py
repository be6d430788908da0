"""The same image and model on every node: copies between the bed's nodes, each with its own
Docker engine and its own disk for the model (a directory of the node mounted in its namespace).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.states import State

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.testbed import hf_cache, image, users
from tests.testbed.bed import TestBed
from tests.testbed.node import EmulatedNode
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.sync import SyncFailed, copy_image, plan_sync, route_between, survey
from vllm_redeploy.sync.copy import Route, sync_target
from vllm_redeploy.sync.manifest import STAGE
from vllm_redeploy.sync.plan import SyncNeed

pytestmark = pytest.mark.integration
CLI = Path(sys.executable).parent / "vllm-redeploy"
SHARD = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def sync_bed(prefect_api: None) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=125)
    try:
        yield bed
    finally:
        bed.down()


def own_model(bed: TestBed, name: str, shards: int = 3) -> tuple[Path, dict[str, Path]]:
    """A model directory at the same path on both nodes, on each node's own disk: node-1 holds
    ``shards`` files of random weights and config.json, node-2 nothing yet. Returns the path
    and, per node, where its directory's parent is seen from here."""
    path = bed.root / f"disk-{name}" / "model"
    own = {n.name: n.own_dir(path.parent) / "model" for n in bed.nodes}
    own["node-1"].mkdir()
    (own["node-1"] / "config.json").write_text('{"architectures": ["Qwen3_5MoeForCausalLM"]}\n')
    for i in range(1, shards + 1):
        shard = own["node-1"] / f"model-{i:05d}-of-{shards:05d}.safetensors"
        shard.write_bytes(os.urandom(SHARD))
    as_login(own["node-1"])
    return path, own


def as_login(*paths: Path) -> None:
    """What a test wrote on a node's disk belongs to its login, as what the user put there does."""
    uid, gid = users.login_ids()
    for top in paths:
        for path in [top, *top.rglob("*")]:
            os.chown(path, uid, gid, follow_symlinks=False)


def config_for(bed: TestBed, name: str, model: Path, image: str = "", **sections: dict) -> Path:
    vllm = {"model": str(model), "env": {"VRD_LOAD_SECONDS": "1"}}
    return bed.write_config(
        bed.root / f"{name}.toml", vllm={**vllm, **({"image": image} if image else {})}, **sections
    )


def fat_image(bed: TestBed, node: str, tag: str, mib: int) -> str:
    """An image of ``mib`` MiB of random bytes on ``node`` (the bed's own images are a few KB:
    their runtime is mounted from this machine)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        blob = os.urandom(mib * 1024 * 1024)
        info = tarfile.TarInfo("weights.bin")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    return bed.node(node).engine.import_rootfs(data.getvalue(), tag, None)


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return names == theirs and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def image_id(bed: TestBed, node: str, ref: str) -> str | None:
    with contextlib.closing(bed.node(node).engine.client()) as client:
        try:
            return client.images.get(ref).id
        except Exception:
            return None


def untag(bed: TestBed, node: str, ref: str) -> None:
    with contextlib.closing(bed.node(node).engine.client()) as client:
        client.images.remove(ref, force=True, noprune=True)  # a running group keeps it


def login_ssh(node: EmulatedNode, bed: TestBed) -> dict[str, str]:
    """The node's login given the bed's key and known hosts in its ~/.ssh, as the user who
    set up the nodes' SSH between them has: [sync]'s ssh_key_file and known_hosts."""
    ssh = f"/home/{users.LOGIN}/.ssh"
    node.write_file(f"{ssh}/id_ed25519", bed.client_key.read_text(), mode=0o600)
    node.write_file(f"{ssh}/known_hosts", bed.known_hosts.read_text(), mode=0o644)
    node.run(["chown", "-R", f"{users.LOGIN}:{users.LOGIN}", ssh])
    return {"ssh_key_file": f"{ssh}/id_ed25519", "known_hosts": f"{ssh}/known_hosts"}


@contextlib.contextmanager
def one_copy(config: ClusterConfig) -> Iterator[tuple[NodeAccess, NodeAccess, SyncNeed, Route]]:
    """The first node as the source, the second as the target, what it needs and the route."""
    with (
        NodeAccess(config.nodes[0], config) as source,
        NodeAccess(config.nodes[1], config) as target,
    ):
        plan = plan_sync(config, [survey(source, config), survey(target, config)])
        (need,) = plan.needs
        yield source, target, need, route_between(source, target, config)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_run_gives_a_node_the_image_and_model_it_lacks_then_serves(sync_bed: TestBed) -> None:
    bed = sync_bed
    model, own = own_model(bed, "run")
    # Names a line-based listing or promote would cut (issue 51): each is copied as it is.
    for odd in ("chat\rtemplate.jinja", "line\nbreak.json", "back\\slash.json"):
        (own["node-1"] / odd).write_text("{}\n")
    as_login(own["node-1"])
    untag(bed, "node-2", bed.vllm_image)
    assert image_id(bed, "node-2", bed.vllm_image) is None
    state: State = redeploy_vllm_cluster(str(config_for(bed, "run", model)), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    keep_for_notes("sync-run-summary", result["summary"])
    assert image_id(bed, "node-2", bed.vllm_image) == image_id(bed, "node-1", bed.vllm_image)
    assert same_files(own["node-1"], own["node-2"])
    assert "## Copied" in result["summary"]
    assert "| node-2 | image |" in result["summary"] and "| node-2 | model |" in result["summary"]
    assert "relayed through this machine" in result["summary"]
    assert result["probe"]["healthy"]
    with get_client(sync_client=True) as client:  # the UI showed the copy as it went
        flow_run = ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=flow_run))
    progress = {a.key: a.data for a in found if a.type == "progress"}
    assert progress["bed-sync-node-2"] == 100.0 and "bed-sync-node-1" not in progress
    # The next run finds nothing to copy.
    again = redeploy_vllm_cluster(str(config_for(bed, "run", model)), return_state=True)
    assert again.is_completed() and "sync" not in again.result()["steps"]


def test_another_build_under_the_tag_is_replaced_and_kept_untagged(sync_bed: TestBed) -> None:
    bed = sync_bed
    ref = bed.vllm_image
    other = bed.node("node-2").engine.import_rootfs(image.busybox_rootfs(), ref, None)
    model, own = own_model(bed, "build", shards=1)
    (own["node-2"]).mkdir()
    for f in own["node-1"].iterdir():  # the model is there already: only the image differs
        target = own["node-2"] / f.name
        target.write_bytes(f.read_bytes())
        os.utime(target, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    path = config_for(bed, "build", model)
    plan = cli("sync", "--dry-run", "-c", str(path))
    assert plan.returncode == 0, plan.stderr
    assert "another build" in plan.stdout and "dry run: nothing was copied" in plan.stdout
    assert image_id(bed, "node-2", ref) == other  # the dry run changed nothing
    done = cli("sync", "--image", "-c", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    keep_for_notes("sync-cli-image", done.stdout)
    assert image_id(bed, "node-2", ref) == image_id(bed, "node-1", ref)
    assert image_id(bed, "node-2", other) == other  # the earlier build is still there
    assert "model:" not in done.stdout  # the model was the same: only the image went


def test_a_cut_copy_fails_keeps_what_the_node_had_and_the_next_one_resumes(
    sync_bed: TestBed,
) -> None:
    bed = sync_bed
    model, own = own_model(bed, "cut")
    own["node-2"].mkdir()
    older = own["node-2"] / "model-00002-of-00003.safetensors"
    older.write_bytes(b"an earlier download")
    (own["node-2"] / "mine.txt").write_text("only node-2 has this\n")
    as_login(own["node-2"])
    config = load_config(config_for(bed, "cut", model), env_file=None)
    node2 = bed.node("node-2")

    def cut(moved: int) -> None:
        if moved > SHARD * 1.5 and node2.spec.sshd_pid:
            node2.stop_sshd()

    try:
        with one_copy(config) as (source, target, need, route):
            assert not route.direct
            with pytest.raises(SyncFailed) as caught:
                sync_target(source, target, config, need, None, route, cut)
    finally:
        if not node2.spec.sshd_pid:
            node2.start_sshd()
    keep_for_notes("sync-cut", str(caught.value))
    assert "broke off after" in str(caught.value)
    assert older.read_bytes() == b"an earlier download"  # not replaced by half a file
    assert (own["node-2"] / "mine.txt").exists()
    with one_copy(config) as (source, target, need, _):
        assert "model-00001-of-00003.safetensors" in need.staged  # received whole before the cut
        assert "model-00001-of-00003.safetensors" not in {f.path for f in need.files}
        copied = sync_target(source, target, config, need, None, route, lambda _: None)
    assert copied[0].bytes < 2.5 * SHARD  # the first shard was not sent again
    assert (own["node-2"] / "mine.txt").read_text() == "only node-2 has this\n"
    (own["node-2"] / "mine.txt").unlink()
    assert same_files(own["node-1"], own["node-2"])  # and nothing of the stage is left


def test_a_target_that_stops_receiving_says_why(sync_bed: TestBed) -> None:
    bed = sync_bed
    model, own = own_model(bed, "refused")
    own["node-2"].mkdir()  # root's: the login cannot make the stage in it
    config = load_config(config_for(bed, "refused", model), env_file=None)
    with one_copy(config) as (source, target, need, route):
        assert not route.direct
        with pytest.raises(SyncFailed) as caught:
            sync_target(source, target, config, need, None, route, lambda _: None)
    # Its own words, which come with its end, not only the broken pipe the relay saw.
    assert "Permission denied" in str(caught.value), caught.value
    assert list(own["node-2"].iterdir()) == []


def test_a_cut_image_copy_leaves_the_tag_as_it_was(sync_bed: TestBed) -> None:
    bed = sync_bed
    ref = "vrd-bed/fat:1"
    fat_image(bed, "node-1", ref, 32)
    before = fat_image(bed, "node-2", ref, 1)  # another build under the tag
    model, _ = own_model(bed, "cut-image", shards=1)
    config = load_config(config_for(bed, "cut-image", model, image=ref), env_file=None)
    node2 = bed.node("node-2")
    source_id = image_id(bed, "node-1", ref)
    assert source_id is not None

    def cut(moved: int) -> None:
        if moved > 4 * 1024 * 1024 and node2.spec.sshd_pid:
            node2.stop_sshd()

    try:
        with (
            NodeAccess(config.nodes[0], config) as source,
            NodeAccess(config.nodes[1], config) as target,
        ):
            route = route_between(source, target, config)
            with pytest.raises(SyncFailed, match="broke off after"):
                copy_image(source, target, config, source_id, route, cut)
    finally:
        if not node2.spec.sshd_pid:
            node2.start_sshd()
    assert image_id(bed, "node-2", ref) == before  # never a half-loaded image under the tag


def test_a_disk_too_small_is_refused_before_the_first_byte(sync_bed: TestBed) -> None:
    bed = sync_bed
    model, _ = own_model(bed, "small")
    bed.node("node-2").own_dir(model.parent, tmpfs_size="1m")
    path = config_for(bed, "small", model)
    done = cli("sync", "--model", "-c", str(path))
    keep_for_notes("sync-disk-full", done.stdout + done.stderr)
    assert done.returncode == 1
    assert "node-2 has 1.0 MB free" in done.stderr and "need 25.2 MB" in done.stderr
    listed = bed.node("node-2").run(["find", str(model.parent), "-mindepth", "1"])
    assert listed.stdout.strip() == ""  # nothing was copied


def test_the_source_copies_straight_to_the_target_when_it_can_ssh_there(sync_bed: TestBed) -> None:
    bed = sync_bed
    model, own = own_model(bed, "direct", shards=2)
    untag(bed, "node-2", bed.vllm_image)
    direct = login_ssh(bed.node("node-1"), bed)
    path = config_for(bed, "direct", model, sync=direct)
    plan = cli("sync", "--dry-run", "-c", str(path))
    keep_for_notes("sync-cli-direct", plan.stdout)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "direct from node-1 over the fabric" in plan.stdout
    done = cli("sync", "--json", "-c", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    said = json.loads(done.stdout)  # stdout holds the JSON alone: no bars, no lines
    assert (said["source"], said["dry_run"], said["problems"], said["error"]) == (
        "node-1", False, [], None,
    )  # fmt: skip
    source, target = said["nodes"]
    assert (source["name"], source["copied"], source["route"]) == ("node-1", [], None)
    assert target["name"] == "node-2" and target["route"].startswith("direct from node-1")
    assert target["image"] is not None  # why: the node lacked it
    files = [f for f in own["node-1"].rglob("*") if f.is_file()]
    assert (target["model_files"], target["model_bytes"]) == (
        len(files), sum(f.stat().st_size for f in files),
    )  # fmt: skip
    copied = {c["what"]: c for c in target["copied"]}
    assert set(copied) == {"image", "model"} and copied["model"]["bytes"] == target["model_bytes"]
    assert image_id(bed, "node-2", bed.vllm_image) == image_id(bed, "node-1", bed.vllm_image)
    assert same_files(own["node-1"], own["node-2"])


def test_the_direct_route_reports_its_bytes_as_they_go(sync_bed: TestBed) -> None:
    """The source's pipeline samples what its ssh has read four times a second, from the
    first moment; the samples reach the progress callback (the UI's meter)."""
    bed = sync_bed
    model, own = own_model(bed, "direct-progress", shards=2)
    config = load_config(
        config_for(bed, "direct-progress", model, sync=login_ssh(bed.node("node-1"), bed)),
        env_file=None,
    )
    samples: list[int] = []
    with one_copy(config) as (source, target, need, route):
        assert route.direct, route
        (copied,) = sync_target(source, target, config, need, None, route, samples.append)
    assert samples, "no progress reached the callback"
    assert samples == sorted(samples) and samples[-1] <= copied.bytes
    assert same_files(own["node-1"], own["node-2"])


def test_what_a_cut_copy_left_half_received_is_removed_and_its_room_counts(
    sync_bed: TestBed,
) -> None:
    """A cut copy's partial shard, and a file of a model version no longer wanted, wait under
    the stage: the next copy removes them first, so the disk has the room they took."""
    bed = sync_bed
    model, _ = own_model(bed, "partial", shards=2)  # 16.8 MB to copy
    node2 = bed.node("node-2")
    node2.own_dir(model.parent, tmpfs_size="22m")  # seen in the node only: written from there
    stage = f"{model}/{STAGE}"
    left = (
        'mkdir -p -- "$1" && cd -- "$1" && head -c 5242880 /dev/urandom > "$2" '
        '&& head -c 6291456 /dev/urandom > "$3" && chown -R "$4" "$1/.."'
    )
    shard, gone = "model-00002-of-00002.safetensors", "model-00003-of-00003.safetensors"
    login = f"{users.LOGIN}:{users.LOGIN}"
    assert node2.run(["sh", "-c", left, "sh", stage, shard, gone, login]).returncode == 0
    done = cli("sync", "--model", "-c", str(config_for(bed, "partial", model)))
    keep_for_notes("sync-partial", done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr  # 11 MiB free before the removal
    assert "2 partial (11.5 MB) removed first" in done.stdout, done.stdout
    listing = ["find", str(model), "-type", "f", "-printf", "%P %s\\n"]
    held = sorted(node2.run(listing).stdout.split("\n"))
    assert held == sorted(bed.node("node-1").run(listing).stdout.split("\n"))  # no stage left


def test_verify_finds_a_file_that_only_looks_the_same(sync_bed: TestBed) -> None:
    bed = sync_bed
    model, own = own_model(bed, "verify", shards=2)
    shutil.copytree(own["node-1"], own["node-2"])  # copy2: same sizes and times
    as_login(own["node-2"])
    shard = own["node-2"] / "model-00002-of-00002.safetensors"
    stat = shard.stat()
    with shard.open("r+b") as f:  # one flipped byte: size and time say nothing
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    path = config_for(bed, "verify", model)
    quick = cli("sync", "--model", "-c", str(path))
    assert quick.returncode == 0 and "nothing to copy" in quick.stdout
    checked = cli("sync", "--model", "--verify", "-c", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "model: 1 file(s), 8.4 MB (1 content differs)" in checked.stdout
    assert same_files(own["node-1"], own["node-2"])


def test_verify_gives_equal_files_the_sources_times_so_the_next_sync_copies_nothing(
    sync_bed: TestBed,
) -> None:
    """Two nodes that each downloaded the same files at different times (issue 51): the
    times differ, so a sync by size and time would copy everything. `--verify` finds them equal
    by content, copies nothing, and gives them the source's times: the next sync agrees."""
    bed = sync_bed
    model, own = own_model(bed, "retime", shards=2)
    own["node-2"].mkdir()
    for f in own["node-1"].iterdir():
        shutil.copyfile(f, own["node-2"] / f.name)  # the same bytes, written now
        os.utime(own["node-2"] / f.name, (1_600_000_000, 1_600_000_000))
    as_login(own["node-2"])
    path = config_for(bed, "retime", model)
    quick = cli("sync", "--model", "--dry-run", "-c", str(path))
    assert "model: 3 file(s)" in quick.stdout, quick.stdout  # by times: all of them
    checked = cli("sync", "--model", "--verify", "-c", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "node-2: 3 file(s) equal by content got the source's times" in checked.stdout
    assert "nothing to copy" in checked.stdout, checked.stdout
    again = cli("sync", "--model", "-c", str(path))
    assert again.returncode == 0 and "nothing to copy" in again.stdout, again.stdout
    assert same_files(own["node-1"], own["node-2"])
    # And the nightly run, which compares by size and time, copies nothing either.
    run: State = redeploy_vllm_cluster(str(path), return_state=True)
    assert run.is_completed(), run.message
    assert "sync" not in run.result()["steps"]


REPO = "Qwen/Qwen3.5-122B-A10B-FP8"


def own_hf_cache(bed: TestBed, name: str) -> tuple[Path, dict[str, Path], Path]:
    """A Hugging Face cache at the same path on both nodes, on each node's own disk: node-1
    holds the model as `hf download` leaves it (its snapshot's files link into blobs), node-2
    nothing. Returns the hub's path, per node where it is seen from here, and node-1's
    snapshot."""
    hub = bed.root / f"disk-{name}" / "hub"
    own = {n.name: n.own_dir(hub.parent) / "hub" for n in bed.nodes}
    files = {
        "config.json": b'{"architectures": ["Qwen3_5MoeForCausalLM"]}\n',
        "model-00001-of-00002.safetensors": os.urandom(SHARD),
        "model-00002-of-00002.safetensors": os.urandom(SHARD),
    }
    snapshot = hf_cache.write_snapshot(own["node-1"], REPO, files)
    as_login(own["node-1"])
    return hub, own, snapshot


def test_a_model_in_the_hf_cache_reaches_a_node_as_hf_download_leaves_it_and_serves_by_repo_id(
    sync_bed: TestBed,
) -> None:
    bed = sync_bed
    hub, own, snapshot = own_hf_cache(bed, "hf")
    path = bed.write_config(
        bed.root / "hf.toml",
        vllm={"model": REPO, "hf_cache": str(hub), "env": {"VRD_LOAD_SECONDS": "1"}},
    )
    state: State = redeploy_vllm_cluster(str(path), return_state=True)
    assert state.is_completed(), state.message
    assert state.result()["probe"]["healthy"]  # both ranks found config.json in the cache
    theirs = own["node-2"] / snapshot.relative_to(own["node-1"])
    assert same_files(snapshot, theirs)
    # As `hf download` leaves it: the snapshot's files are the same links into blobs/.
    assert {p.name: os.readlink(p) for p in theirs.iterdir()} == {
        p.name: os.readlink(p) for p in snapshot.iterdir()
    }
    repo = hf_cache.repo_dir(own["node-2"], REPO)
    assert (repo / "refs" / "main").read_text() == snapshot.name
    # Named by its snapshot instead, the same model is already everywhere.
    pinned = config_for(bed, "hf-pinned", hub / snapshot.relative_to(own["node-1"]))
    quick = cli("sync", "--model", "-c", str(pinned))
    assert quick.returncode == 0 and "nothing to copy" in quick.stdout, quick.stdout


def disk_use(top: Path) -> int:
    """Bytes the files under ``top`` hold, each once (as `du` counts: links take none)."""
    return sum(p.stat().st_size for p in top.rglob("*") if p.is_file() and not p.is_symlink())


def test_two_downloads_at_different_times_copy_only_the_blob_that_differs(
    sync_bed: TestBed,
) -> None:
    """Each node ran `hf download` on its own: the same three weight blobs (node-2's older), and
    node-2 one revision behind, with another config.json (issue 51)."""
    bed = sync_bed
    hub = bed.root / "disk-two" / "hub"
    own = {n.name: n.own_dir(hub.parent) / "hub" for n in bed.nodes}
    weights = {f"model-0000{i}-of-00003.safetensors": os.urandom(SHARD) for i in (1, 2, 3)}
    new = {"config.json": b'{"architectures": ["Qwen3_5MoeForCausalLM"]}\n', **weights}
    ahead = hf_cache.write_snapshot(own["node-1"], REPO, new)
    behind = hf_cache.write_snapshot(own["node-2"], REPO, {"config.json": b"{}\n", **weights})
    for blob in (behind.parent.parent / "blobs").iterdir():
        os.utime(blob, (1_000_000_000, 1_000_000_000))
    as_login(own["node-1"], own["node-2"])
    before = disk_use(own["node-2"])
    path = bed.write_config(
        bed.root / "two.toml",
        vllm={"model": REPO, "hf_cache": str(hub), "env": {"VRD_LOAD_SECONDS": "1"}},
    )
    first: State = redeploy_vllm_cluster(str(path), return_state=True)
    assert first.is_completed(), first.message
    result = first.result()
    keep_for_notes("sync-two-downloads", result["summary"])
    # Only the changed config.json's blob and refs/main travelled (a tar stream of a few KB);
    # the weights were found by their names in blobs/.
    row = next(x for x in result["summary"].splitlines() if x.startswith("| node-2 | model"))
    copied, already = [cell.strip() for cell in row.split("|")][3:5]
    assert copied.endswith((" B", " KB")) and already == "25.2 MB", row
    theirs = own["node-2"] / ahead.relative_to(own["node-1"])
    assert same_files(ahead, theirs)
    assert {p.name: os.readlink(p) for p in theirs.iterdir()} == {
        p.name: os.readlink(p) for p in ahead.iterdir()
    }
    assert (hf_cache.repo_dir(own["node-2"], REPO) / "refs" / "main").read_text() == ahead.name
    after = disk_use(own["node-2"])
    assert after - before == len(new["config.json"])  # its blob; refs/main names another
    assert (
        f"node-2: held revision {behind.name} of the model, now the source's {ahead.name}"
        in result["summary"]
    )
    assert result["probe"]["healthy"]
    again: State = redeploy_vllm_cluster(str(path), return_state=True)
    assert again.is_completed() and "sync" not in again.result()["steps"]
    # The operator drops node-2's old revision: its config.json's blob is linked by nothing.
    shutil.rmtree(behind)
    old_blob = hashlib.sha256(b"{}\n").hexdigest()
    listed = cli("sync", "--model", "-c", str(path))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert (
        f"node-2: 1 blob(s) in {hf_cache.repo_dir(hub, REPO)}/blobs that no snapshot links to, "
        f"3 B ({old_blob[:12]}): `vllm-redeploy sync --prune` removes them"
    ) in " ".join(listed.stdout.split()), listed.stdout
    blobs = hf_cache.repo_dir(own["node-2"], REPO) / "blobs"
    assert (blobs / old_blob).exists()  # listed, not removed
    pruned = cli("sync", "--model", "--prune", "-c", str(path))
    assert pruned.returncode == 0 and "removed, 3 B freed" in pruned.stdout, pruned.stdout
    assert sorted(b.name for b in blobs.iterdir()) == sorted(
        hashlib.sha256(data).hexdigest() for data in new.values()
    )
    assert same_files(ahead, theirs)  # every link still resolves
    keep_for_notes(
        "sync-two-downloads-disk",
        f"node-2 before: {before} B, after: {after} B; first run's sync: "
        f"{result['steps'].get('sync', 0):.1f} s",
    )


def test_a_link_out_of_the_model_is_never_copied_and_is_named(sync_bed: TestBed) -> None:
    bed = sync_bed
    hub, own, snapshot = own_hf_cache(bed, "hf-escape")
    (snapshot / "tokenizer.json").symlink_to("/etc/shadow")
    model = hub / snapshot.relative_to(own["node-1"])
    done = cli("sync", "--model", "-c", str(config_for(bed, "hf-escape", model)))
    keep_for_notes("sync-link-outside", done.stdout + done.stderr)
    assert done.returncode == 1
    assert (
        f"snapshots/{snapshot.name}/tokenizer.json links outside the model's directory, to "
        "/etc/shadow" in done.stderr
    )
    assert list(own["node-2"].parent.iterdir()) == []  # nothing was copied
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "vocab.json").symlink_to("../../blobs/gone")
    state: State = redeploy_vllm_cluster(
        str(config_for(bed, "hf-escape", model, sync={"model": "off"})), return_state=True
    )
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "preflight" in message  # found before anything was stopped
    assert (
        f"node-1: the model in {hf_cache.repo_dir(hub, REPO)} has links that cannot be "
        f"followed: snapshots/{snapshot.name}/vocab.json is a dangling link"
    ) in message
