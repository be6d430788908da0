"""On failure: what each node looked like, as one markdown artifact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.context import Run
from vllm_redeploy.launch.choose import BACKENDS
from vllm_redeploy.launch.group import LABEL_BACKEND
from vllm_redeploy.masking import masked
from vllm_redeploy.names import artifact_key
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out
from vllm_redeploy.nodes.containers import cluster_labels
from vllm_redeploy.parsers.nvidia_smi import COMPUTE_APPS_ARGV
from vllm_redeploy.safe_text import fenced, one_line, shown

LOG_LINES = 40


def _node_section(run: Run, name: str) -> str:
    """Containers with their logs, GPU processes, kernel OOM lines and, on the head, what the
    group's backend adds (Ray's `ray status`): read at once, as a failed run should end soon
    after the failure."""
    access = run.node(name)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="diagnose") as pool:
        pieces = [
            pool.submit(_containers, run, access),
            pool.submit(_gpu_processes, access),
            pool.submit(_kernel_oom, access),
        ]
        if name == run.config.head.name:
            pieces.append(pool.submit(_backend_sections, run, access))
        return "\n\n".join([f"## {name}", *(p for f in pieces if (p := f.result()))])


def _containers(run: Run, access: NodeAccess) -> str:
    labels = cluster_labels(run.config.name)
    parts = []
    for c in access.docker.list_containers(labels=labels):
        code = f", exit {c.exit_code}" if c.exit_code is not None else ""
        oom = ", OOM-killed" if c.oom_killed else ""
        parts.append(f"### {shown(c.name)} ({shown(c.status)}{code}{oom})")
        parts.append(fenced(access.docker.logs_tail(c.name, LOG_LINES)))
    return "\n\n".join(parts)


def _gpu_processes(access: NodeAccess) -> str:
    smi = access.runner.run(list(COMPUTE_APPS_ARGV), check=False)
    return "### nvidia-smi compute apps\n" + fenced(smi.stdout.strip() or "(none)")


def _kernel_oom(access: NodeAccess) -> str:
    """Kernel OOM lines, where the login may read the kernel log: itself, or through `sudo -n`
    (Ubuntu restricts it to root: kernel.dmesg_restrict = 1)."""
    argv = ["dmesg", "--level=err,warn"]
    dmesg = access.runner.run(argv, check=False)
    if not dmesg.ok and not access.root().is_root:
        dmesg = access.runner.run(["sudo", "-n", *argv], check=False)
    if not dmesg.ok:
        why = one_line(((dmesg.stderr or dmesg.stdout).strip().splitlines() or ["no output"])[-1])
        return f"### kernel OOM lines\n(the kernel log could not be read: {why})"
    oom = [line for line in dmesg.stdout.splitlines() if "oom" in line.lower()][-10:]
    return "### kernel OOM lines\n" + fenced("\n".join(oom)) if oom else ""


def _backend_sections(run: Run, access: NodeAccess) -> str:
    """What the backend of each of our containers on the head (by their label) adds."""
    found = access.docker.list_containers(labels=cluster_labels(run.config.name))
    names = sorted({c.labels.get(LABEL_BACKEND, "") for c in found} & BACKENDS.keys())
    sections = (BACKENDS[n].diagnostics(access.docker, run.config) for n in names)
    return "\n\n".join(s for s in sections if s)


# Not cached: what went wrong is this run's. Not retried: it runs while the run fails, and a
# node it cannot read is said in the artifact rather than waited for.
@task(name="diagnostics", task_run_name="diagnostics", cache_policy=NO_CACHE)
def collect_diagnostics(run: Run, step: str, reason: str) -> str:
    sections = [f"# {run.config.name}: failed at {step}", fenced(reason)]
    for outcome in fan_out(run.config.nodes, lambda n: _node_section(run, n.name)):
        if isinstance(outcome.error, RemoteError):
            sections.append(f"## {outcome.node}\nunreachable: {one_line(outcome.error)}")
        else:
            sections.append(outcome.value or "")
    text = masked("\n\n".join(sections), run.config.secret_values())
    run.records.record(
        "diagnostics",
        lambda: create_markdown_artifact(
            text,
            key=artifact_key(run.config.name, "diagnostics"),
            description="state of every node when the run failed",
        ),
    )
    return text
