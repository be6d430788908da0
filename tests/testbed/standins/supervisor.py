"""What systemd does for one started service, for the ``systemctl`` stand-in.

``systemctl start`` runs ``python supervisor.py RUN_DIR UNIT`` detached, inside the node's mount
namespace. It runs ExecStartPre=, ExecStart=, ExecStartPost= with the unit's environment (the
manager's DefaultEnvironment=, User='s HOME/USER/LOGNAME/SHELL, Environment=, EnvironmentFile=),
sends their output to the node's journal, records the state (``RUN_DIR/units/UNIT.json``),
restarts as Restart= says (within StartLimitBurst= per StartLimitIntervalSec=), and on a stop
request (``UNIT.stop``) runs ExecStop= with $MAINPID, then SIGTERM, then SIGKILL after
TimeoutStopSec=. Processes run as root on the bed; User= must still name an existing user.
The run directory is in its argv, so the bed finds it at power-off (and a later session does,
after a killed one).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

try:
    from . import journal, units
except ImportError:  # run as a plain script, as systemctl starts it
    import journal  # type: ignore[no-redef]
    import units  # type: ignore[no-redef]

CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)
STATUS_NAMES = {0: "SUCCESS", 1: "FAILURE", 2: "INVALIDARGUMENT", 3: "NOTIMPLEMENTED",
                4: "NOPERMISSION", 5: "NOTINSTALLED", 6: "NOTCONFIGURED", 7: "NOTRUNNING",
                200: "CHDIR", 203: "EXEC", 217: "USER"}  # fmt: skip
EXIT_EXEC, EXIT_CHDIR, EXIT_USER = 203, 200, 217
POLL_S = 0.05


class Failed(Exception):
    """The start failed; ``result`` is systemd's word for why (exit-code, resources, ...)."""

    def __init__(self, result: str) -> None:
        super().__init__(result)
        self.result = result


def describe_exit(code: int) -> str:
    """``code=exited, status=1/FAILURE`` or ``code=killed, status=15/TERM``, as systemd."""
    if code < 0:
        return f"code=killed, status={-code}/{signal.Signals(-code).name.removeprefix('SIG')}"
    return f"code=exited, status={code}/{STATUS_NAMES.get(code, 'n/a')}"


