#!/usr/bin/env bash
# Set up this checkout for development and the test bed: the system tools the bed runs for real
# (sshd, a Docker engine binary, static busybox for registry-free images, PostgreSQL for the
# scale-out tests, Chromium for the browser test), then the project with its test extras in .venv.
#
# This is NOT how to install the product on a controller: that is `pipx install .` (README,
# "Install on a controller"), which touches no system package.
#
# What is already there is detected by what it can do, not by Debian package names: a machine
# that runs Docker from Docker's own packages (docker-ce, containerd.io) has a working `dockerd`
# and keeps it; nothing here installs, replaces, starts or reconfigures a Docker engine that exists.
# A lone docker client that no package owns (a static binary) gets Debian's engine beside it.
# It prints what it would install, and why, before installing. Safe to run again.
#
#   scripts/setup.sh               system tools (only the missing ones), then .venv and the real
#                                  vLLM for the bed (scripts/real-vllm.sh, once per machine)
#   scripts/setup.sh --dry-run     print what it would install; change nothing
#   scripts/setup.sh --system-only the system tools only, no .venv
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=false
python_env=true
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=true ;;
    --system-only) python_env=false ;;
    *)
      echo "setup: unknown option '$arg'; use --dry-run or --system-only" >&2
      exit 2
      ;;
  esac
done

have() { command -v "$1" >/dev/null 2>&1; }
works() { "$@" >/dev/null 2>&1; }
sbin_have() { have "$1" || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
static_busybox() {
  local bb
  bb=$(command -v busybox 2>/dev/null) || return 1
  # A dynamically linked busybox cannot run inside an image that is only busybox.
  ! ldd "$bb" >/dev/null 2>&1
}
postgres_server() {
  have postgres || compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# Installed Docker packages that do not come from Debian: docker.io must not be mixed with them.
docker_packages_of_other_sources() {
  local found=() package status
  have dpkg-query || return 0
  while read -r package status; do
    [ "$status" = installed ] && found+=("$package")
  done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' \
    docker-ce docker-ce-cli docker-ee moby-engine moby-cli containerd.io 2>/dev/null)
  echo "${found[*]}"
}

plan=() # "package|why"
need() { plan+=("$1|$2"); }

# Docker: the bed starts private engines of its own (their own sockets and data roots) from the
# dockerd binary; the machine's engine, if any, is never touched.
if have dockerd && works dockerd --version; then
  echo "setup: Docker engine present ($(command -v dockerd)): left as it is"
elif foreign=$(docker_packages_of_other_sources) && [ -n "$foreign" ]; then
  echo "setup: Docker packages from another source are installed ($foreign) but no dockerd" \
    "binary; Debian's docker.io would conflict with them. Install the engine from the same" \
    "source (e.g. docker-ce), then run this again." >&2
  exit 1
else
  # A docker client that no package owns (a static binary in /usr/local/bin, as some machine
  # images ship) is no conflict: Debian's engine installs beside it and the client talks to it.
  need docker.io "a dockerd binary: each emulated node runs its own private engine"
fi
sbin_have sshd || need openssh-server "an sshd binary: each emulated node runs its own sshd"
have ssh-keygen || need openssh-client "ssh-keygen: host and client keys for the bed"
static_busybox || need busybox-static "a static busybox: registry-free images for the bed"
have ps && have pkill || need procps "ps, pkill"
have sudo || need sudo "sudo: the bed's nodes log in as a user that is not root"
[ -x /usr/bin/python3 ] || need python3-minimal "the bed's host tools, run as its login"
have ip && have ss || need iproute2 "ip, ss: the bed's fabric interfaces and port checks"
[ -r /etc/ssl/certs/ca-certificates.crt ] || need ca-certificates "pip over https"
works python3 -m venv --help && works python3 -c 'import ensurepip' ||
  need python3-venv "python3 -m venv: the project's .venv"
postgres_server || need postgresql "a PostgreSQL server: the scale-out tests run Prefect on it"
have systemd-analyze || need systemd "systemd-analyze verify: the controller's unit files"
# Docker's own compose plugin counts; Debian's docker-compose only where neither is there.
have docker-compose || works docker compose version ||
  need docker-compose "docker-compose config: the controller's compose.yaml"
have chromium || have chromium-browser || need chromium "the browser test of the UI"
have faketime || need faketime "libfaketime: a run on a clock minutes behind (test_hands_off)"
have prometheus || need prometheus "Prometheus: scrapes the watcher's metrics (test_metrics)"
fc-list 2>/dev/null | grep -qi dejavu || need fonts-dejavu-core "a font for the browser test"

if ((${#plan[@]})); then
  echo "setup: would install from apt (Debian/Ubuntu):"
  for entry in "${plan[@]}"; do
    printf '  %-18s %s\n' "${entry%%|*}" "${entry#*|}"
  done
else
  echo "setup: every system tool the bed uses is already there"
fi
if $dry_run; then
  exit 0
fi

if ((${#plan[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  packages=("${plan[@]%%|*}")
  echo "setup: installing ${packages[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  # --no-install-recommends: nothing beyond what is listed above and its dependencies.
  $sudo env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

if $python_env; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[test]'
  # The real vLLM (CPU build) and a tiny model for the bed: once per machine, outside the checkout.
  bash scripts/real-vllm.sh >/dev/null
  echo "setup: done (.venv/bin/vllm-redeploy, .venv/bin/pytest)"
fi
