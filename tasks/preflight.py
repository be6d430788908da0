"""Step "preflight": every node reachable (waiting for late ones), Docker up, the same image,
the model directory and its weights, Ray in the image, each node's fabric IP and fabric (its
interfaces, RDMA HCAs and devices; the configured interface and HCA names against them; the
same RoCE MTU on every node), and on the head who holds the ports the group binds.
``launch_plan`` then picks the launch backend and builds the plan from what was found, and
``judge_preflight`` fails naming every problem, and a holder of the plan's ports that
stop-autostart would leave running."""

from __future__ import annotations

import contextvars
import shlex
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import INPUTS, RUN_ID

from tasks.context import RETRY_TRANSIENT, Run, StepFailed, log
from tasks.image_facts import image_facts
from tasks.ports_free import held_ports
from tasks.stop_autostart import root_commands
from vllm_redeploy.fabric_checks import Port, configured_name_problems, mtu_mismatches, roce_ports
from vllm_redeploy.launch import (
    ImageEntrypoint,
    ImageVllm,
    LaunchPlan,
    NodeFabric,
    asks_the_image,
    choose,
    choose_loader,
    loader_refusal,
    plan_for,
    refusal,
)
from vllm_redeploy.listeners import Kept
from vllm_redeploy.nodes import (
    AuthenticationFailed,
    CommandTimedOut,
    HostKeyRejected,
    NodeUnreachable,
)
from vllm_redeploy.nodes.privilege import SUDOERS_FILE, refused_as_root, sudoers_line
from vllm_redeploy.nodes.result import CommandResult
from vllm_redeploy.parsers import nvidia_smi
from vllm_redeploy.parsers.fabric import FABRIC_ARGV, FabricFacts, parse_fabric
from vllm_redeploy.safe_text import one_line
from vllm_redeploy.sync import Manifest, manifest_argv, parse_manifest, unsafe_links

STEP = "preflight"
REACH_POLL_S = 2.0


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    node: str
    docker_version: str
    image_id: str | None
    model_present: bool
    waited_s: float
    fabric_ip_local: bool = True
    # The backends' answers from the image (launch.choose), when the choice needs them: asked
    # on the head only; None where the image was not asked.
    image_answers: Mapping[str, str | None] | None = None
    image_vllm: ImageVllm | None = None  # what the image's vLLM said of itself (head only)
    fabric: FabricFacts | None = None
    weights_bytes: int | None = None  # the model directory's safetensors, in all
    entrypoint: ImageEntrypoint | None = None  # the image's (read on the head only)
    image_user: str | None = None  # the image's USER, "" for root (read on the head only)
    model: Manifest | None = None  # the model directory's files (size, mtime)
    root_problem: str | None = None  # why the login cannot run what needs root there
    gpu_problem: str | None = None  # why nvidia-smi's answer cannot be judged
    gpu_warnings: tuple[str, ...] = ()  # what nvidia-smi warned of, with a full answer
    held: tuple[Kept, ...] = ()  # listeners the stop would leave on the head's ports (head only)

    @property
    def notes(self) -> list[str]:
        """What people should know about the node that does not stop the run."""
        found = list(self.fabric.problems() if self.fabric else ())
        if self.entrypoint is not None and self.entrypoint.kept:
            found.append(self.entrypoint.why())
        found += [
            f"nvidia-smi warns: {one_line(w)} (tolerated: it answered)" for w in self.gpu_warnings
        ]
        return [f"{self.node}: {p}" for p in found]


