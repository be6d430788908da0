"""Step 5, cluster check: Ray sees every node alive at its fabric IP, and every GPU."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.plan import (
    RAY_MEMBERS_SCRIPT,
    RayMember,
    membership_problems,
    parse_members,
    ray_container,
)

STEP = "cluster-check"
POLL_S = 0.5


def ray_members(run: Run) -> list[RayMember]:
    runner = run.head.docker.exec_runner(ray_container(run.config))
    result = runner.run(["python3", "-c", RAY_MEMBERS_SCRIPT], timeout=60)
    return parse_members(result.stdout)


# Not cached: membership is only true now.
@task(
    name="cluster-check",
    cache_policy=NO_CACHE,
    **RETRY_TRANSIENT,
)
def check_ray_cluster(run: Run) -> list[RayMember]:
    config = run.config
    deadline = time.monotonic() + config.deadlines.ray_cluster_s
    while True:
        members = ray_members(run)
        problems = membership_problems(config, members)
        if not problems:
            gpus = sum(m.gpus for m in members if m.alive)
            log().info("Ray sees %d nodes and %g GPUs", len(members), gpus)
            return members
        if time.monotonic() >= deadline:
            status = run.head.docker.exec_runner(ray_container(config)).run(
                ["ray", "status"], timeout=60, check=False
            )
            raise StepFailed(
                STEP,
                f"after {config.deadlines.ray_cluster_s:g} s: {'; '.join(problems)}. "
                f"ray status:\n{status.stdout.strip() or status.stderr.strip()}",
            )
        time.sleep(POLL_S)
