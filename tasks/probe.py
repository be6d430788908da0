"""Step "probe": one chat completion, judged for a reasoning model."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from vllm_redeploy.endpoint import api_base, api_key
from vllm_redeploy.probe import ProbeVerdict, run_probe

STEP = "probe"


def probe(run: Run) -> ProbeVerdict:
    p = run.config.probe
    return run_probe(
        api_base(run.config),
        run.config.vllm.served_name,
        p.prompt,
        p.max_tokens,
        p.temperature,
        p.timeout_s,
        api_key(run.config),
    )


# Not cached and not retried: the verdict is the point; a flaky answer is an answer.
@task(name="probe", task_run_name="probe", cache_policy=NO_CACHE)
def probe_model(run: Run) -> ProbeVerdict:
    verdict = probe(run)
    if not verdict.healthy:
        # No status: nothing came back (a stall, a refused or cut connection).
        what = "answered but is not healthy" if verdict.status_code else "did not answer"
        raise StepFailed(STEP, f"the model {what}: {verdict.detail}")
    log().info("probe healthy: %s", verdict.detail)
    return verdict
