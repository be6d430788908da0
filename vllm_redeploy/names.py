"""Names derived from a cluster's name, each in the alphabet of the system that keeps it.

A cluster name passes the configuration's rule (letters, digits, ``.``, ``_``, ``-``), which Docker
accepts for container and volume names as it is. Prefect is stricter: artifact keys take only
lowercase letters, digits and dashes, Variable names lowercase letters, digits, dashes and
underscores. Those get a slug; when the slug is not the name itself (``Bed_A`` becomes
``bed-a``), a short digest of the name follows, so ``Bed_A`` and ``bed-a`` never share a key.
"""

from __future__ import annotations

import hashlib
import re

from vllm_redeploy import PROJECT


def _slug(name: str, allowed: str, joiner: str) -> str:
    slug = re.sub(f"[^{allowed}]+", joiner, name.lower()).strip(joiner) or "cluster"
    if slug == name:
        return slug
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{slug}{joiner}{digest}"


def artifact_key(cluster: str, what: str) -> str:
    """A Prefect artifact key for ``cluster``: ``bed-summary``, ``bed-a-4f1c2e-load``."""
    return f"{_slug(cluster, 'a-z0-9', '-')}-{what}"


def variable_name(cluster: str, what: str) -> str:
    """A Prefect Variable name for ``cluster``: ``vllm_redeploy__bed__pause``."""
    return f"vllm_redeploy__{_slug(cluster, 'a-z0-9', '_')}__{what}"


def deployment_name(cluster: str, trigger: str) -> str:
    """The Prefect deployment that runs ``cluster``'s redeploy for ``trigger`` (nightly,
    after-reboot, recover, manual): ``bed-recover``."""
    return f"{cluster}-{trigger}"


def lock_name(cluster: str) -> str:
    """The global concurrency limit that lets one run at a time touch ``cluster``."""
    return f"{PROJECT}-cluster-{cluster}"


def container_name(cluster: str, role: str) -> str:
    """A container (or volume) of ours on a node: ``vllm-redeploy-bed-ray``."""
    return f"{PROJECT}-{cluster}-{role}"


def cluster_resource_id(cluster: str) -> str:
    """The ``prefect.resource.id`` of a cluster in events: ``vllm-redeploy.cluster.bed``."""
    return f"{PROJECT}.cluster.{cluster}"


def webhook_path(cluster: str) -> str:
    """Where the reboot webhook takes ``cluster``'s notices: ``/clusters/bed`` (+ ``/reboot``);
    the name's alphabet needs no URL quoting."""
    return f"/clusters/{cluster}"


def cluster_tag(cluster: str) -> str:
    """The tag every flow run of ``cluster`` carries, however it was started: ``cluster:bed``."""
    return f"cluster:{cluster}"
