"""Which Prefect API a command talks to: the controller's (vllm_redeploy.controller_api finds
it), set for Prefect's client before the command uses it; or a refusal in one paragraph, never
Prefect's quiet temporary API. Only `run --temporary-api` asks for that one, and says so first.

Prefect's own settings come first: PREFECT_API_URL in the environment, else in ./.env,
./prefect.toml or the active Prefect profile (~/.prefect/profiles.toml): each is the person's
explicit choice. Then the cluster's env file and the installed units (controller_api).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from deployments.cli.common import EXIT_CONTROLLER, err
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.config.loading import cluster_env_file
from vllm_redeploy.controller_api import (
    AUTH_VARIABLE,
    ENVIRONMENT,
    URL_VARIABLE,
    ControllerApi,
    how_to_point,
    nothing_found,
    problem_with,
    same_url,
    services_api,
    unit_dirs,
    with_services_auth,
)
from vllm_redeploy.safe_text import for_terminal, shown

TemporaryApiOption = Annotated[
    bool,
    typer.Option(
        "--temporary-api",
        help="Run on a throwaway Prefect API of this process, which the controller's services "
        "do not see: a pause does not hold it back, the cluster's lock does not keep other runs "
        "off. Without it, run refuses when it finds no Prefect API.",
    ),
]

TEMPORARY_NOTICE = (
    "warning: temporary Prefect API (--temporary-api): this run is on a throwaway Prefect API "
    "of its own, which the controller's services do not see: `vllm-redeploy pause` does not "
    "hold it back, and the cluster's lock does not keep other runs off the nodes while it runs "
    "(nor it off theirs); its flow run and logs are gone when it ends."
)

# What a command would do on a temporary API, for its refusal.
_WITHOUT = {
    "run": "Without one, Prefect would run it on a temporary API that the controller's services "
    "never see: `vllm-redeploy pause` would not hold it back, and the cluster's lock would not "
    "keep other runs off the nodes.",
    "pause": "Without one, the pause would go to a temporary Prefect API that the controller's "
    "services never see, and nothing would be paused; pause never uses one.",
    "stop": "Without one, the stop would run outside the cluster's lock, beside a run that "
    "holds it; stop never uses one.",
    "runs": "The runs are kept by the controller's Prefect API; runs never starts one.",
    "resume": "Without one, the resume would go to a temporary Prefect API that the controller's "
    "services never see, and nothing would be resumed; resume never uses one.",
}
_TEMPORARY_FIX = "; or, for this one run only, add --temporary-api (a throwaway Prefect API)"


@dataclass(frozen=True)
class Found:
    """The API the clusters' commands use, or why there is none (and the file to fix)."""

    api: ControllerApi | None
    problem: str | None = None
    env_file: Path | None = None

    def fix(self) -> str:
        return how_to_point(self.env_file or Path("CLUSTER.env"))


def find_api(clusters: Sequence[ClusterConfig], paths: Sequence[Path]) -> Found:
    """The controller's API for these clusters (one process talks to one API)."""
    configured = prefect_settings_api()
    dirs = unit_dirs(os.environ)
    chosen: list[tuple[str, ControllerApi]] = []
    for cluster, path in zip(clusters, paths, strict=True):
        env_file = cluster_env_file(path)
        lookup = services_api(cluster.name, env_file, dirs)
        api = with_services_auth(configured, lookup.api) if configured else lookup.api
        if api is None:
            return Found(None, nothing_found(cluster.name, env_file, dirs, lookup.unread), env_file)
        chosen.append((cluster.name, api))
    first = chosen[0][1]
    if any(not same_url(api.url, first.url) for _, api in chosen):
        named = "; ".join(f"{shown(name)}: {api.described()}" for name, api in chosen)
        return Found(
            None,
            f"the clusters name different Prefect APIs ({named}), and one process talks to one",
            cluster_env_file(paths[0]),
        )
    return Found(first)


