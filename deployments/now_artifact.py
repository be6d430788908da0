"""The "cluster now" view in the Prefect UI: one markdown artifact per cluster
(``<cluster>-now``) that the watcher keeps current, so the UI answers "is it up?" without a
terminal. Updated in place (one artifact, not a version per look), when what it shows changes
and once a minute for the time of the last look."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

from deployments.metrics import LookFacts
from vllm_redeploy.names import artifact_key
from vllm_redeploy.safe_text import one_line


def now_markdown(
    cluster: str, facts: LookFacts, problems: tuple[str, ...], last_run: str | None
) -> str:
    """What the watcher saw at its last look, for people."""
    seen = datetime.fromtimestamp(facts.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"# {cluster} now: {facts.verdict}",
        "",
        f"As the watcher saw it at {seen}.",
        "",
        "| node | up |",
        "| --- | --- |",
        *(f"| {node} | {'yes' if up else 'no'} |" for node, up in facts.nodes.items()),
        "",
    ]
    if problems:
        lines += ["Problems:", "", *(f"- {_cell(p)}" for p in problems), ""]
    if last_run:
        lines += [f"Last run: {_cell(last_run)}", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return one_line(text).replace("|", "\\|")


class NowArtifact:
    """The cluster's ``-now`` artifact: found once (a restarted watcher goes on with it),
    then updated in place."""

    def __init__(self, cluster: str) -> None:
        self.key = artifact_key(cluster, "now")
        self.cluster = cluster
        self._id = None
        self._shown: str | None = None

    def show(self, markdown: str, *, again: bool = False) -> None:
        """Put ``markdown`` on the artifact if what it says changed (its first line, the time
        of the look, left out), or ``again``."""
        lines = markdown.split("\n")
        said = "\n".join([lines[0], *lines[3:]])
        if said == self._shown and not again:
            return
        with get_client(sync_client=True) as client:
            if self._id is None:
                found = client.read_latest_artifacts(
                    artifact_filter=ArtifactCollectionFilter(
                        key=ArtifactCollectionFilterKey(any_=[self.key])
                    ),
                    limit=1,
                )
                self._id = found[0].latest_id if found else None
            if self._id is None:
                self._id = client.create_artifact(
                    ArtifactCreate(
                        key=self.key,
                        type="markdown",
                        data=markdown,
                        description=f"{self.cluster} as the watcher sees it now",
                    )
                ).id
            else:
                client.update_artifact(self._id, ArtifactUpdate(data=markdown))
        self._shown = said
