"""A node's system memory, emulated, and rendered as the node's /proc/meminfo.

On a DGX Spark (GB10) the GPU allocates from system memory, so what vLLM, Ray's memory monitor
and an operator see there is this model. Files, in the node's GPU state directory (the stand-ins
find it, see standins/gpu_state.py):

- ``memory.json``: the total, what the kernel and the system hold, named consumers, the page
  cache; it names the node's meminfo file (bind-mounted over /proc/meminfo in the node's mount
  namespace, tests.testbed.namespace) and its drop_caches file (over /proc/sys/vm/drop_caches);
- ``memory.d/<token>.json``: memory a live process holds, kept with an exclusive ``flock`` as in
  gpu_state: when the process dies, however, its memory is back;
- ``memory.lock``: serialises changes.

Every change renders meminfo at once. The node's watcher (:func:`watch`, run by the namespace
holder) drops the page cache when 1 or 3 is written to drop_caches and renders again when a
holding process dies. Allocations reclaim page cache as the kernel does; when nothing is left to
reclaim they fail with :class:`OutOfMemory` (the kernel's OOM killer would end the process).

Standard library only: the vLLM stand-in uses it inside containers and Ray workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL, HOLDINGS, LOCK = "memory.json", "memory.d", "memory.lock"
KIB_PER_GIB = 1024 * 1024


class OutOfMemory(Exception):
    """Nothing left to reclaim: the kernel's OOM killer ends the process that asked."""


@dataclass
class State:
    """What memory.json holds."""

    profile: str
    unified: bool  # the GPU allocates from this memory (GB10)
    total_kib: int
    reserved_kib: int  # held since boot outside every meminfo field (firmware, driver carve-outs)
    used: dict[str, int]  # named consumers' anonymous memory, in KiB ("system": the OS itself)
    cached_kib: int  # page cache, shmem and mapped files included
    shmem_kib: int
    mapped_kib: int  # file pages programs have mapped: a drop leaves them
    buffers_kib: int
    sreclaimable_kib: int
    sunreclaim_kib: int
    kernel_stack_kib: int
    page_tables_kib: int
    meminfo: str = ""
    drop_caches: str = ""


# Just after boot. GB10: 121.63 GiB total as Ray and `free` report it on a Spark, about 101.6 GiB
# MemAvailable (BRIEF). H200 hosts: 2 TiB, mostly free.
BOOT = {
    "gb10": State(
        profile="gb10",
        unified=True,
        total_kib=127_535_084,
        reserved_kib=16_850_000,
        used={"system": 3_400_000},
        cached_kib=1_350_000,
        shmem_kib=60_000,
        mapped_kib=350_000,
        buffers_kib=12_000,
        sreclaimable_kib=300_000,
        sunreclaim_kib=420_000,
        kernel_stack_kib=30_000,
        page_tables_kib=60_000,
    ),
    "h200": State(
        profile="h200",
        unified=False,
        total_kib=2_113_350_412,
        reserved_kib=2_400_000,
        used={"system": 9_000_000},
        cached_kib=4_500_000,
        shmem_kib=300_000,
        mapped_kib=600_000,
        buffers_kib=200_000,
        sreclaimable_kib=1_200_000,
        sunreclaim_kib=1_500_000,
        kernel_stack_kib=60_000,
        page_tables_kib=150_000,
    ),
}


