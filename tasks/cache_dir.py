"""Step "cache-dir", only for an image that does not run as root: hand each node's compile cache
directory ([cache] dir) to the image's user, through a one-shot container of the image run as
root (Docker creates a missing mount source as root, and the SSH user may not be root)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from vllm_redeploy.launch.caches import cache_dir, own_cache_spec
from vllm_redeploy.safe_text import shown

STEP = "cache-dir"
TIMEOUT_S = 60.0


# Not cached: the directory may have been removed or handed to someone else since.
@task(name=STEP, task_run_name="cache-dir[{name}]", cache_policy=NO_CACHE, **RETRY_TRANSIENT)
def own_cache_dir(run: Run, name: str, user: str) -> None:
    code, output = run.node(name).docker.run_to_completion(
        own_cache_spec(run.config, user), TIMEOUT_S
    )
    path = cache_dir(run.config)
    if code != 0:
        how = f"exited with code {code}" if code is not None else f"ran past {TIMEOUT_S:g} s"
        raise StepFailed(
            STEP,
            f"could not hand the compile cache {path} on {name} to the image's user {shown(user)}: "
            f"the one-shot container {how}: {shown(output.strip()[-300:])}. "
            f"Run `chown {shown(user)} {path}` there as root, or set [cache] enabled = false",
        )
    log().info("%s: %s belongs to %s", name, path, user)
