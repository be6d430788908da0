"""The nvidia-smi stand-in against real nvidia-smi output: H200 captures and the GB10 rules.

Each test builds a node's GPU state equal to what the capture saw and runs the stand-in as a real
subprocess, as the test bed's ``nvidia-smi`` wrapper does. CSV, ``-L`` and ``--version`` output
must equal the capture byte for byte; tables are compared line by line with the timestamp and
the sensor readings (fan, temperature, performance state, power, utilization) masked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testbed.standins import gpu_state
from tests.testbed.standins.gpu_state import GpuProcess
from vllm_redeploy.parsers.nvidia_smi import GPUS_ARGV, parse_gpus

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "testbed" / "standins" / "nvidia_smi.py"
H200 = REPO / "tests" / "fixtures" / "nvidia_smi" / "h200"

# What ran on the H200 in each capture (h200/README.md, holder-pid*.txt, ps-holder*.txt).
H200_PROCESSES = {
    "idle": [],
    "busy": [GpuProcess(492, "python3", 20998)],
    "busy2": [GpuProcess(492, "python3", 20998), GpuProcess(664, "/tmp/holder_cu", 8710)],
}
SCENARIOS = tuple(H200_PROCESSES)


def commands(directory: Path) -> dict[str, list[str]]:
    """``commands.txt``: file name -> nvidia-smi arguments (other tools' lines are skipped)."""
    found = {}
    for line in (directory / "commands.txt").read_text().splitlines():
        name, _, command = line.partition(": ")
        argv = shlex.split(command)
        if argv[0] == "nvidia-smi":
            found[name] = argv[1:]
    return found


def exit_codes(directory: Path) -> dict[str, int]:
    pairs = (line.split(" rc=") for line in (directory / "rc.txt").read_text().splitlines())
    return {name: int(code) for name, code in pairs}


def make_state(
    directory: Path,
    profile: str,
    processes: list[GpuProcess],
    gpus: int = 1,
    **extra: object,
) -> Path:
    gpu_state.write_config(directory, profile, gpus, processes)
    config = gpu_state.read_config(directory)
    config.update(extra)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def h200_state(directory: Path, scenario: str) -> Path:
    """The capture machine: its UUID from ``-L``, its versions from ``--version``."""
    uuid = re.search(r"UUID: (GPU-[0-9a-f-]+)", (H200 / scenario / "L.txt").read_text())
    lines = (H200 / scenario / "version.txt").read_text().splitlines()
    versions = {key.strip(): value.strip() for key, value in (x.split(":", 1) for x in lines)}
    assert uuid is not None
    return make_state(
        directory,
        "h200",
        H200_PROCESSES[scenario],
        uuids=[uuid.group(1)],
        driver_version=versions["DRIVER version"],
        cuda_version=versions["CUDA Version"],
    )


def smi(state: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != gpu_state.ENV_STATE}
    if state is not None:
        env[gpu_state.ENV_STATE] = str(state)
    return subprocess.run(
        [sys.executable, str(STANDIN), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- Table comparison with the volatile readings masked -----------------------------------------

SENSORS = re.compile(
    r"^ (?P<fan>N/A|\s*\d+%)\s+\d+C\s+P\d+\s+\d+W /\s+(?P<cap>\d+W|N/A)\s*$"
)  # left cell of a GPU's second row
UTILIZATION = re.compile(r"^\s+\d+%\s+(?P<mode>\S+) $")
TIMESTAMP = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}( {7})?$")


def masked(table: str) -> list[str]:
    lines = table.split("\n")
    assert TIMESTAMP.match(lines[0]), lines[0]
    out = ["<timestamp>"]
    for line in lines[1:]:
        cells = line.split("|")
        sensors = SENSORS.match(cells[1]) if len(cells) == 5 else None
        if sensors is None:
            out.append(line)
            continue
        util = UTILIZATION.match(cells[3])
        assert util is not None, line
        left = f"<fan {sensors['fan']}, cap {sensors['cap']}, {len(cells[1])} wide>"
        right = f"<{util['mode']}, {len(cells[3])} wide>"
        out.append(f"|{left}|{cells[2]}|{right}|")
    return out


def assert_now(table: str) -> None:
    stamp = table.split("\n")[0]
    assert stamp.endswith(" " * 7)
    shown = time.mktime(time.strptime(stamp.strip(), "%a %b %d %H:%M:%S %Y"))
    assert abs(shown - time.time()) < 120


# --- H200: every capture ------------------------------------------------------------------------

CSV_CASES = [
    (scenario, name)
    for scenario in SCENARIOS
    for name, argv in commands(H200 / scenario).items()
    if any(arg.startswith(("--query-gpu", "--query-compute-apps")) for arg in argv)
]


@pytest.mark.parametrize(("scenario", "name"), CSV_CASES)
def test_h200_csv_query_equals_capture(tmp_path: Path, scenario: str, name: str) -> None:
    result = smi(h200_state(tmp_path, scenario), *commands(H200 / scenario)[name])
    assert result.stdout == (H200 / scenario / name).read_text()
    assert result.returncode == exit_codes(H200 / scenario)[name]
    assert result.stderr == ""


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", ["L.txt", "version.txt"])
def test_h200_list_and_version_equal_capture(tmp_path: Path, scenario: str, name: str) -> None:
    result = smi(h200_state(tmp_path, scenario), *commands(H200 / scenario)[name])
    assert (result.returncode, result.stdout) == (0, (H200 / scenario / name).read_text())


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", ["nvidia-smi.txt", "i0-nvidia-smi.txt"])
def test_h200_table_equals_capture(tmp_path: Path, scenario: str, name: str) -> None:
    result = smi(h200_state(tmp_path, scenario), *commands(H200 / scenario)[name])
    assert result.returncode == 0
    assert masked(result.stdout) == masked((H200 / scenario / name).read_text())
    assert_now(result.stdout)


@pytest.mark.parametrize("name", ["i5-product-query.txt", "bad-field-query-gpu.txt"])
def test_h200_errors_equal_capture(tmp_path: Path, name: str) -> None:
    result = smi(h200_state(tmp_path, "idle"), *commands(H200 / "errors")[name])
    assert result.stdout == (H200 / "errors" / name).read_text()
    assert result.returncode == exit_codes(H200 / "errors")[name]


def test_unknown_compute_app_field_is_rejected_like_a_gpu_field(tmp_path: Path) -> None:
    result = smi(h200_state(tmp_path, "busy"), "--query-compute-apps=pid,bogus", "--format=csv")
    assert (result.returncode, result.stdout) == (
        2,
        'Field "bogus" is not a valid field to query.\n\n',
    )


def test_without_a_node_state_it_fails_like_a_missing_driver() -> None:
    result = smi(None, "--query-compute-apps=pid", "--format=csv,noheader")
    assert result.returncode == 9
    assert result.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate")


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    state = h200_state(tmp_path, "idle")
    for args in (["--bogus"], ["--query-gpu=index", "--format=json"], ["--query-gpu=index"]):
        assert smi(state, *args).returncode == 2, args


def test_runs_as_a_module_too(tmp_path: Path) -> None:
    env = {**os.environ, gpu_state.ENV_STATE: str(h200_state(tmp_path, "busy"))}
    result = subprocess.run(
        [sys.executable, "-m", "tests.testbed.standins.nvidia_smi", "-L"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout == (H200 / "busy" / "L.txt").read_text()


# --- Live processes and several GPUs -----------------------------------------------------------


def compute_apps(state: Path, *extra: str) -> str:
    args = ["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]
    return smi(state, *extra, *args).stdout


def test_live_registration_is_listed_and_counted_until_released(tmp_path: Path) -> None:
    state = h200_state(tmp_path, "idle")
    memory = ["--query-gpu=memory.used,memory.free", "--format=csv,noheader,nounits"]
    idle_used, idle_free = map(int, smi(state, *memory).stdout.split(", "))
    with gpu_state.register(state, "VLLM::Worker_TP0", 5000):
        assert compute_apps(state) == f"{os.getpid()}, VLLM::Worker_TP0, 5000\n"
        used, free = map(int, smi(state, *memory).stdout.split(", "))
        # The process's own MiB plus a few MiB of driver overhead, taken from free memory.
        assert 5000 < used - idle_used < 5020
        # Both are rounded to MiB on their own, so they may differ by one (as in the captures).
        assert abs((idle_free - free) - (used - idle_used)) <= 1
    assert compute_apps(state) == ""
    idle = smi(state, *commands(H200 / "idle")["query-gpu.csv.txt"])
    assert idle.stdout == (H200 / "idle" / "query-gpu.csv.txt").read_text()


def test_a_killed_holder_disappears(tmp_path: Path) -> None:
    state = h200_state(tmp_path, "idle")
    code = (
        "import time\n"
        "from tests.testbed.standins import gpu_state\n"
        "gpu_state.register(gpu_state.state_dir(), 'python3', 1234)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, gpu_state.ENV_STATE: str(state)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        assert compute_apps(state) == f"{holder.pid}, python3, 1234\n"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert compute_apps(state) == ""


def test_index_selects_one_gpu_of_several(tmp_path: Path) -> None:
    procs = [GpuProcess(100, "a", 10, gpu=0), GpuProcess(200, "b", 20, gpu=1)]
    state = make_state(tmp_path, "h200", procs, gpus=2)
    assert compute_apps(state) == "100, a, 10\n200, b, 20\n"
    assert compute_apps(state, "-i", "1") == "200, b, 20\n"
    table = smi(state, "-i", "1").stdout
    assert "|   1  NVIDIA H200" in table and "|   0  NVIDIA H200" not in table
    rows = [line.split()[1:6] for line in table.splitlines() if " N/A  N/A " in line]
    assert rows == [["1", "N/A", "N/A", "200", "C"]]
    assert smi(state, "-i", "2", "-L").returncode == 6
    uuids = re.findall(r"GPU-[0-9a-f-]+", smi(state, "-L").stdout)
    assert len(set(uuids)) == 2


def test_product_gpus_query_round_trips_through_the_parser(tmp_path: Path) -> None:
    result = smi(h200_state(tmp_path, "busy2"), *GPUS_ARGV[1:])
    (gpu,) = parse_gpus(result.stdout)
    expected = (H200 / "busy2" / "query-gpu.csv-noheader-nounits.txt").read_text().split(", ")
    assert (gpu.uuid, gpu.memory_used_mib, gpu.memory_free_mib) == (
        expected[1],
        int(expected[4]),
        int(expected[5]),
    )


# --- GB10 (DGX Spark): the unified-memory rules (BRIEF section 3; fixtures/nvidia_smi/gb10) ----

XORG = GpuProcess(3014, "/usr/lib/xorg/Xorg", 18, "G")
SHELL = GpuProcess(3521, "/usr/bin/gnome-shell", 6, "G")


def test_gb10_table_says_not_supported_and_lists_graphics(tmp_path: Path) -> None:
    engine = GpuProcess(16618, "VLLM::EngineCore", 43079)
    table = smi(make_state(tmp_path, "gb10", [XORG, SHELL, engine])).stdout
    assert "NVIDIA GB10" in table and "Not Supported" in table
    rows = [line.split() for line in table.splitlines() if " N/A  N/A " in line]
    assert [(r[4], r[5], r[6], r[7]) for r in rows] == [
        ("3014", "G", "/usr/lib/xorg/Xorg", "18MiB"),
        ("3521", "G", "/usr/bin/gnome-shell", "6MiB"),
        ("16618", "C", "VLLM::EngineCore", "43079MiB"),
    ]


def test_gb10_memory_is_na_with_or_without_units(tmp_path: Path) -> None:
    state = make_state(tmp_path, "gb10", [GpuProcess(7, "python3", 100)])
    fields = "--query-gpu=memory.total,memory.used,memory.free"
    for fmt in ("--format=csv,noheader", "--format=csv,noheader,nounits"):
        assert smi(state, fields, fmt).stdout == "[N/A], [N/A], [N/A]\n"


def test_gb10_compute_apps_leave_out_graphics_processes(tmp_path: Path) -> None:
    python = GpuProcess(114687, "/usr/local/bin/python", 19135)
    state = make_state(tmp_path, "gb10", [XORG, SHELL, python])
    assert compute_apps(state) == "114687, /usr/local/bin/python, 19135\n"

    desktop_only = make_state(tmp_path / "desktop", "gb10", [XORG, SHELL])
    assert compute_apps(desktop_only) == ""
    header = smi(desktop_only, "--query-compute-apps=pid,process_name,used_memory", "--format=csv")
    assert header.stdout == "pid, process_name, used_gpu_memory [MiB]\n"
    assert "/usr/lib/xorg/Xorg" in smi(desktop_only).stdout


def test_long_process_names_keep_their_end(tmp_path: Path) -> None:
    # Real rows from a four-Spark cluster's table (index file id 53109379815, see the README);
    # only the end of each name is shown, so the leading directories here are our guess.
    rows = {
        GpuProcess(4862, "/snap/firefox/7965/usr/lib/firefox/firefox", 587, "G"): (
            "|    0   N/A  N/A            4862      G   .../7965/usr/lib/firefox/firefox"
            "        587MiB |"
        ),
        GpuProcess(4333, "/usr/libexec/xdg-desktop-portal-gnome", 76, "G"): (
            "|    0   N/A  N/A            4333      G   ...exec/xdg-desktop-portal-gnome"
            "         76MiB |"
        ),
    }
    table = smi(make_state(tmp_path, "gb10", list(rows))).stdout
    assert [line for line in table.splitlines() if " N/A  N/A " in line] == sorted(
        rows.values(), key=lambda row: int(row.split()[4])
    )


def test_a_corrupted_inforom_answers_in_full_then_warns_with_exit_14(tmp_path: Path) -> None:
    """As real nvidia-smi does (its exit code 14, "infoROM is corrupted"; pytorch/pytorch#87464
    quotes the warning line): the rows first, then one warning per such GPU."""
    state = make_state(tmp_path, "h200", [], gpus=2, inforom_corrupted=[1])
    done = smi(state, "--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    assert done.returncode == 14, done
    rows, warning = done.stdout.splitlines()[:2], done.stdout.splitlines()[2:]
    bus_id = rows[1].split(", ")[1]  # 00000000:00:NN.0: the warning drops 4 digits of domain
    assert [r.split(", ")[0] for r in rows] == ["0", "1"]
    assert warning == [f"WARNING: infoROM is corrupted at gpu {bus_id[4:]}"]
