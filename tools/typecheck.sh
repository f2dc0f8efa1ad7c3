#!/usr/bin/env bash
# mypy --strict over the whole `stepd` package: the same as running plain
# `mypy --strict` at the repository root (pyproject's [tool.mypy] names the
# package; stepd/actors, stepd/storage and stepd/transport are symlinks to the
# root folders that install under those names).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m mypy --strict "$@"