def wait_reachable(run: Run, name: str) -> float:
    """Wait until the node answers over SSH, up to the configured window; seconds waited. A
    connection that opens but does not answer in time (a node still booting, or swamped) is
    waited for like one that does not open."""
    window = run.config.deadlines.nodes_reachable_s
    timeout = run.config.ssh.connect_timeout_s
    started = time.monotonic()
    while True:
        try:
            run.node(name).runner.check_connection(timeout=timeout)
            return time.monotonic() - started
        except (HostKeyRejected, AuthenticationFailed) as exc:
            raise StepFailed(STEP, str(exc)) from None  # waiting will not fix trust or keys
        except (NodeUnreachable, CommandTimedOut) as exc:
            waited = time.monotonic() - started
            if isinstance(exc, NodeUnreachable):
                reason, hint = exc.reason, f". {exc.hint}" if exc.hint else ""
            else:
                reason, hint = f"`true` got no answer within {timeout:g} s", ""
            if waited >= window:
                raise StepFailed(
                    STEP, f"node {name} did not come back within {window:g} s: {reason}{hint}"
                ) from None
            log().info("waiting for %s (%s), %.0f s of %g s", name, reason, waited, window)
            run.node(name).runner.close()
            time.sleep(REACH_POLL_S)


# Cached per flow run (RUN_ID) and node: a flow-level retry reuses these read-only facts instead
# of asking every node again; a later run never sees them (another run ID).
@task(
    name="preflight",
    task_run_name="preflight[{name}]",
    cache_policy=RUN_ID + INPUTS - "run",
    **RETRY_TRANSIENT,
)
def preflight_node(run: Run, name: str) -> NodeFacts:
    """Reachable, Docker up, image and model present, Ray in the image."""
    config = run.config
    waited = wait_reachable(run, name)
    access = run.node(name)
    docker = access.docker
    # The node's own questions in one round trip, while Docker answers its own (side by side:
    # two channels of one connection): the model, the fabric IP, the fabric, the weights' size.
    # Fabric IPs set by hand are lost at reboot; `ip route get` tells, without sending anything,
    # whether the node still owns its fabric IP ("local ..." when it does).
    ip = run.node_config(name).ip
    background = ThreadPoolExecutor(max_workers=3, thread_name_prefix="preflight")
    root = background.submit(root_problem, run, name)
    held = background.submit(held_ports, run) if name == config.head.name else None
    asked = background.submit(
        access.runner.run_all,
        [
            ["ip", "route", "get", ip],
            list(FABRIC_ARGV),
            manifest_argv(config.vllm.source),
            list(nvidia_smi.GPUS_ARGV),
        ],
        timeout=60,
    )
    version = docker.version()
    image_id = docker.image_id(config.vllm.image)
    # One node answers for the image (the IDs must match everywhere), in the background: its
    # containers take the longest of all checks, the first time an image is seen.
    image = None
    if image_id is not None and name == config.head.name:
        # In this task run's context, so that image-facts runs as its child (and its cache).
        image = background.submit(contextvars.copy_context().run, image_facts, run, name, image_id)
    background.shutdown(wait=False)
    route, fabric_out, files, gpus = asked.result()
    # "Network is unreachable" (exit 2) is an answer: no address of the node is on that net.
    # A missing or broken `ip` is none: say so, never guess.
    if route.exit_code in (126, 127):
        route = access.runner.run(route.argv, check=False)  # again, for its words
        why = (route.stderr or route.stdout).strip().splitlines()[-1:] or ["no output"]
        raise StepFailed(
            STEP,
            f"could not check the fabric IP {ip} on {name}: `ip route get` exited with code "
            f"{route.exit_code} ({one_line(why[0])}); it comes with iproute2: install it",
        )
    local = route.stdout.startswith("local ")
    fabric = parse_fabric(fabric_out.stdout, ip)
    manifest = parse_manifest(files.stdout, files.exit_code or 0)
    gpu_problem = _gpu_problem(name, gpus)
    facts = image.result() if image else None
    return NodeFacts(
        node=name,
        docker_version=version,
        image_id=image_id,
        model_present=manifest.present,
        waited_s=waited,
        fabric_ip_local=local,
        image_answers=facts.answers if facts and asks_the_image(config) else None,
        image_vllm=facts.vllm if facts else None,
        fabric=fabric,
        weights_bytes=manifest.weights_bytes if manifest.present else None,
        entrypoint=facts.entrypoint if facts else None,
        image_user=facts.user if facts else None,
        model=manifest,
        root_problem=root.result(),
        gpu_problem=gpu_problem,
        gpu_warnings=() if gpu_problem else tuple(nvidia_smi.warnings(gpus.stdout)),
        held=held.result() if held else (),
    )


