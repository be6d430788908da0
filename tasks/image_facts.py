"""What the launch needs to know of the image: its ENTRYPOINT (kept when it runs its arguments),
each backend's answer to its own question (Ray's: where `ray` is when Ray runs in it; mp's:
whether its `vllm serve` has --nnodes), what its vLLM says of itself (the loaders it accepts
and imports: launch/image_vllm.py) and its user (who must own the compile cache). Asked on one
node (the IDs must match everywhere), by a container that is created and never started (the
entrypoint script is read from it) and one one-shot container per distinct question (Ray's runs
`ray --version`, about two seconds; the vLLM question, which mp's is, its `vllm serve --help`:
vLLM's import, 10-15 s), for answers that cannot change while the image's ID stays the same. So
they are cached by that ID across runs."""

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
from vllm_redeploy.launch.choose import BACKENDS
from vllm_redeploy.launch.image_vllm import (
    QUESTION_TIMEOUT_S,
    ImageVllm,
    parse_answer,
    question_spec,
)
from vllm_redeploy.nodes.containers import ContainerSpec

STEP = "preflight"
KEPT_FOR = timedelta(days=30)


@dataclass(frozen=True)
class ImageFacts:
    image_id: str
    entrypoint: ImageEntrypoint
    # Each backend's answer, by name (Ray's: where `ray` is, None when Ray does not run there);
    # a backend that asks the image nothing has none.
    answers: dict[str, str | None]
    user: str = ""  # the image's USER; "" is root
    vllm: ImageVllm | None = None  # what its vLLM said of itself


def image_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The image's ID, the mounts its containers get (a mount can bring a runtime) and the
    backends that ask it (one registered later has no answer in an older result)."""
    config = parameters["run"].config
    asking = sorted(b.name for b in BACKENDS.values() if b.question(config))
    mounts = json.dumps([sorted(config.vllm.volumes), asking])
    digest = hashlib.sha256(mounts.encode()).hexdigest()[:12]
    # v2: the facts gained the image's user; v3: each backend's answer instead of Ray's path;
    # v4: what its vLLM says of itself (an older result would lack them).
    return f"image-facts-v4-{parameters['image_id']}-{digest}"


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
    """Read the image's ENTRYPOINT, then ask it each backend's question and its vLLM's, on
    ``node``; a question two ask runs once."""
    docker = run.node(node).docker
    argv, script = docker.image_entrypoint(run.config.vllm.image)
    user = docker.image_user(run.config.vllm.image)
    asked: list[tuple[ContainerSpec, tuple[int, str]]] = []

    def ask(spec: ContainerSpec, timeout_s: float, what: str) -> tuple[int, str]:
        for earlier, answer in asked:
            if earlier == spec:
                return answer
        answer = _asked(run, node, spec, timeout_s, what)
        asked.append((spec, answer))
        return answer

    answers = {
        b.name: b.answer(*ask(spec, b.question_timeout_s, b.name))
        for b in BACKENDS.values()
        if (spec := b.question(run.config)) is not None
    }
    vllm = parse_answer(*ask(question_spec(run.config), QUESTION_TIMEOUT_S, "its vLLM"))
    return ImageFacts(image_id, ImageEntrypoint.of(argv, script), answers, user, vllm)


def _asked(
    run: Run, node: str, spec: ContainerSpec, timeout_s: float, what: str
) -> tuple[int, str]:
    """A one-shot container's answer on ``node``: its exit code and log."""
    code, output = run.node(node).docker.run_to_completion(spec, timeout_s)
    if code is None:  # no answer is not "no": fail rather than remember it for a month
        raise StepFailed(
            STEP,
            f"the check for {what} in image {run.config.vllm.image} on {node} did not "
            f"end within {timeout_s:g} s (Docker slow to start a container, or the "
            "image hangs at start); run again",
        )
    return code, output
