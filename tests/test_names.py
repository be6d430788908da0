"""Names derived from a cluster's name are accepted by every system that keeps them (issue 13: a
cluster called ``Bed_A`` passed check-config and then crashed the run at its first artifact)."""

from __future__ import annotations

import re

from hypothesis import example, given
from hypothesis import strategies as st
from prefect.server.schemas.actions import (
    ArtifactCreate,
    ConcurrencyLimitV2Create,
    VariableCreate,
)

from tests.fuzz import fuzz_settings
from vllm_redeploy.config.fields import NAME_PATTERN
from vllm_redeploy.events import cluster_resource, failed_event
from vllm_redeploy.names import artifact_key, container_name, lock_name, variable_name

cluster_names = st.from_regex(NAME_PATTERN, fullmatch=True).filter(lambda n: len(n) <= 60)
DOCKER_NAME = r"[a-zA-Z0-9][a-zA-Z0-9_.-]+"


@fuzz_settings(300)
@given(cluster_names)
@example("Bed_A")
@example("bed.v2")
@example("-")  # not a valid name, but the slug must never be empty
def test_every_derived_name_is_accepted_where_it_is_kept(cluster: str) -> None:
    for what in ("summary", "load", "diagnostics"):
        ArtifactCreate(key=artifact_key(cluster, what), type="markdown", data="x")
    VariableCreate(name=variable_name(cluster, "lock_holder"), value={"a": 1})
    ConcurrencyLimitV2Create(name=lock_name(cluster), limit=1)

    assert re.fullmatch(DOCKER_NAME, container_name(cluster, "engine"))


@fuzz_settings(300)
@given(cluster_names, cluster_names)
@example("Bed_A", "bed-a")
@example("bed_a", "bed-a")
def test_different_clusters_never_share_a_key(a: str, b: str) -> None:
    if a != b:
        assert artifact_key(a, "summary") != artifact_key(b, "summary")
        assert variable_name(a, "pause") != variable_name(b, "pause")


def test_plain_names_stay_as_they_are() -> None:
    assert artifact_key("bed", "summary") == "bed-summary"
    assert artifact_key("spark-pair", "load") == "spark-pair-load"
    assert artifact_key("Bed_A", "load").startswith("bed-a-")
    assert variable_name("bed", "pause") == "vllm_redeploy__bed__pause"


def test_cluster_events_carry_the_same_label_as_reboot_events() -> None:
    from vllm_redeploy.events import RESOURCE_LABEL_CLUSTER, reboot_event

    reboot = reboot_event("Bed_A", "node-1", "boot", 1.0)
    failed = failed_event("Bed_A", "wait-ready", "x" * 5000)
    assert (
        reboot["resource"][RESOURCE_LABEL_CLUSTER]
        == failed["resource"][RESOURCE_LABEL_CLUSTER]
        == "Bed_A"
    )
    assert cluster_resource("Bed_A")["prefect.resource.id"] == "vllm-redeploy.cluster.Bed_A"
    assert len(failed["payload"]["reason"]) == 2000
