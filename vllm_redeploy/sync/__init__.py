"""The same image and model on every node: what differs (``plan``), and the copies that make
them equal (``copy``), streamed from a source node. No Prefect here."""

from vllm_redeploy.sync.copy import (
    Copied,
    Route,
    SyncFailed,
    copy_image,
    copy_model,
    disk_room,
    planned_bytes,
    route_between,
    sync_target,
)
from vllm_redeploy.sync.manifest import (
    NO_MODEL,
    STAGE,
    FileEntry,
    Manifest,
    manifest_argv,
    parse_manifest,
)
from vllm_redeploy.sync.plan import (
    Holdings,
    SyncNeed,
    SyncPlan,
    human_bytes,
    plan_sync,
    survey,
    unsafe_links,
)

__all__ = [
    "NO_MODEL",
    "STAGE",
    "Copied",
    "FileEntry",
    "Holdings",
    "Manifest",
    "Route",
    "SyncFailed",
    "SyncNeed",
    "SyncPlan",
    "copy_image",
    "copy_model",
    "disk_room",
    "human_bytes",
    "manifest_argv",
    "parse_manifest",
    "plan_sync",
    "planned_bytes",
    "route_between",
    "survey",
    "sync_target",
    "unsafe_links",
]