def prefect_settings_api() -> ControllerApi | None:
    """The API Prefect's own settings name, with their auth string: the environment, else
    ./.env, ./prefect.toml, pyproject.toml or the active profile."""
    url = os.environ.get(URL_VARIABLE)
    if url:
        auth = os.environ.get(AUTH_VARIABLE) or None
        return ControllerApi(url, ENVIRONMENT, auth, "the environment" if auth else None)
    from prefect.context import get_settings_context

    context = get_settings_context()
    api = context.settings.api
    if not api.url:
        return None
    auth = api.auth_string.get_secret_value() if api.auth_string else None
    profile = context.profile
    in_profile = any(getattr(k, "name", k) == URL_VARIABLE for k in profile.settings)
    source = (
        f"{URL_VARIABLE} of the Prefect profile {shown(profile.name)} in {shown(profile.source)}"
        if in_profile
        else f"{URL_VARIABLE} in Prefect's settings (./.env, ./prefect.toml or ./pyproject.toml)"
    )
    return ControllerApi(api.url, source, auth, "Prefect's settings" if auth else None)


def api_key() -> str | None:
    """Prefect Cloud's API key, when Prefect's settings hold one (for the check's request)."""
    if "prefect" not in sys.modules and not os.environ.get("PREFECT_API_KEY"):
        return None
    from prefect.settings import get_current_settings

    key = get_current_settings().api.key
    return key.get_secret_value() if key else None


@contextlib.contextmanager
def talking_to(values: Mapping[str, str | None]) -> Iterator[None]:
    """Prefect's client uses ``values`` (PREFECT_API_URL, ...; None: unset) inside; as before
    afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _refresh_prefect()


def _refresh_prefect() -> None:
    """Prefect reads its settings when first imported; later changes need a refresh."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


@contextlib.contextmanager
def controller_or_exit(
    clusters: Sequence[ClusterConfig], paths: Sequence[Path], command: str, *, check: bool = True
) -> Iterator[ControllerApi]:
    """The controller's API set for Prefect's client inside, or exit 3 naming the fix: none is
    found, or it does not answer or refuses us (``check``)."""
    found = find_api(clusters, paths)
    if found.api is None:
        refuse(found, command)
    api = found.api
    if check and (problem := problem_with(api, api_key())) is not None:
        say(problem)
        raise typer.Exit(EXIT_CONTROLLER)
    if api.source != ENVIRONMENT:
        say(f"Prefect API: {api.url} ({api.source})")
    with talking_to(api.environment()):
        yield api


def refuse(found: Found, command: str) -> NoReturn:
    """Exit 3 with one paragraph: what was looked for, what it would do without, the fix."""
    without = _WITHOUT.get(command, "Without one, Prefect would start a temporary API of this "
                           "process that nothing else sees.")  # fmt: skip
    fix = found.fix() + (_TEMPORARY_FIX if command == "run" else "") + "."
    say(f"{found.problem} {without} {fix}")
    raise typer.Exit(EXIT_CONTROLLER)


# Prefect gives its temporary API 20 s to come up; on a busy controller (its database made
# from nothing, the migrations run) that is not always enough. Prefect's own setting, when
# the environment sets it, still wins.
TEMPORARY_START_S = 120
START_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


@contextlib.contextmanager
def temporary_api(clusters: Sequence[ClusterConfig], paths: Sequence[Path]) -> Iterator[None]:
    """A throwaway Prefect API of this process, said first. Started here rather than left to
    Prefect's client, so that one that does not come up is a paragraph, not a traceback, and
    it takes the place of an API that Prefect's settings still name (a profile,
    ./prefect.toml)."""
    found = find_api(clusters, paths)
    unused = f" Not used: {found.api.described()}." if found.api is not None else ""
    say(TEMPORARY_NOTICE + unused)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    try:
        # Stopped when the process exits.
        server.start(timeout=None if os.environ.get(START_VARIABLE) else TEMPORARY_START_S)
    except RuntimeError as exc:
        detail = str(exc).split(" stdout:", 1)[0].rstrip(".")
        say(
            f"The temporary Prefect API did not come up ({shown(detail)}), so nothing was run "
            f"and no node was touched. Try again once the controller is less busy, or point "
            f"the command at the controller's Prefect API ({URL_VARIABLE}) instead of "
            f"--temporary-api."
        )
        raise typer.Exit(EXIT_CONTROLLER) from None
    with talking_to({URL_VARIABLE: server.api_url}):
        yield


def say(line: str) -> None:
    err.print(for_terminal(line), markup=False, highlight=False, soft_wrap=True)
