"""The mp backend: vLLM's own multi-node launcher, no Ray.

Every node runs `vllm serve` with the same model and parallel sizes plus ``--nnodes N
--node-rank r --master-addr <head fabric IP> --master-port P``; ranks above 0 add
``--headless`` (workers only, no API server). Rank 0, on the head, is the leader: its first
worker hosts the rendezvous (a TCP store on the master port, all addresses) and it serves the
API once every rank has joined and the weights are loaded.

Launch: every rank at once, one step. A follower retries its connection to the master port until
the rendezvous deadline (vLLM's, 600 s unless ``--distributed-timeout-seconds``; a follower that
cannot connect is named by wait-ready much sooner, from its own open connections), so it needs
no leader yet when it starts, and the rendezvous completes as soon as the leader is up. Starting
the followers first (the order of vLLM's docs and the community Spark launcher, typed by hand)
only added a step's round trips. A follower never joins a new leader: the group is always
started and removed whole.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.launch import image_vllm
from vllm_redeploy.launch.backend import Backend
from vllm_redeploy.launch.group import (
    ENGINE_ROLE,
    NodeFabric,
    api_server_env,
    group_spec,
    node_env,
    serve_args,
)
from vllm_redeploy.launch.plan import LAUNCH_VLLM, LaunchPlan, Member, Phase
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec

BACKEND = "mp"
NNODES = "--nnodes"  # the image's answer when its `vllm serve` has the launcher
LEADER_ROLE = "leader"
FOLLOWER_ROLE = "follower"


def follower_container(config: ClusterConfig) -> str:
    return container_name(config.name, FOLLOWER_ROLE)


def plan(
    config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None = None, reason: str = ""
) -> LaunchPlan:
    """A follower on every node but the head and the leader on the head, started together."""
    fabric = fabric or {}
    phases = (Phase(LAUNCH_VLLM),)
    members = [
        Member(
            n.name, FOLLOWER_ROLE, 0, mp_spec(n, config, fabric.get(n.name)), "the vLLM follower"
        )
        for n in config.workers
    ]
    head = config.head
    leader = mp_spec(head, config, fabric.get(head.name))
    members.append(Member(head.name, LEADER_ROLE, 0, leader, "the vLLM leader (rank 0)", True))
    ports = [(config.vllm.port, "API port")]
    if len(config.nodes) > 1:
        ports.append((config.vllm.master_port, "rendezvous (master) port"))
    return LaunchPlan(
        BACKEND,
        reason,
        phases,
        tuple(members),
        tuple(ports),
        rendezvous_port=config.vllm.master_port if len(config.nodes) > 1 else None,
        fabric=dict(fabric),
    )


def mp_serve_args(node: NodeConfig, config: ClusterConfig) -> list[str]:
    """`vllm serve` for ``node``: the same everywhere but the node's rank (and --headless)."""
    rank = [n.name for n in [config.head, *config.workers]].index(node.name)
    args = [
        *serve_args(config),
        "--nnodes",
        str(len(config.nodes)),
        "--node-rank",
        str(rank),
        "--master-addr",
        config.head.ip,
        "--master-port",
        str(config.vllm.master_port),
    ]
    if rank > 0:
        args.append("--headless")
    return [*args, *config.vllm.extra_args]


def mp_spec(
    node: NodeConfig, config: ClusterConfig, fabric: NodeFabric | None = None
) -> ContainerSpec:
    leader = node is config.head
    env = node_env(node, config, fabric)
    if leader:
        env |= api_server_env(config)
    return group_spec(
        config,
        # The leader keeps the engine's name: it is the API server, as the Ray backend's engine.
        name=container_name(config.name, ENGINE_ROLE if leader else FOLLOWER_ROLE),
        role=LEADER_ROLE if leader else FOLLOWER_ROLE,
        backend=BACKEND,
        argv=mp_serve_args(node, config),
        env=env,
        fabric=fabric,
    )


class MpBackend(Backend):
    """vLLM's own multi-node launcher: `vllm serve` on every node, ranked. Asks the image's
    vLLM whether its `vllm serve` has --nnodes (launch/image_vllm.py: the question that also
    names its loaders), and keeps no list of its own: its ranks are the containers."""

    name = BACKEND
    words = "vLLM's own multi-node launcher"
    condition = "the image's vLLM has --nnodes"
    absent = "the image's vLLM has no --nnodes"
    question_timeout_s = image_vllm.QUESTION_TIMEOUT_S

    def plan(
        self, config: ClusterConfig, fabric: Mapping[str, NodeFabric] | None, reason: str
    ) -> LaunchPlan:
        return plan(config, fabric, reason)

    def question(self, config: ClusterConfig) -> ContainerSpec | None:
        return image_vllm.question_spec(config)

    def answer(self, exit_code: int, output: str) -> str | None:
        """``--nnodes`` when its serve has it, "" when it answered without, None when its
        `vllm serve --help` failed (nothing known)."""
        facts = image_vllm.parse_answer(exit_code, output)
        if not facts.answered:
            return None
        return NNODES if facts.nnodes else ""

    def found(self, answer: str | None) -> str | None:
        if answer == NNODES:
            return "the image's vLLM has --nnodes"
        if answer is None:  # a vLLM that cannot print its help: the launcher that asks nothing
            return "the image's vLLM did not answer `vllm serve --help`"
        return None

    def refusal(self, config: ClusterConfig, answer: str | None) -> str | None:
        if answer != "":
            return None
        return (
            f'the vLLM in image {config.vllm.image} has no --nnodes (backend = "mp"): its own '
            'multi-node launcher came after it. Set backend = "ray" (the image must carry '
            "Ray), or use a newer vLLM image"
        )


MP = MpBackend()
