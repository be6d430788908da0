"""The reference: bench/reference_runbook.sh (the operator's steps with ssh and docker) timed on
the same bed, with the same stand-in settings as the flow's runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.measure import read_events, stand_in_env, write_config
from tests.testbed.bed import TestBed

SCRIPT = Path(__file__).resolve().parent / "reference_runbook.sh"


@dataclass(frozen=True)
class ReferenceRun:
    poll_s: float
    load_s: float
    wall_s: float  # from the script's first step to the probe's answer
    marks: dict[str, float]  # step -> unix time it was done
    listening: float | None

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.load_s

    @property
    def ready_lag_s(self) -> float | None:
        return self.marks["ready"] - self.listening if self.listening else None


def parse_marks(stdout: str) -> dict[str, float]:
    marks = {}
    for line in stdout.splitlines():
        if line.startswith("@@ "):
            _, stamp, step = line.split(maxsplit=2)
            marks[step] = float(stamp)
    return marks


def reference(bed: TestBed, tag: str, load_s: float, poll_s: float) -> ReferenceRun:
    env = stand_in_env(bed, tag, load_s)
    config = write_config(bed, tag, env)
    argv = [str(SCRIPT), str(config), f"{poll_s:g}"]
    started = time.time()
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} exited {done.returncode}:\n{done.stderr[-2000:]}")
    marks = parse_marks(done.stdout)
    wall = marks["probe"] - marks.get("begin", started)
    listening = read_events(Path(env["VRD_EVENT_LOG"])).get("listening")
    return ReferenceRun(poll_s, load_s, wall, marks, listening)
