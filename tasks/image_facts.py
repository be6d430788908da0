"""What the launch needs to know of the image: its ENTRYPOINT (kept when it runs its arguments),
where `ray` is when Ray runs in it, and its user (who must own the compile cache). Asked on one
node (the IDs must match everywhere), by a container that is created and never started (the
entrypoint script is read from it) and one that runs `ray --version`: about two seconds, for
answers that cannot change while the image's ID stays the same. So they are cached by that ID
across runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from tasks.context import RETRY_TRANSIENT, Run, StepFailed
from vllm_redeploy.launch import ImageEntrypoint
from vllm_redeploy.launch.ray import ray_check_spec

STEP = "preflight"
RAY_CHECK_TIMEOUT_S = 60.0
KEPT_FOR = timedelta(days=30)


@dataclass(frozen=True)
class ImageFacts:
    image_id: str
    entrypoint: ImageEntrypoint
    ray_path: str | None  # where `ray` is in the image; None when Ray does not run there
    user: str = ""  # the image's USER; "" is root


def image_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The image's ID and the mounts its containers get (a mount can bring a runtime)."""
    mounts = json.dumps(sorted(parameters["run"].config.vllm.volumes))
    digest = hashlib.sha256(mounts.encode()).hexdigest()[:12]
    # v2: the facts gained the image's user (a v1 result would lack it).
    return f"image-facts-v2-{parameters['image_id']}-{digest}"


# Cached by image ID for KEPT_FOR, persisted so that every later run (another process, the
# nightly, the watcher's recoveries) finds it: an image's ENTRYPOINT and its Ray cannot change
# while its ID stays the same, and a rebuilt or re-pulled image has another ID. Retried only for
# a lost connection or Docker's API; what the containers answered is the answer.
@task(
    name="image-facts",
    task_run_name="image-facts[{node}]",
    cache_key_fn=image_key,
    cache_expiration=KEPT_FOR,
    persist_result=True,
    **RETRY_TRANSIENT,
)
def image_facts(run: Run, node: str, image_id: str) -> ImageFacts:
    """Read the image's ENTRYPOINT, then ask whether Ray runs in it, on ``node``."""
    docker = run.node(node).docker
    argv, script = docker.image_entrypoint(run.config.vllm.image)
    user = docker.image_user(run.config.vllm.image)
    return ImageFacts(image_id, ImageEntrypoint.of(argv, script), _ray_in_image(run, node), user)


def _ray_in_image(run: Run, node: str) -> str | None:
    """Where `ray` is in the image when Ray runs there, else None."""
    image = run.config.vllm.image
    code, output = run.node(node).docker.run_to_completion(
        ray_check_spec(run.config), RAY_CHECK_TIMEOUT_S
    )
    if code is None:  # no answer is not "no Ray": fail rather than remember it for a month
        raise StepFailed(
            STEP,
            f"the check for Ray in image {image} on {node} did not end within "
            f"{RAY_CHECK_TIMEOUT_S:g} s (Docker slow to start a container, or the image hangs "
            "at start); run again",
        )
    lines = output.strip().splitlines()
    return lines[0] if code == 0 and lines else None