@dataclass(frozen=True)
class Usage:
    """The model at one moment, with the memory live processes hold."""

    state: State
    held: dict[str, int] = field(default_factory=dict)  # holding token -> KiB

    @property
    def total_kib(self) -> int:
        return self.state.total_kib

    @property
    def used_kib(self) -> int:
        """What consumers hold: named ones and live processes."""
        return sum(self.state.used.values()) + sum(self.held.values())

    @property
    def cached_kib(self) -> int:
        return self.state.cached_kib

    @property
    def kernel_kib(self) -> int:
        s = self.state
        return (
            s.reserved_kib
            + s.sreclaimable_kib
            + s.sunreclaim_kib
            + s.kernel_stack_kib
            + s.page_tables_kib
        )

    @property
    def free_kib(self) -> int:
        s = self.state
        return s.total_kib - self.used_kib - self.kernel_kib - s.cached_kib - s.buffers_kib

    @property
    def watermarks(self) -> tuple[int, int, int]:
        """min, low, high in KiB, as the kernel derives them from min_free_kbytes."""
        least = min(max(int(math.sqrt(self.total_kib * 16)), 128), 262_144)
        return least, least + least // 4, least + least // 2

    @property
    def file_lru_kib(self) -> int:
        return self.state.cached_kib - self.state.shmem_kib + self.state.buffers_kib

    @property
    def available_kib(self) -> int:
        """MemAvailable by the kernel's formula (si_mem_available)."""
        _, low, high = self.watermarks
        available = self.free_kib - high
        pagecache = self.file_lru_kib
        available += pagecache - min(pagecache // 2, low)
        slab = self.state.sreclaimable_kib
        available += slab - min(slab // 2, low)
        return max(available, 0)

    def meminfo(self) -> str:
        return render(self)


def render(usage: Usage) -> str:
    """/proc/meminfo in this kernel's layout (6.x); arm64 (GB10) has CMA and no DirectMap."""
    s = usage.state
    anon = sum(s.used.values())
    active_anon = anon // 50
    file_lru = usage.file_lru_kib
    active_file = file_lru * 2 // 5
    inactive_anon = anon - active_anon + s.shmem_kib
    arm64 = s.profile == "gb10"
    rows: list[tuple[str, int | None]] = [
        ("MemTotal", s.total_kib),
        ("MemFree", usage.free_kib),
        ("MemAvailable", usage.available_kib),
        ("Buffers", s.buffers_kib),
        ("Cached", s.cached_kib),
        ("SwapCached", 0),
        ("Active", active_anon + active_file),
        ("Inactive", inactive_anon + file_lru - active_file),
        ("Active(anon)", active_anon),
        ("Inactive(anon)", inactive_anon),
        ("Active(file)", active_file),
        ("Inactive(file)", file_lru - active_file),
        ("Unevictable", 12_136),
        ("Mlocked", 11_216),
        ("SwapTotal", 0),
        ("SwapFree", 0),
        ("Zswap", 0),
        ("Zswapped", 0),
        ("Dirty", 1_756),
        ("Writeback", 0),
        ("AnonPages", anon),
        ("Mapped", s.mapped_kib),
        ("Shmem", s.shmem_kib),
        ("KReclaimable", s.sreclaimable_kib),
        ("Slab", s.sreclaimable_kib + s.sunreclaim_kib),
        ("SReclaimable", s.sreclaimable_kib),
        ("SUnreclaim", s.sunreclaim_kib),
        ("KernelStack", s.kernel_stack_kib),
        ("PageTables", s.page_tables_kib),
        ("SecPageTables", 0),
        ("NFS_Unstable", 0),
        ("Bounce", 0),
        ("WritebackTmp", 0),
        ("CommitLimit", s.total_kib // 2),  # no swap, vm.overcommit_ratio 50
        ("Committed_AS", anon * 4 + sum(usage.held.values())),
        ("VmallocTotal", 133_141_626_880 if arm64 else 34_359_738_367),
        ("VmallocUsed", 29_068),
        ("VmallocChunk", 0),
        ("Percpu", 7_544),
        ("AnonHugePages", 0),
        ("ShmemHugePages", 0),
        ("ShmemPmdMapped", 0),
        ("FileHugePages", 0),
        ("FilePmdMapped", 0),
        *([("CmaTotal", 131_072), ("CmaFree", 69_320)] if arm64 else []),
        ("HugePages_Total", None),
        ("HugePages_Free", None),
        ("HugePages_Rsvd", None),
        ("HugePages_Surp", None),
        ("Hugepagesize", 2_048),
        ("Hugetlb", 0),
    ]
    if not arm64:
        gib = 1 << 20
        rows += [
            ("DirectMap4k", 28_672),
            ("DirectMap2M", 2_068_480),
            ("DirectMap1G", (s.total_kib // gib + 2) * gib),
        ]
    # The kernel pads names to 16 columns and values to 8 (show_val_kb); HugePages_* are counts.
    return "".join(
        f"{name + ':':<16}{0 if value is None else value:>8}{'' if value is None else ' kB'}\n"
        for name, value in rows
    )


class NodeMemory:
    """One node's memory model, in ``directory`` (the node's GPU state directory)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    @property
    def model(self) -> Path:
        return self.directory / MODEL

    def exists(self) -> bool:
        return self.model.exists()

    # --- life cycle ---------------------------------------------------------------------------

    def create(self, profile: str, meminfo: Path, drop_caches: Path) -> None:
        if profile not in BOOT:
            raise ValueError(f"no memory profile {profile!r}; one of {sorted(BOOT)}")
        (self.directory / HOLDINGS).mkdir(parents=True, exist_ok=True)
        meminfo.parent.mkdir(parents=True, exist_ok=True)
        drop_caches.parent.mkdir(parents=True, exist_ok=True)
        meminfo.touch(mode=0o444)
        drop_caches.touch(mode=0o200)
        state = State(**asdict(BOOT[profile]))
        state.meminfo, state.drop_caches = str(meminfo), str(drop_caches)
        with self._locked():
            self._save(state)
            self._render(Usage(state))

    def boot(self) -> None:
        """Power on: memory as just after boot (the system's own page cache only, no process
        of before)."""
        with self._locked():
            old = self._load()
            state = State(**asdict(BOOT[old.profile]))
            state.meminfo, state.drop_caches = old.meminfo, old.drop_caches
            for path in (self.directory / HOLDINGS).glob("*.json"):
                path.unlink(missing_ok=True)
            Path(state.drop_caches).write_text("")
            self._save(state)
            self._render(Usage(state))

    # --- reading ------------------------------------------------------------------------------

    def usage(self) -> Usage:
        with self._locked():
            return self._usage()

    def total_kib(self) -> int:
        return self.usage().total_kib

    def free_kib(self) -> int:
        """MemFree: what is free without dropping any page cache."""
        return self.usage().free_kib

    def available_kib(self) -> int:
        return self.usage().available_kib

    def cached_kib(self) -> int:
        return self.usage().cached_kib

    def used_kib(self) -> int:
        return self.usage().used_kib

    def meminfo(self) -> str:
        return self.usage().meminfo()

    @property
    def unified(self) -> bool:
        return self.usage().state.unified

    # --- changing -----------------------------------------------------------------------------

    def fill_cache(self, gib: float) -> None:
        """What reading ``gib`` of files (the last model load) leaves in the page cache."""
        self.add_cache(int(gib * KIB_PER_GIB))

    def add_cache(self, kib: int) -> None:
        def grow(state: State) -> None:
            state.cached_kib += kib

        self._change(grow)

    def set_used(self, name: str, gib: float) -> None:
        """A consumer that is no GPU process (a desktop app, a build) holds ``gib`` from now."""

        def use(state: State) -> None:
            state.used[name] = int(gib * KIB_PER_GIB)

        self._change(use, check=True)

    def release(self, name: str) -> None:
        def drop(state: State) -> None:
            state.used.pop(name, None)

        self._change(drop)

    def drop_caches(self, mode: int) -> None:
        """`echo MODE > /proc/sys/vm/drop_caches`: 1 the clean page cache, 2 slab, 3 both."""

        def drop(state: State) -> None:
            if mode & 1:
                state.cached_kib = min(state.cached_kib, state.shmem_kib + state.mapped_kib)
            if mode & 2:
                state.sreclaimable_kib //= 4

        if mode in (1, 2, 3):
            self._change(drop)

    def hold(self, name: str, kib: int) -> Holding:
        """This process holds ``kib`` until it releases it or dies."""
        return Holding(self, name, kib)

    def refresh(self) -> None:
        """Notice holders that died: reading the model renders meminfo again if one did."""
        with self._locked():
            self._usage()

    def poll(self, drop: Path) -> None:
        """One round of the node's watcher: serve a write to ``drop`` (its drop_caches), then
        look for holders that died (changes otherwise render themselves)."""
        with contextlib.suppress(OSError):
            if drop.stat().st_size:
                request = drop.read_text().strip()
                os.truncate(drop, 0)
                with contextlib.suppress(ValueError):
                    self.drop_caches(int(request))
        if any((self.directory / HOLDINGS).iterdir()):
            self.refresh()

    # --- internals ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self) -> State:
        return State(**json.loads(self.model.read_text()))  # replaced whole: no lock to read

    def _save(self, state: State) -> None:
        tmp = self.model.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=1))
        tmp.replace(self.model)

    def _usage(self) -> Usage:
        held, pruned = _live_holdings(self.directory / HOLDINGS)
        usage = Usage(self._load(), held)
        if pruned:  # a holder died: what meminfo says is out of date
            self._render(usage)
        return usage

    def _change(self, change: Callable[[State], None], check: bool = False) -> None:
        with self._locked():
            usage = self._usage()
            change(usage.state)
            usage = _reclaim(usage)
            if check and usage.free_kib < usage.watermarks[0]:
                raise OutOfMemory(f"{usage.free_kib} KiB would be free")
            self._save(usage.state)
            self._render(usage)

    def _resize(self, holding: Holding, kib: int) -> None:
        with self._locked():
            before = _read_holding(holding.path)
            holding.write(kib)
            usage = _reclaim(self._usage())
            if usage.free_kib < usage.watermarks[0]:
                holding.write(before)
                raise OutOfMemory(
                    f"{holding.name}: {kib} KiB asked, {usage.free_kib + kib - before} KiB left"
                )
            self._save(usage.state)
            self._render(usage)

    def _render(self, usage: Usage) -> None:
        if usage.state.meminfo:
            _write_in_place(Path(usage.state.meminfo), usage.meminfo())


def _reclaim(usage: Usage) -> Usage:
    """Evict clean page cache until MemFree is back at the high watermark, as kswapd would."""
    short = usage.watermarks[2] - usage.free_kib
    state = usage.state
    reclaimable = state.cached_kib - state.shmem_kib - state.mapped_kib
    if short > 0 and reclaimable > 0:
        state.cached_kib -= min(short, reclaimable)
    return usage


def _write_in_place(path: Path, text: str) -> None:
    # Never replace the file: the node's namespace bind-mounts this very inode over /proc/meminfo.
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o444)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class Holding:
    """Memory one process holds, released when it calls :meth:`release` or dies."""

    def __init__(self, memory: NodeMemory, name: str, kib: int) -> None:
        self.memory, self.name = memory, name
        self.path = memory.directory / HOLDINGS / f"{uuid.uuid4().hex}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.kib = 0
        self.write(0)
        try:
            self.resize(kib)
        except OutOfMemory:
            self.release()
            raise

    def write(self, kib: int) -> None:
        data = json.dumps({"name": self.name, "kib": kib, "pid": os.getpid()}).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        self.kib = kib

    def resize(self, kib: int) -> None:
        self.memory._resize(self, kib)

    def grow(self, kib: int) -> None:
        self.resize(self.kib + kib)

    def release(self) -> None:
        if self._fd >= 0:
            with self.memory._locked():
                self.path.unlink(missing_ok=True)
                os.close(self._fd)
                self._fd = -1
                self.memory._render(self.memory._usage())


def _read_holding(path: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads(path.read_text())["kib"])
    return 0


def _live_holdings(directory: Path) -> tuple[dict[str, int], bool]:
    """Holdings whose process is alive (its flock is held), and whether files of dead ones were
    removed."""
    found: dict[str, int] = {}
    pruned = False
    for path in sorted(directory.glob("*.json")) if directory.exists() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                with contextlib.suppress(ValueError):
                    found[path.stem] = int(json.loads(os.read(fd, 65536) or b"{}").get("kib", 0))
                continue
            path.unlink(missing_ok=True)
            pruned = True
        finally:
            os.close(fd)
    return found, pruned


def watch(directory: Path, ready: Callable[[], None], interval: float = 0.05) -> None:
    """The node's watcher: drop_caches requests and holders' deaths, until killed. A round that
    fails (a holding half written) is said on stderr, the node's log, and the next one goes on:
    a watcher that died would leave a node whose drop_caches does nothing."""
    memory = NodeMemory(directory)
    drop = Path(memory.usage().state.drop_caches)
    ready()
    while True:
        try:
            memory.poll(drop)
        except Exception:  # see above
            traceback.print_exc()
        time.sleep(interval)
