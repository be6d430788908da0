"""A real PostgreSQL (Debian's `postgresql` package) on a loopback port with its own data
directory, for a Prefect server on PostgreSQL. Run as root, it runs as the `postgres` OS user
(PostgreSQL refuses root); as anyone else, as that user.

Connections over TCP need the password (scram-sha-256), as on a real controller; the unix
socket lives in the server's own directory (mode 0700), reachable only by its OS user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.testbed.procs import free_port, kill_tree, wait_until

OS_USER = "postgres"


APT_PACKAGE = "postgresql"  # Debian's: the server, its client programs and the postgres user
PROGRAMS = ("initdb", "postgres", "pg_ctl", "pg_isready", "createdb", "psql")


def unavailable() -> str | None:
    """Why no PostgreSQL server can be started here (a reason to skip with), or None."""
    missing = [name for name in PROGRAMS if _find(name) is None]
    if missing:
        return f"PostgreSQL's {', '.join(missing)} not found: apt-get install {APT_PACKAGE}"
    if PostgresServer._as_other_user():
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            return (
                f"running as root and no '{OS_USER}' user to run PostgreSQL as (it refuses "
                f"root): apt-get install {APT_PACKAGE} creates it"
            )
    return None


def pg_program(name: str) -> str:
    found = _find(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: apt-get install {APT_PACKAGE}")
    return found


def _find(name: str) -> str | None:
    """Debian keeps the server programs under /usr/lib/postgresql/<version>/bin, off PATH;
    the newest installed version wins, then PATH."""
    for directory in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True):
        if os.access(f"{directory}/{name}", os.X_OK):
            return f"{directory}/{name}"
    return shutil.which(name)


def _version(directory: str) -> float:
    try:
        return float(Path(directory).parent.name)
    except ValueError:
        return 0.0


@dataclass
class PostgresServer:
    root: Path  # its own directory; the data directory and the socket live below it
    host: str = "127.0.0.1"
    port: int = 0
    user: str = "prefect"
    database: str = "prefect"
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    @property
    def url(self) -> str:
        """What Prefect's PREFECT_SERVER_DATABASE_CONNECTION_URL takes."""
        return (
            f"postgresql+asyncpg://{self.user}:{self.password}@{self.host}:{self.port}/"
            f"{self.database}"
        )

    def start(self) -> PostgresServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.port = self.port or free_port(self.host)
        self._initdb()
        self._postmaster()
        wait_until(self._ready, 30, f"postgres on {self.host}:{self.port}", self.log)
        self._run([pg_program("createdb"), *self._local(), "-O", self.user, self.database])
        return self

    def connections(self) -> int:
        """Open connections to the database, as pg_stat_activity counts them."""
        return int(
            self.query(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{self.database}'")
        )

    def size_mib(self) -> float:
        """The database's size on disk (tables, indexes, TOAST), as PostgreSQL reports it."""
        return int(self.query(f"SELECT pg_database_size('{self.database}')")) / 2**20

    def query(self, sql: str) -> str:
        """One value from ``sql``, through psql over the server's socket."""
        argv = [pg_program("psql"), *self._local(), "-d", self.database, "-Atc", sql]
        return self._run(argv).strip()

    def stop(self) -> None:
        """A fast shutdown (clients disconnected, no waiting for them), then the directory."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self._run([pg_program("pg_ctl"), "stop", "-D", str(self.data), "-m", "fast"])
            kill_tree(self.proc.pid, grace=5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- parts --------------------------------------------------------------------------------

    def _initdb(self) -> None:
        password_file = self.root / "pwfile"
        password_file.write_text(self.password + "\n")
        password_file.chmod(0o600)
        self._give_to_os_user(self.root)
        self._give_to_os_user(password_file)
        self._run(
            [
                pg_program("initdb"),
                "--pgdata",
                str(self.data),
                "--username",
                self.user,
                f"--pwfile={password_file}",
                "--auth-host=scram-sha-256",
                "--auth-local=trust",  # the socket's directory admits only the OS user
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",  # a fresh test cluster: no need to wait for the disk
            ]
        )
        password_file.unlink()

    def _postmaster(self) -> None:
        argv = [
            pg_program("postgres"),
            "-D",
            str(self.data),
            "-c",
            f"listen_addresses={self.host}",
            "-c",
            f"port={self.port}",
            "-c",
            f"unix_socket_directories={self.root}",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives nothing it should not: stop() ends it
                **self._user_kwargs(),
            )

    def _ready(self) -> bool:
        argv = [pg_program("pg_isready"), "-q", "-h", self.host, "-p", str(self.port)]
        return subprocess.run(argv, check=False).returncode == 0

    def _local(self) -> list[str]:
        """Connection options for the unix socket, as the OS user that owns the server."""
        return ["-h", str(self.root), "-p", str(self.port), "-U", self.user]

    def _run(self, argv: list[str]) -> str:
        done = subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=60, **self._user_kwargs()
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}")
        return done.stdout

    # --- the OS user ----------------------------------------------------------------------------

    @staticmethod
    def _as_other_user() -> bool:
        return os.geteuid() == 0

    def _user_kwargs(self) -> dict[str, object]:
        if not self._as_other_user():
            return {}
        entry = pwd.getpwnam(OS_USER)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": entry.pw_dir}
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "env": env}

    def _give_to_os_user(self, path: Path) -> None:
        if self._as_other_user():
            entry = pwd.getpwnam(OS_USER)
            os.chown(path, entry.pw_uid, entry.pw_gid)