def _gpu_problem(name: str, gpus: CommandResult) -> str | None:
    """Why the node's GPUs cannot be judged from nvidia-smi's answer, read before anything
    stops (gpus-clear reads it again after the stop); None when they can."""
    said = [line.strip() for line in gpus.stdout.splitlines() if line.strip()]
    if gpus.exit_code not in nvidia_smi.ANSWERED:
        words = one_line(said[-1]) if said else "no output"
        return (
            f"{name}: nvidia-smi failed (exit code {gpus.exit_code}: {words}); the GPUs cannot "
            "be checked, so nothing was stopped. Check the NVIDIA driver (`nvidia-smi` on the "
            "node) and that nvidia-smi is on the login's PATH"
        )
    try:
        listed = nvidia_smi.parse_gpus(gpus.stdout)
    except ValueError as exc:
        return (
            f"{name}: nvidia-smi's answer cannot be read ({one_line(exc)}), so whether its GPUs "
            "are free cannot be told and nothing was stopped. Run `nvidia-smi "
            f"{shlex.join(nvidia_smi.GPUS_ARGV[1:])}` on the node to see what it prints"
        )
    return None if listed else f"{name}: nvidia-smi lists no GPU"


def root_problem(run: Run, name: str) -> str | None:
    """Why the node's login cannot run as root what the run will ask of it there; None when
    it can (it is root, or `sudo -n` allows each command)."""
    commands = root_commands(run.config)
    if not commands:
        return None
    access = run.node(name)
    root = access.root()
    refusal = refused_as_root(access.runner, root, commands)
    if refusal is None:
        return None
    refused = ", ".join(f"`{shlex.join(root.command(c))}`" for c in refusal.commands)
    return (
        f"{name}: stopping the [autostart] units needs root, the login {root.user} is not root, "
        f"and `sudo -n` refuses {refused} ({refusal.reason}). Allow exactly these commands "
        f"there (`sudo visudo -f {SUDOERS_FILE}`) with the line "
        f"`{sudoers_line(root, commands)}`, or log in as root (nodes[].ssh_user)"
    )


def preflight_problems(
    run: Run, facts: list[NodeFacts], syncing: AbstractSet[str] = frozenset()
) -> list[str]:
    """Why nodes are not ready to take the deployment. For the nodes in ``syncing`` (about to get
    the source's image and model), what the copy fixes is not counted."""
    config = run.config
    problems = []
    for f in facts:
        copied = f.node in syncing
        if f.image_id is None and not copied:
            problems.append(
                f"{f.node}: image {config.vllm.image} is not on the node (docker pull it there, "
                'docker save | docker load from another node, or set [sync] image = "auto")'
            )
        elif (
            f.image_answers is not None
            and not copied
            and (refused := refusal(config, f.image_answers))
        ):
            problems.append(f"{f.node}: {refused}")
        if not copied and (refused := loader_refusal(config, f.image_vllm)):
            problems.append(f"{f.node}: {refused}")
        if f.fabric is not None and not f.fabric.rdma_checked:
            problems.append(f"{f.node}: {'; '.join(f.fabric.problems())}")
        if f.fabric is not None:
            node = run.node_config(f.node)
            named = configured_name_problems(f.fabric, node.fabric_interfaces, node.ib_hcas)
            problems += [f"{f.node}: {p}" for p in named]
        if not f.fabric_ip_local:
            ip = run.node_config(f.node).ip
            problems.append(
                f"{f.node}: the fabric IP {ip} is not assigned on the node (addresses set by "
                "hand are lost at reboot): add it again, or fix the node's fabric_ip"
            )
        if f.root_problem:
            problems.append(f.root_problem)
        if f.gpu_problem:
            problems.append(f.gpu_problem)
        if not f.model_present and not copied:
            problems.append(f"{f.node}: the model is not there: {config.vllm.source.where()}")
        elif f.model is not None and not copied and (bad := f.model.link_problems()):
            problems.append(f"{f.node}: {unsafe_links(config, bad)}")
    if config.fabric.rdma == "auto":  # off: NCCL uses TCP, which adapts to any MTU
        problems += mtu_mismatches([port for f in facts for port in _roce_ports(run, f)])
    ids = {f.image_id for f in facts if f.image_id and f.node not in syncing}
    if len(ids) > 1:
        listing = ", ".join(f"{f.node} {str(f.image_id)[:19]}" for f in facts)
        problems.append(
            f"image {config.vllm.image} differs between nodes ({listing}); every node must run "
            "the same build"
        )
    return problems


