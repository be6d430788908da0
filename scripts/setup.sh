#!/usr/bin/env bash
# Set up this checkout on a fresh Debian/Ubuntu machine: the system tools the test bed runs for real
# (OpenSSH server, Docker engine, static busybox for registry-free test images, Chromium with a
# font for the browser test), then the project with its test extras in .venv. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(openssh-server openssh-client docker.io busybox-static procps iproute2 ca-certificates
  chromium fonts-dejavu-core)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
echo "setup: done (.venv/bin/vllm-redeploy, .venv/bin/pytest)"
