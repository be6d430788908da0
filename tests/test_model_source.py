"""``[vllm] model`` in each form a user writes it, and the listing every node answers for it: a
plain directory, a Hugging Face snapshot, its models-- directory, and a repo id in the cache."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.testbed import hf_cache
from vllm_redeploy.config.launch import VLLMConfig
from vllm_redeploy.model_source import model_source
from vllm_redeploy.sync import manifest_argv, parse_manifest

REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
FILES = {"config.json": b"{}\n", "model-00001-of-00001.safetensors": b"w" * 100}


def listing(model: str, hub: Path | None = None):  # type: ignore[no-untyped-def]
    source = model_source(model, str(hub) if hub else None)
    found = subprocess.run(manifest_argv(source), capture_output=True, text=True, check=False)
    return parse_manifest(found.stdout, found.returncode)


def test_each_form_mounts_the_tree_and_serves_what_vllm_resolves(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = hf_cache.write_snapshot(hub, REPO, FILES)
    repo = str(snapshot.parent.parent)
    plain = model_source("/models/Qwen3.5", None)
    assert (plain.tree, plain.serve, plain.env()) == ("/models/Qwen3.5", "/models/Qwen3.5", {})
    pinned = model_source(str(snapshot), None)
    assert pinned.tree == repo and pinned.serve == str(snapshot) and pinned.env() == {}
    assert pinned.mount() == f"{repo}:{repo}:ro"  # the links' blobs come with it
    for cached in (model_source(repo, None), model_source(REPO, str(hub))):
        assert (cached.tree, cached.serve) == (repo, REPO)
        assert cached.env() == {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}


def test_a_repo_id_without_a_cache_is_refused_in_words() -> None:
    with pytest.raises(ValueError, match=r"set \[vllm\] hf_cache to that cache's hub directory"):
        VLLMConfig(image="vllm/vllm-openai:v0.19.0", model=REPO)
    assert VLLMConfig(image="i", model=REPO, hf_cache="/h").served_name == REPO
    with pytest.raises(ValueError, match="absolute directory, or a Hugging Face repo id"):
        VLLMConfig(image="i", model="./models/Qwen")


def test_every_form_lists_the_revisions_files_relative_to_the_tree(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = hf_cache.write_snapshot(hub, REPO, FILES)
    revision = snapshot.name
    repo = snapshot.parent.parent
    files = {f"snapshots/{revision}/{name}" for name in FILES}
    assert set(listing(str(snapshot)).files) == files
    assert set(listing(REPO, hub).files) == files | {"refs/main"}
    assert set(listing(str(repo)).files) == files | {"refs/main"}
    found = listing(REPO, hub)
    assert found.present and found.weights_bytes == 100 and found.link_problems() == []
    assert found.tree == str(repo.resolve())
    assert set(listing(str(snapshot / ".")).files) == files
    plain = listing(str(snapshot.parent / revision))  # the same snapshot, named as a path
    assert plain.files[f"snapshots/{revision}/config.json"].size == 3


def test_what_is_not_there_is_absent(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    assert not listing(str(tmp_path / "none")).present
    assert not listing(REPO, hub).present
    snapshot = hf_cache.write_snapshot(hub, REPO, FILES)
    (snapshot.parent.parent / "refs" / "main").write_text("../../../etc")  # no revision name
    assert not listing(REPO, hub).present
    assert not listing(str(snapshot.parent / ("0" * 40))).present


def test_links_that_dangle_or_leave_the_tree_are_named_and_not_followed(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = hf_cache.write_snapshot(hub, REPO, FILES)
    secret = tmp_path / "outside"
    (secret / "deep").mkdir(parents=True)
    (secret / "deep" / "shadow").write_text("root:*:")
    (snapshot / "tokenizer.json").symlink_to(secret / "deep" / "shadow")
    (snapshot / "sub").symlink_to(secret)  # a directory outside: never walked
    (snapshot / "vocab.json").symlink_to("../../blobs/gone")
    found = listing(str(snapshot))
    assert found.present and found.files == {}  # nothing listed, so nothing is copied
    problems = found.link_problems()
    assert problems == [
        f"snapshots/{snapshot.name}/sub links outside the model's directory, to {secret}",
        f"snapshots/{snapshot.name}/tokenizer.json links outside the model's directory, "
        f"to {secret}/deep/shadow",
        f"snapshots/{snapshot.name}/vocab.json is a dangling link (its target is not there)",
    ]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    (plain / "inner.json").symlink_to("config.json")  # inside its own tree: fine
    found = listing(str(plain))
    assert set(found.files) == {"config.json", "inner.json"} and found.link_problems() == []