def held_words(run: Run, plan: LaunchPlan, facts: list[NodeFacts]) -> str | None:
    """Why the group could not bind the plan's ports even once the old stack is stopped."""
    labels = dict(plan.ports)
    held = [k for f in facts for k in f.held if k.listener.port in labels]
    if not held:
        return None
    listed = "; ".join(k.words(labels[k.listener.port]) for k in held)
    return (
        f"{run.config.head.name}: {listed}. stop-autostart would leave it running, so the group "
        "could not bind the port and nothing was stopped. Stop it, add its unit to [autostart] "
        "units or its container to [autostart] containers, or change the port in the "
        "configuration"
    )


def revision_notes(facts: list[NodeFacts]) -> list[str]:
    """The nodes hold unlike revisions of a Hugging Face model (each serves its own, as after
    `hf download` on each node at another time, with [sync] model off)."""
    held = {f.node: f.model.revision for f in facts if f.model is not None and f.model.revision}
    if len(set(held.values())) < 2:
        return []
    listing = ", ".join(f"{node} {revision[:12]}" for node, revision in held.items())
    return [
        f"the nodes hold different revisions of the model ({listing}); each serves its own: "
        'set [sync] model = "auto" to give every node the source\'s, or download one revision'
    ]


def _roce_ports(run: Run, facts: NodeFacts) -> tuple[Port, ...]:
    if facts.fabric is None:
        return ()
    node = run.node_config(facts.node)
    return roce_ports(facts.node, facts.fabric, node.fabric_interfaces, node.ib_hcas)


def launch_plan(run: Run, facts: list[NodeFacts]) -> LaunchPlan:
    """The launch plan for what preflight found: the backend chosen from the image's answers
    (``[vllm] backend``), the loader from its vLLM's (``[vllm] load_format``), each node's
    fabric, the image's ENTRYPOINT."""
    config = run.config
    head = next(f for f in facts if f.node == config.head.name)
    fabric = {
        f.node: NodeFabric.of(f.fabric, run.node_config(f.node), config)
        for f in facts
        if f.fabric is not None
    }
    backend, why = choose(config, head.image_answers or {})
    loader = choose_loader(config, head.image_vllm)
    return plan_for(backend, config, fabric, why, head.entrypoint, loader)


def judge_preflight(run: Run, facts: list[NodeFacts], plan: LaunchPlan) -> None:
    """Fail naming every node that is not ready to take the deployment, and a holder of the
    plan's ports that stop-autostart would leave running."""
    problems = preflight_problems(run, facts)
    if problems:
        raise StepFailed(STEP, "; ".join(problems))
    log().info("preflight ok: %s", ", ".join(f"{f.node} docker {f.docker_version}" for f in facts))
    if held := held_words(run, plan, facts):
        raise StepFailed(STEP, held)
    log().info("launch backend: %s", plan.reason)
    if plan.entrypoint is not None:
        log().info("entrypoint: %s", plan.entrypoint.why())
