"""Step "transport": prove which transport NCCL chose between the nodes, from every rank's own
log lines (read from the start: the loading lines come after them).

RDMA is required when any node has active HCAs (``[fabric] require_rdma``): a group that fell
back to TCP sockets answers the probe, at a fraction of the decode speed, so it fails here with
what to fix, node by node. One HCA of a Spark's two twins is half the bandwidth: a note.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import Run, StepFailed, log
from vllm_redeploy.launch.group import NodeFabric
from vllm_redeploy.launch.plan import LaunchPlan
from vllm_redeploy.nodes import fan_out
from vllm_redeploy.transport import NodeTransport, TransportVerdict, judge_nodes

STEP = "transport"


def rdma_required(run: Run, plan: LaunchPlan) -> bool:
    configured = run.config.fabric.require_rdma
    if configured is not None:
        return configured
    return run.config.fabric.rdma == "auto" and any(f.hcas for f in plan.fabric.values())


# Not cached: it reads what this run's ranks logged.
@task(name="transport", task_run_name="transport", cache_policy=NO_CACHE)
def prove_transport(run: Run, plan: LaunchPlan) -> TransportVerdict:
    config = run.config
    members = plan.rank_logs
    texts = fan_out(
        [run.node_config(m.node) for m in members],
        lambda n: run.node(n.name).docker.log_head(_of(members, n.name)),
    )
    logs = [(o.node, o.value or "") for o in texts]
    node_ips = {n.ip: n.name for n in config.nodes}
    verdict = judge_nodes(logs, node_ips, [n.name for n in config.nodes])
    log().info("NCCL transport: %s (%s)", verdict.transport, _phrases(verdict))
    if rdma_required(run, plan) and verdict.transport != "rdma":
        fixes = [_fix(n, plan.fabric.get(n.node)) for n in verdict.nodes if n.transport != "rdma"]
        sockets = any(n.transport in ("socket", "mixed") for n in verdict.nodes)
        how = "over TCP sockets" if sockets else "without proof that it is over RDMA"
        raise StepFailed(
            STEP,
            f"NCCL did not use RDMA on every node ({_phrases(verdict)}); the model answers, but "
            f"{how}. {' '.join(fixes)} Or set [fabric] require_rdma = false to accept it.",
        )
    return verdict


def half_bandwidth(plan: LaunchPlan, verdict: TransportVerdict) -> list[str]:
    """Nodes whose ranks used fewer of the node's active HCAs than it has (a Spark's cable shows
    up as two twins, each one PCIe x4 link: one of them is half the bandwidth)."""
    notes = []
    for node in verdict.nodes:
        fabric = plan.fabric.get(node.node)
        if node.transport == "rdma" and fabric and 0 < len(node.hcas) < len(fabric.hcas):
            notes.append(
                f"{node.node}: NCCL used {', '.join(node.hcas)} of {', '.join(fabric.hcas)}: "
                "half the bandwidth; list every twin in NCCL_IB_HCA (nodes[].ib_hcas, or leave "
                "it out to use the discovered ones)"
            )
    return notes


def _fix(node: NodeTransport, fabric: NodeFabric | None) -> str:
    if node.transport == "unknown":
        return (
            f"{node.node}: its engine's log has no 'Using network' line of NCCL's (a log cut "
            "short, or NCCL's lines sent elsewhere): `vllm-redeploy fabric --log FILE` judges a "
            "saved log."
        )
    if fabric is None or not fabric.rdma:
        return (
            f"{node.node}: its containers got no RDMA devices (the node shows no active RDMA HCA "
            'with /dev/infiniband devices, or [fabric] rdma = "off"): check `rdma link show` '
            "and `ls /dev/infiniband` there."
        )
    said = "; ".join(node.warnings[:2])
    return f"{node.node}: NCCL did not take the HCAs it was given (NCCL_IB_HCA {fabric.ib_hca})" + (
        f": {said}." if said else "."
    )


def _of(members: list, node: str) -> str:  # type: ignore[type-arg]
    return next(m.spec.name for m in members if m.node == node)


def _phrases(verdict: TransportVerdict) -> str:
    return "; ".join(n.phrase() for n in verdict.nodes)
