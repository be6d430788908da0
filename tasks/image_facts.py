"""What the launch needs to know of the image: its ENTRYPOINT (kept when it runs its arguments),
each backend's answer to its own question (Ray's: where `ray` is when Ray runs in it), and its
user (who must own the compile cache). Asked on one node (the IDs must match everywhere), by a
container that is created and never started (the entrypoint script is read from it) and one
one-shot container per backend that asks (Ray's runs `ray --version`): about two seconds, for
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
from vllm_redeploy.launch.backend import Backend
from vllm_redeploy.launch.choose import BACKENDS

STEP = "preflight"
QUESTION_TIMEOUT_S = 60.0
KEPT_FOR = timedelta(days=30)


@dataclass(frozen=True)
class ImageFacts:
    image_id: str
    entrypoint: ImageEntrypoint
    # Each backend's answer, by name (Ray's: where `ray` is, None when Ray does not run there);
    # a backend that asks the image nothing has none.
    answers: dict[str, str | None]
    user: str = ""  # the image's USER; "" is root


def image_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The image's ID, the mounts its containers get (a mount can bring a runtime) and the
    backends that ask it (one registered later has no answer in an older result)."""
    config = parameters["run"].config
    asking = sorted(b.name for b in BACKENDS.values() if b.question(config))
    mounts = json.dumps([sorted(config.vllm.volumes), asking])
    digest = hashlib.sha256(mounts.encode()).hexdigest()[:12]
    # v2: the facts gained the image's user; v3: each backend's answer instead of Ray's path
    # (an older result would lack them).
    return f"image-facts-v3-{parameters['image_id']}-{digest}"


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
    """Read the image's ENTRYPOINT, then ask it each backend's question, on ``node``."""
    docker = run.node(node).docker
    argv, script = docker.image_entrypoint(run.config.vllm.image)
    user = docker.image_user(run.config.vllm.image)
    answers = {b.name: _asked(run, node, b) for b in BACKENDS.values() if b.question(run.config)}
    return ImageFacts(image_id, ImageEntrypoint.of(argv, script), answers, user)


def _asked(run: Run, node: str, backend: Backend) -> str | None:
    """The backend's answer from a one-shot container of the image on ``node``."""
    spec = backend.question(run.config)
    assert spec is not None
    code, output = run.node(node).docker.run_to_completion(spec, QUESTION_TIMEOUT_S)
    if code is None:  # no answer is not "no": fail rather than remember it for a month
        raise StepFailed(
            STEP,
            f"the check for {backend.name} in image {run.config.vllm.image} on {node} did not "
            f"end within {QUESTION_TIMEOUT_S:g} s (Docker slow to start a container, or the "
            "image hangs at start); run again",
        )
    return backend.answer(code, output)
