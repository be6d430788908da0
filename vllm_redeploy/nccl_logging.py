"""NCCL's logging in the engine's containers: what the operator asks, raised to what the
transport proof reads.

The proof (:mod:`vllm_redeploy.parsers.nccl_log`) rests on NCCL's ``Using network NAME`` line, an
INFO line of the INIT subsystem. NCCL has one level for everything it prints, so an operator's
``NCCL_DEBUG = "WARN"`` (or VERSION, or a typo, which NCCL reads as none) would hide that line:
the transport would read ``unknown`` and a run that requires RDMA would fail after the whole load.
Instead the level is raised to INFO for INIT and NET only (a few dozen lines per rank), and a
``NCCL_DEBUG_SUBSYS`` of the operator's keeps its subsystems with INIT added (or, for an
exclusion list ``^...``, with INIT and NET no longer excluded). ``NCCL_DEBUG_FILE`` would send
the lines into a file inside the container, out of the proof's reach: the configuration refuses it
(:func:`file_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping

# NCCL's levels that print INFO lines (debug.cc: NONE < VERSION < WARN < INFO < ABORT < TRACE).
_PRINTS_INFO = ("INFO", "ABORT", "TRACE")
_OURS = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
_PROOF = ("INIT", "NET")


def nccl_logging(asked: Mapping[str, str]) -> dict[str, str]:
    """NCCL_DEBUG and NCCL_DEBUG_SUBSYS for the containers, given [vllm.env]."""
    level = asked.get("NCCL_DEBUG")
    subsys = asked.get("NCCL_DEBUG_SUBSYS")
    if level is None and subsys is None:
        return dict(_OURS)
    prints_info = (level or "").strip().upper() in _PRINTS_INFO
    env = {"NCCL_DEBUG": level if prints_info and level else "INFO"}
    if subsys is not None:
        env["NCCL_DEBUG_SUBSYS"] = with_proof(subsys)
    elif not prints_info:  # the operator wanted it quiet: ours is the shortest that proves
        env["NCCL_DEBUG_SUBSYS"] = _OURS["NCCL_DEBUG_SUBSYS"]
    # else NCCL's own default (INIT,BOOTSTRAP,ENV) prints the line
    return env


def with_proof(subsys: str) -> str:
    """A NCCL_DEBUG_SUBSYS value that also prints the proof's subsystems."""
    names = [s.strip() for s in subsys.strip().split(",") if s.strip()]
    if subsys.strip().startswith("^"):
        names[0] = names[0][1:].strip() if names else ""
        kept = [n for n in names if n and n.upper() not in _PROOF]
        return "^" + ",".join(kept) if kept else "ALL"
    if any(n.upper() in ("ALL", "INIT") for n in names):
        return ",".join(names)
    return ",".join([*names, "INIT"])


def notes(asked: Mapping[str, str]) -> list[str]:
    """What runs change of the operator's NCCL logging, for check-config to warn about."""
    given = {k: asked[k] for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS") if k in asked}
    if not given:
        return []
    used = nccl_logging(asked)
    changed = [k for k in given if used.get(k) != given[k]]
    if not changed:
        return []
    said = ", ".join(f"{k} = {given[k]!r}" for k in changed)
    runs = ", ".join(f"{k}={v}" for k, v in used.items())
    return [
        f"[vllm.env] {said} would hide NCCL's INFO line 'Using network ...' of the INIT subsystem, "
        f"which the transport check reads after every launch (without it the transport is "
        f"'unknown' and a run that requires RDMA fails after the whole load): runs use {runs}. "
        "Remove the line to silence this, or set a level that prints INFO (INFO, TRACE) with the "
        "subsystems you want; INIT is always added"
    ]


def file_problem(asked: Mapping[str, str]) -> str | None:
    """Why [vllm.env] cannot set NCCL_DEBUG_FILE, or None."""
    if "NCCL_DEBUG_FILE" not in asked:
        return None
    return (
        "[vllm.env] NCCL_DEBUG_FILE sends NCCL's log lines into a file inside the engine's "
        "containers, where the transport check that follows every launch cannot read them (the "
        "transport would be 'unknown'): remove it; NCCL's lines stay in the engine's log "
        "(`docker logs` of the engine container)"
    )
