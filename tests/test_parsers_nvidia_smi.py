"""The product's nvidia-smi parsers on real output: the H200 captures, the GB10 rules, garbage."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from vllm_redeploy.parsers.nvidia_smi import (
    COMPUTE_APPS_ARGV,
    GPU_FIELDS,
    GPUS_ARGV,
    ComputeApp,
    GpuInfo,
    parse_compute_apps,
    parse_gpus,
    warnings,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia_smi"
H200 = FIXTURES / "h200"
UUID = "GPU-6403e261-b61d-e81a-8def-2205d8d207e0"  # the H200 of the captures

# What each capture saw (h200/README.md): the processes, and memory.total/used/free in MiB.
APPS = {
    "idle": [],
    "busy": [ComputeApp(492, "python3", 20998)],
    "busy2": [ComputeApp(492, "python3", 20998), ComputeApp(664, "/tmp/holder_cu", 8710)],
}
MEMORY = {"idle": (143771, 0, 143156), "busy": (143771, 21007, 122150)}
MEMORY["busy2"] = (143771, 29723, 113434)


def queries(directory: Path, option: str) -> list[tuple[str, tuple[str, ...]]]:
    """(file, queried fields) for each capture in ``directory`` made with ``option``."""
    found = []
    for line in (directory / "commands.txt").read_text().splitlines():
        name, _, command = line.partition(": ")
        for arg in shlex.split(command):
            if arg.startswith(f"{option}="):
                found.append((name, tuple(arg.split("=", 1)[1].split(","))))
    return found


APP_CASES = [(s, *q) for s in APPS for q in queries(H200 / s, "--query-compute-apps")]
GPU_CASES = [(s, *q) for s in APPS for q in queries(H200 / s, "--query-gpu")]


@pytest.mark.parametrize(("scenario", "name", "fields"), APP_CASES)
def test_compute_apps_of_every_capture(scenario: str, name: str, fields: tuple[str, ...]) -> None:
    assert parse_compute_apps((H200 / scenario / name).read_text(), fields) == APPS[scenario]


@pytest.mark.parametrize(("scenario", "name", "fields"), GPU_CASES)
def test_gpus_of_every_capture(scenario: str, name: str, fields: tuple[str, ...]) -> None:
    (gpu,) = parse_gpus((H200 / scenario / name).read_text(), fields)
    assert gpu == GpuInfo(0, "NVIDIA H200", UUID, *MEMORY[scenario])
    assert gpu.memory_reported


def test_the_product_query_is_the_captured_one() -> None:
    name = "product-query-compute-apps.csv-noheader-nounits.txt"
    lines = (H200 / "busy2" / "commands.txt").read_text().splitlines()
    (command,) = [line.partition(": ")[2] for line in lines if line.startswith(f"{name}: ")]
    assert list(COMPUTE_APPS_ARGV) == shlex.split(command)
    assert parse_compute_apps((H200 / "busy2" / name).read_text()) == APPS["busy2"]
    assert GPUS_ARGV[1] == "--query-gpu=" + ",".join(GPU_FIELDS)
    assert GPUS_ARGV[2] == COMPUTE_APPS_ARGV[2]


def test_after_the_holders_were_killed_nothing_is_left() -> None:
    assert parse_compute_apps((H200 / "meta" / "after-kill-product-query.txt").read_text()) == []


def test_gb10_memory_is_not_reported() -> None:
    fields = ("index", "name", "memory.total", "memory.used", "memory.free")
    (gpu,) = parse_gpus("0, NVIDIA GB10, [N/A], [N/A], [N/A]\n", fields)
    assert gpu == GpuInfo(0, "NVIDIA GB10")
    assert not gpu.memory_reported


def test_gb10_memory_with_header_and_units() -> None:
    fields = ("index", "name", "memory.total", "memory.free")
    (gpu,) = parse_gpus(
        "index, name, memory.total [MiB], memory.free [MiB]\n0, NVIDIA GB10, [N/A], [N/A]\n", fields
    )
    assert (gpu.name, gpu.memory_total_mib, gpu.memory_free_mib) == ("NVIDIA GB10", None, None)


def test_gb10_compute_apps_keep_real_numbers() -> None:
    fields = ("gpu_uuid", "pid", "process_name", "used_memory")
    text = "GPU-b0ec33a0-2589-53de-953c-0713d37d0794, 114687, /usr/local/bin/python, 19135\n"
    assert parse_compute_apps(text, fields) == [ComputeApp(114687, "/usr/local/bin/python", 19135)]


@pytest.mark.parametrize("marker", ["[N/A]", "[Not Supported]", "[Insufficient Permissions]"])
def test_unreadable_process_memory_is_none(marker: str) -> None:
    assert parse_compute_apps(f"17, VLLM::EngineCore, {marker}\n") == [
        ComputeApp(17, "VLLM::EngineCore", None)
    ]


def test_a_process_name_with_a_comma() -> None:
    assert parse_compute_apps("9, python3 a, b.py, 12 MiB\n") == [
        ComputeApp(9, "python3 a, b.py", 12)
    ]


@pytest.mark.parametrize("text", ["", "\n", "pid, process_name, used_gpu_memory [MiB]\n"])
def test_no_process(text: str) -> None:
    assert parse_compute_apps(text) == []


def test_no_gpu_rows() -> None:
    assert parse_gpus("") == []


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("No devices were found\n", "No devices were found"),
        ("492, python3\n", "492, python3"),
        ("[N/A], python3, 12\n", "[N/A], python3, 12"),
        ("492, python3, lots\n", "492, python3, lots"),
        ("pid, used_gpu_memory [MiB], process_name\n", "pid, used_gpu_memory [MiB], process_name"),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            "NVIDIA-SMI has failed",
        ),
    ],
)
def test_garbage_compute_apps_name_the_line(text: str, offending: str) -> None:
    with pytest.raises(ValueError, match="nvidia-smi") as error:
        parse_compute_apps(text)
    assert offending in str(error.value)


@pytest.mark.parametrize(
    "text",
    [
        "0, GPU-x, NVIDIA H200, 143771, 0\n",
        "zero, GPU-x, NVIDIA H200, 143771, 0, 143156\n",
        "0, GPU-x, NVIDIA H200, 143771 MiB, ??, 143156\n",
        'Field "bogus_field" is not a valid field to query.\n\n',
    ],
)
def test_garbage_gpus_name_the_line(text: str) -> None:
    with pytest.raises(ValueError, match="nvidia-smi") as error:
        parse_gpus(text)
    assert text.strip() in str(error.value)


def test_a_query_without_the_key_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="index"):
        parse_gpus("NVIDIA GB10, [N/A]\n", ("name", "memory.total"))
    with pytest.raises(ValueError, match="pid"):
        parse_compute_apps("python3\n", ("process_name",))


def test_warnings_are_never_rows_and_are_kept_apart() -> None:
    """nvidia-smi's exit 14 comes with its answer in full and a warning after it."""
    text = "0, NVIDIA H200\nWARNING: infoROM is corrupted at gpu 0000:00:1E.0\n"
    assert parse_gpus(text, ("index", "name")) == [GpuInfo(0, "NVIDIA H200")]
    assert warnings(text) == ["WARNING: infoROM is corrupted at gpu 0000:00:1E.0"]
    assert warnings("0, NVIDIA H200\n") == []
