#!/usr/bin/env bash
# Build the wheel as a release would, install it into a fresh venv outside the checkout and use
# it from there: the package must ship every file it needs (the notifier, the systemd units).
#   scripts/check-wheel.sh    (after scripts/setup.sh; CI runs it)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# From a copy of what git would ship (tracked and new, not ignored): the build leaves nothing in
# the checkout.
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  (cd "$repo" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$work/src"
"$repo/.venv/bin/python" -m build --wheel --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 ||
  { cat "$work/build.log" >&2; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel" >"$work/install.log" 2>&1 ||
  { cat "$work/install.log" >&2; exit 1; }

cd "$work" # nothing from the checkout on sys.path
"$work/venv/bin/vllm-redeploy" --help >/dev/null
"$work/venv/bin/vllm-redeploy" check-config --config "$repo/cluster.example.toml" >/dev/null
# The example ships in the package: `init` writes it where no checkout is.
"$work/venv/bin/vllm-redeploy" init "$work/cluster.toml" >/dev/null
"$work/venv/bin/vllm-redeploy" check-config --config "$work/cluster.toml" >/dev/null
# Every data file under deployments/ in git is in the installed package.
expected=$(git -C "$repo" ls-files deployments | grep -v '\.py$' | grep -v '^deployments/compose/' | sort)
installed=$("$work/venv/bin/python" - <<'PY'
import importlib.resources as r, pathlib
root = pathlib.Path(str(r.files("deployments")))
for path in sorted(root.rglob("*")):
    if path.is_file() and path.suffix not in {".py", ".pyc"}:
        print(f"deployments/{path.relative_to(root)}")
PY
)
missing=$(comm -23 <(echo "$expected") <(echo "$installed" | sort))
if [ -n "$missing" ]; then
  echo "check-wheel: $(basename "$wheel") lacks: $missing (add them to package-data in pyproject.toml)" >&2
  exit 1
fi
echo "check-wheel: $(basename "$wheel") installs, runs --help, init and check-config, ships $(echo "$installed" | wc -l) data files"
