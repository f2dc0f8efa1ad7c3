#!/usr/bin/env bash
# mypy --strict over the whole `stepd` package as it installs.
#
# actors/, storage/ and transport/ live at the repository root and install as
# stepd.actors, stepd.storage and stepd.transport (pyproject's package-dir
# mapping), a layout mypy cannot follow from the source tree. This builds the
# installed tree as symlinks in a temporary directory and checks that.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py_cmd="$(command -v "${PYTHON:-python}")"
py="$(cd "$(dirname "$py_cmd")" && pwd)/$(basename "$py_cmd")"  # absolute, venv kept
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
cp -r "$root/stepd" "$tree/stepd"
for sub in actors storage transport; do
  rm -rf "$tree/stepd/$sub"
  ln -s "$root/$sub" "$tree/stepd/$sub"
done
cd "$tree"
"$py" -m mypy --strict -p stepd "$@"