class Supervisor:
    def __init__(self, runtime: units.Runtime, name: str) -> None:
        self.runtime, self.name = runtime, name
        state = runtime.state(name) or {}
        self.unit = units.Unit.from_json(state["unit"])
        self.starts: list[float] = list(state.get("starts", []))
        self.pumps: dict[int, threading.Thread] = {}

    # --- state and journal ------------------------------------------------------------------

    def set(self, active: str, sub: str, **extra: Any) -> None:
        with self.runtime.locked():
            state = self.runtime.state(self.name) or {}
            if state.get("active") != active:
                extra.setdefault("since", time.time())
            state.update(active=active, sub=sub, supervisor=os.getpid(), **extra)
            self.runtime.set_state(self.name, state)

    def log(self, message: str) -> None:
        journal.manager(self.name, message)

    def stop_requested(self) -> bool:
        return self.runtime.stop_file(self.name).exists()

    # --- processes ----------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        env = {"PATH": units.EXEC_PATH, **units.default_environment()}
        env["INVOCATION_ID"] = uuid.uuid4().hex
        if self.unit.user:
            try:
                entry = pwd.getpwnam(self.unit.user)
            except KeyError:
                self.log(f"{self.name}: Failed to determine user credentials: No such process")
                self.log(f"{self.name}: Failed at step USER spawning: No such process")
                raise Failed("exit-code") from None
            env.update(
                HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name, SHELL=entry.pw_shell
            )
        for assignment in self.unit.environment:
            key, sep, value = assignment.partition("=")
            if sep:
                env[key] = value
        for spec in self.unit.environment_files:
            optional, path = spec.startswith("-"), spec.removeprefix("-")
            try:
                env.update(units.parse_env_file(Path(path).read_text()))
            except OSError as exc:
                if optional:
                    continue
                self.log(f"{self.name}: Failed to load environment files: {exc.strerror}")
                self.log(f"{self.name}: Failed to run 'start-pre' task: {exc.strerror}")
                raise Failed("resources") from None
        return env

    def spawn(self, command: units.Command, env: dict[str, str]) -> subprocess.Popen[bytes]:
        argv = command.resolved(env)
        cwd = self.unit.working_directory.removeprefix("-") or "/"
        if cwd == "~":
            cwd = env.get("HOME", "/")
        if not Path(cwd).is_dir():
            if self.unit.working_directory.startswith("-"):
                cwd = "/"
            else:
                self.log(f"{self.name}: Changing to the requested working directory failed")
                raise OSError(EXIT_CHDIR, "chdir")
        proc = subprocess.Popen(
            [command.argv0 or argv[0], *argv[1:]],
            executable=argv[0],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: the unit's processes, to signal
        )
        ident = Path(command.argv0 or argv[0]).name
        pump = threading.Thread(target=self._pump, args=(proc, ident), daemon=True)
        pump.start()
        self.pumps[proc.pid] = pump
        return proc

    def _pump(self, proc: subprocess.Popen[bytes], ident: str) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            journal.append(self.name, ident, proc.pid, raw.decode(errors="replace").rstrip("\n"))

    def drained(self, proc: subprocess.Popen[bytes]) -> None:
        """Its last lines are in the journal before what the manager logs about its end (a
        child that keeps the pipe open gets a second)."""
        pump = self.pumps.pop(proc.pid, None)
        if pump is not None:
            pump.join(1.0)

    def start_process(self, command: units.Command, env: dict[str, str]) -> subprocess.Popen[bytes]:
        try:
            return self.spawn(command, env)
        except OSError as exc:
            code = EXIT_CHDIR if exc.errno == EXIT_CHDIR else EXIT_EXEC
            if code == EXIT_EXEC:
                self.log(f"{self.name}: Failed to execute {command.argv[0]}: {exc.strerror}")
            self.log(f"{self.name}: Main process exited, {describe_exit(code)}")
            raise Failed("exit-code") from None

    def succeeded(self, code: int, command: units.Command | None = None) -> bool:
        if command is not None and command.ignore_failure:
            return True
        if code < 0:
            return signal.Signals(-code) in CLEAN_SIGNALS
        return code == 0 or code in self.unit.success_exit_status

    def control(self, key: str, env: dict[str, str], timeout: float = float("inf")) -> None:
        """Run the commands of ``key`` one after another; fail on the first that fails (a
        oneshot's ExecStart= are its main processes, the others control processes)."""
        kind = "Main" if key == "exec_start" else "Control"
        for command in self.unit.commands(key):
            proc = self.start_process(command, env)
            code = self._wait(proc, timeout)
            self.drained(proc)
            if not self.succeeded(code, command):
                self.log(f"{self.name}: {kind} process exited, {describe_exit(code)}")
                raise Failed("exit-code")

    def _wait(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return proc.wait(None if timeout == float("inf") else timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    # --- the life of the unit -----------------------------------------------------------------

    def run(self) -> None:
        while True:
            now = time.time()
            self.starts = [t for t in self.starts if now - t < self.unit.start_limit_interval_sec]
            if len(self.starts) >= self.unit.start_limit_burst:
                self.log(f"{self.name}: Start request repeated too quickly.")
                self.fail("start-limit-hit")
                return
            self.starts.append(now)
            self.set("activating", "start-pre", starts=self.starts, result="success")
            outcome = self.run_once()
            if outcome is None or not self.restarts(outcome):
                return
            restarts = len(self.starts)
            self.set("activating", "auto-restart")
            deadline = time.monotonic() + self.unit.restart_sec
            while time.monotonic() < deadline:
                if self.stop_requested():
                    self.finish("inactive", "dead", "success", stopped=True)
                    return
                time.sleep(POLL_S)
            self.log(f"{self.name}: Scheduled restart job, restart counter is at {restarts}.")

    def restarts(self, outcome: str) -> bool:
        policy = self.unit.restart
        if outcome == "success":
            return policy in ("always", "on-success")
        if outcome in ("signal", "core-dump"):
            return policy in ("always", "on-failure", "on-abnormal", "on-abort")
        return policy in ("always", "on-failure") or (
            policy == "on-abnormal" and outcome == "timeout"
        )

    def run_once(self) -> str | None:
        """One start; returns how the main process ended, None when stopped or not started."""
        self.log(f"Starting {self.unit.title}...")
        try:
            env = self.environment()
            self.control("exec_start_pre", env, self.unit.timeout_start_sec)
            if self.unit.type == "oneshot":
                self.set("activating", "start")
                self.control("exec_start", env, self.unit.timeout_start_sec)
                return self.after_main(env, None, 0)
            command = self.unit.commands("exec_start")[0]
            self.set("activating", "start", forked=self.unit.type == "simple")
            proc = self.start_process(command, env)
            self.set("active", "running", main_pid=proc.pid, forked=True)
            self.control("exec_start_post", env, self.unit.timeout_start_sec)
        except Failed as failure:
            self.fail(failure.result, started=False)
            return failure.result
        self.log(f"Started {self.unit.title}.")
        while (code := proc.poll()) is None:
            if self.stop_requested():
                self.stop(proc, env)
                return None
            time.sleep(POLL_S)
        self.drained(proc)
        self.log(f"{self.name}: Main process exited, {describe_exit(code)}")
        return self.after_main(env, proc, code, command)

    def after_main(
        self,
        env: dict[str, str],
        proc: subprocess.Popen[bytes] | None,
        code: int,
        command: units.Command | None = None,
    ) -> str | None:
        if not self.succeeded(code, command):
            result = "signal" if code < 0 else "exit-code"
            self.fail(result, code=code)
            return result
        if not self.unit.remain_after_exit:
            self.log(f"{self.name}: Deactivated successfully.")
            if proc is None:
                self.log(f"Finished {self.unit.title}.")
            self.finish("inactive", "dead", "success", code=code)
            return "success"
        self.set("active", "exited", exit_status=code, main_pid=0)
        if proc is None:
            self.log(f"Finished {self.unit.title}.")
        while not self.stop_requested():
            time.sleep(0.2)  # idle: nothing runs, only ExecStop= is left for a stop
        self.stop(None, env)
        return None

    def stop(self, proc: subprocess.Popen[bytes] | None, env: dict[str, str]) -> None:
        self.set("deactivating", "stop")
        self.log(f"Stopping {self.unit.title}...")
        result = "success"
        stop_env = {**env, "MAINPID": str(proc.pid if proc else "")}
        deadline = time.monotonic() + self.unit.timeout_stop_sec
        with contextlib.suppress(Failed):
            self.control("exec_stop", stop_env, self.unit.timeout_stop_sec)
        code = 0
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{self.name}: State 'stop-sigterm' timed out. Killing.")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                code, result = proc.wait(), "timeout"
            self.drained(proc)
            if code != -signal.SIGTERM:
                self.log(f"{self.name}: Main process exited, {describe_exit(code)}")
            if result == "success" and not self.succeeded(code):
                result = "exit-code"
        if result == "success":
            self.log(f"{self.name}: Deactivated successfully.")
            self.log(f"Stopped {self.unit.title}.")
            self.finish("inactive", "dead", "success", code=code, stopped=True)
        else:
            self.log(f"{self.name}: Failed with result '{result}'.")
            self.log(f"Stopped {self.unit.title}.")
            self.finish("failed", "failed", result, code=code, stopped=True)

    def fail(self, result: str, code: int | None = None, started: bool = True) -> None:
        self.log(f"{self.name}: Failed with result '{result}'.")
        if not started or result == "start-limit-hit":
            self.log(f"Failed to start {self.unit.title}.")
        will_restart = result != "start-limit-hit" and self.restarts(result)
        if not will_restart:
            self.finish("failed", "failed", result, code=code)
        else:
            self.set("activating", "auto-restart", result=result, exit_status=code)

    def finish(
        self, active: str, sub: str, result: str, code: int | None = None, stopped: bool = False
    ) -> None:
        self.set(active, sub, result=result, exit_status=code, main_pid=0, done=True)
        if stopped:
            self.runtime.stop_file(self.name).unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    runtime = units.Runtime(Path(argv[0]))
    Supervisor(runtime, argv[1]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
