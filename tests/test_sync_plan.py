"""What the sync step copies, judged from what each node holds (no node needed; the listing
runs here, in this machine's sh and find)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.testbed import hf_cache
from tests.testbed.bed import to_toml
from vllm_redeploy.config import ClusterConfig, ConfigError, load_config
from vllm_redeploy.model_source import model_source
from vllm_redeploy.nodes import LocalRunner
from vllm_redeploy.sync import (
    FileEntry,
    Holdings,
    Manifest,
    manifest_argv,
    parse_manifest,
    plan_sync,
)
from vllm_redeploy.sync.verify import digests

EXAMPLE = Path(__file__).resolve().parent.parent / "cluster.example.toml"
ID_A = "sha256:" + "a" * 64
ID_B = "sha256:" + "b" * 64


def config(tmp_path: Path, **sync: str) -> ClusterConfig:
    data = tomllib.loads(EXAMPLE.read_text())
    data["sync"] = {**data.get("sync", {}), **sync}
    path = tmp_path / "cluster.toml"
    path.write_text(to_toml(data))
    return load_config(path, env_file=None)


def manifest(**files: tuple[int, int]) -> Manifest:
    entries = {
        name.replace("__", "/"): FileEntry(name.replace("__", "/"), *v) for name, v in files.items()
    }
    return Manifest(bool(entries), entries, {})


def test_find_output_becomes_files_and_what_a_cut_copy_left() -> None:
    out = (
        "T\t/models/m\0"
        "F\t120\t1700000000.5\t./config.json\0"
        "F\t4000\t1700000001.0000000000\t./model-00001-of-00002.safetensors\0"
        "F\t5000\t1700000002.9\t./sub/model-00002-of-00002.safetensors\0"
        "F\t7\t1700000003.0\t./.vllm-redeploy-incoming/model-00003.safetensors\0"
        "F\t99\t1.0\t./deep/er/x.safetensors\0"
        "L\t./sub/model-00002-of-00002.safetensors\0/models/m/blobs/b2\0"
    )
    found = parse_manifest(out, 0)
    assert set(found.files) == {
        "config.json",
        "model-00001-of-00002.safetensors",
        "sub/model-00002-of-00002.safetensors",
        "deep/er/x.safetensors",
    }
    assert found.files["config.json"] == FileEntry("config.json", 120, 1700000000)
    assert found.staged == {
        "model-00003.safetensors": FileEntry("model-00003.safetensors", 7, 1700000003)
    }
    assert found.weights_bytes == 9000  # the top level and one below, as vLLM loads them
    assert found.links == {"sub/model-00002-of-00002.safetensors": "/models/m/blobs/b2"}
    assert found.link_problems() == []
    absent = parse_manifest("", 3)
    assert not absent.present and absent.weights_bytes is None


def test_a_node_gets_what_it_lacks_or_holds_otherwise_and_keeps_the_rest(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    source = cluster.sync_source.name
    worker = cluster.workers[0].name
    held = [
        Holdings(source, ID_A, manifest(a=(10, 1), b=(20, 2), c=(30, 3), d=(40, 4))),
        Holdings(worker, ID_B, manifest(a=(10, 1), b=(21, 2), c=(30, 9), only_mine=(5, 5))),
    ]
    plan = plan_sync(cluster, held)
    (need,) = plan.needs
    assert need.target == worker
    assert need.image.startswith("another build") and need.old_image_id == ID_B
    assert sorted(f.path for f in need.files) == ["b", "c", "d"]
    assert need.reasons == {"size differs": 1, "modified at another time": 1, "missing": 1}
    assert need.model_bytes == 20 + 30 + 40
    assert not plan.problems


def test_files_a_cut_copy_received_whole_are_not_sent_again(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    staged = Manifest(True, {}, {"a": FileEntry("a", 10, 1), "b": FileEntry("b", 3, 99)})
    held = [
        Holdings(cluster.sync_source.name, ID_A, manifest(a=(10, 1), b=(20, 2))),
        Holdings(cluster.workers[0].name, ID_A, staged),
    ]
    (need,) = plan_sync(cluster, held).needs
    assert need.staged == ("a",)  # whole: only renamed into place
    assert [f.path for f in need.files] == ["b"]  # cut halfway: sent again
    assert not need.image


def test_nothing_to_do_when_every_node_holds_the_same(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    same = manifest(a=(10, 1))
    held = [Holdings(n.name, ID_A, same) for n in cluster.nodes]
    assert plan_sync(cluster, held).needs == ()


def test_checksums_name_files_that_only_look_the_same(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    worker = cluster.workers[0].name
    same = manifest(a=(10, 1), b=(20, 2))
    held = [Holdings(n.name, ID_A, same) for n in cluster.nodes]
    (need,) = plan_sync(cluster, held, {worker: {"b"}}).needs
    assert [f.path for f in need.files] == ["b"] and need.reasons == {"content differs": 1}


def test_off_leaves_each_kind_alone(tmp_path: Path) -> None:
    cluster = config(tmp_path, image="off", model="off")
    held = [
        Holdings(cluster.sync_source.name, ID_A, manifest(a=(10, 1))),
        Holdings(cluster.workers[0].name, None, manifest()),
    ]
    assert plan_sync(cluster, held).needs == ()


def test_a_source_without_the_image_or_model_is_named(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    held = [
        Holdings(cluster.sync_source.name, None, manifest()),
        Holdings(cluster.workers[0].name, ID_A, manifest(a=(1, 1))),
    ]
    plan = plan_sync(cluster, held)
    assert plan.needs == ()
    assert any("lacks the image" in p for p in plan.problems)
    assert any("has no file under" in p for p in plan.problems)


def test_the_source_must_be_a_node(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, source="nowhere")
    assert any("sync.source 'nowhere' is not a node" in p for p in caught.value.problems)
    worker = config(tmp_path, source="spark-b")
    assert worker.sync_source.name == "spark-b"


def test_with_checksums_times_alone_do_not_count(tmp_path: Path) -> None:
    cluster = config(tmp_path)
    worker = cluster.workers[0].name
    held = [
        Holdings(cluster.sync_source.name, ID_A, manifest(a=(10, 1), b=(20, 2))),
        Holdings(worker, ID_A, manifest(a=(10, 7), b=(20, 8))),  # downloaded there on its own
    ]
    (need,) = plan_sync(cluster, held).needs
    assert need.reasons == {"modified at another time": 2}
    assert plan_sync(cluster, held, {worker: set()}).needs == ()  # same content: nothing to copy


def test_every_byte_a_name_may_hold_is_listed_and_nothing_outside_is_taken(
    tmp_path: Path,
) -> None:
    """The real listing (sh and GNU find, through the local runner as on a node) of names
    holding a carriage return, a newline and a tab: each is the model's; a listing that names
    paths outside the tree (a hostile source) gets them refused, never taken as files to copy
    (issue 51)."""
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    names = ["a\rb.json", "line\nbreak.json", "tab\there.json", "sub/plain.safetensors"]
    for name in names:
        (model / name).write_text("x")
    source = model_source(str(model), None)
    done = LocalRunner("here").run(manifest_argv(source), check=False)
    found = parse_manifest(done.stdout, done.exit_code or 0)
    assert sorted(found.files) == sorted(names) and found.link_problems() == []
    hostile = "T\t/models/m\0F\t4\t1.0\t../../etc/shadow\0F\t4\t1.0\t/etc/passwd\0"
    taken = parse_manifest(hostile + "F\t4\t1.0\t./ok.json\0", 0)
    assert list(taken.files) == ["ok.json"]
    assert taken.link_problems() == [
        "../../etc/shadow is listed, outside the model's directory",
        "/etc/passwd is listed, outside the model's directory",
    ]


REPO = "Qwen/Qwen3.5-122B-A10B-FP8"


def hf_listing(hub: Path) -> Manifest:
    """The real listing of the repo in ``hub`` (the cached form: refs/main names the revision)."""
    done = LocalRunner("here").run(manifest_argv(model_source(REPO, str(hub))), check=False)
    return parse_manifest(done.stdout, done.exit_code or 0)


def test_two_downloads_of_one_model_share_their_blobs_and_only_what_differs_is_sent(
    tmp_path: Path,
) -> None:
    """Each node ran `hf download` on its own: the same weights (same blobs, other times), and
    node-2 one revision behind with another config.json. Only that blob is sent; the snapshot
    gets links into the blobs; refs/main follows the source (issue 51)."""
    cluster = config(tmp_path)
    worker = cluster.workers[0].name
    weights = {f"model-0000{i}-of-00002.safetensors": os.urandom(4096) for i in (1, 2)}
    new = {"config.json": b'{"v": 2}\n', **weights}
    ahead = hf_cache.write_snapshot(tmp_path / "node-1", REPO, new)
    behind = hf_cache.write_snapshot(tmp_path / "node-2", REPO, {"config.json": b"{}\n", **weights})
    for blob in (behind.parent.parent / "blobs").iterdir():
        os.utime(blob, (1_000_000_000, 1_000_000_000))  # downloaded long before
    source, target = hf_listing(tmp_path / "node-1"), hf_listing(tmp_path / "node-2")
    assert (source.revision, target.revision) == (ahead.name, behind.name)
    held = [
        Holdings(cluster.sync_source.name, ID_A, source),
        Holdings(worker, ID_A, target),
    ]
    (need,) = plan_sync(cluster, held).needs
    config_blob = hashlib.sha256(new["config.json"]).hexdigest()
    assert sorted(f.path for f in need.files) == [f"blobs/{config_blob}", "refs/main"]
    assert need.already == 2 * 4096  # the weights: same names in blobs/, same bytes
    assert dict(need.links) == {
        f"snapshots/{ahead.name}/{name}": f"../../blobs/{hashlib.sha256(data).hexdigest()}"
        for name, data in new.items()
    }
    assert need.reasons == {
        "blob missing": 1,
        "linked to a blob already there": 2,
        "another revision": 1,
    }
    assert need.revisions == (behind.name, ahead.name)
    assert "revision " + ahead.name[:12] in need.describe(cluster.vllm.image)
    # Once node-2 holds the source's revision as `hf download` leaves it: nothing to send.
    hf_cache.write_snapshot(tmp_path / "node-2", REPO, new)
    again = [held[0], Holdings(worker, ID_A, hf_listing(tmp_path / "node-2"))]
    assert plan_sync(cluster, again).needs == ()
    assert again[1].model.unlinked() == {}  # the old revision still links its config.json
    shutil.rmtree(behind)
    assert hf_listing(tmp_path / "node-2").unlinked() == {hashlib.sha256(b"{}\n").hexdigest(): 3}


def test_a_snapshot_of_plain_files_gets_links_and_no_byte(tmp_path: Path) -> None:
    """An earlier copy left the target's snapshot as plain files beside the same blobs (the
    model held twice): links replace them, and nothing is sent."""
    cluster = config(tmp_path)
    files = {"config.json": b"{}\n", "model.safetensors": os.urandom(4096)}
    snapshot = hf_cache.write_snapshot(tmp_path / "node-1", REPO, files)
    twice = hf_cache.write_snapshot(tmp_path / "node-2", REPO, files)
    for name, data in files.items():
        (twice / name).unlink()
        (twice / name).write_bytes(data)
    held = [
        Holdings(cluster.sync_source.name, ID_A, hf_listing(tmp_path / "node-1")),
        Holdings(cluster.workers[0].name, ID_A, hf_listing(tmp_path / "node-2")),
    ]
    (need,) = plan_sync(cluster, held).needs
    assert need.files == () and need.already == 4096 + 3
    assert sorted(path for path, _ in need.links) == [
        f"snapshots/{snapshot.name}/{n}" for n in sorted(files)
    ]


def test_digests_come_back_for_every_name_and_none_for_a_file_that_is_gone(tmp_path: Path) -> None:
    """--verify's hashing through the real sh, xargs and sha256sum: names with a newline, a
    carriage return or a backslash (which sha256sum would escape in its lines) get their file's
    digest; a missing file gets none, so it is never taken as equal."""
    names = ["a\nb.json", "c\\d.json", "e\rf.json", "plain.json"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * 10)
    node = SimpleNamespace(runner=LocalRunner("here"))
    found = digests(node, str(tmp_path), [*names, "gone.json"])  # type: ignore[arg-type]
    assert found == {
        name: hashlib.sha256(bytes([i]) * 10).hexdigest() for i, name in enumerate(names)
    }


def test_unlike_revisions_are_noted_when_nothing_aligns_them(tmp_path: Path) -> None:
    from tasks.preflight import NodeFacts, revision_notes

    ahead = hf_cache.write_snapshot(tmp_path / "node-1", REPO, {"config.json": b"{}\n"})
    behind = hf_cache.write_snapshot(tmp_path / "node-2", REPO, {"config.json": b"[]\n"})

    def facts(node: str) -> NodeFacts:
        listing = hf_listing(tmp_path / node)
        return NodeFacts(
            node=node, docker_version="29.0", image_id=ID_A, model_present=True, waited_s=0.0,
            model=listing,
        )  # fmt: skip

    assert revision_notes([facts("node-1"), facts("node-1")]) == []
    assert revision_notes([facts("node-1"), facts("node-2")]) == [
        f"the nodes hold different revisions of the model (node-1 {ahead.name[:12]}, node-2 "
        f'{behind.name[:12]}); each serves its own: set [sync] model = "auto" to give every '
        "node the source's, or download one revision"
    ]
