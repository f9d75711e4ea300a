#!/usr/bin/env bash
# The upstream overlay: FastVideo 0.2.1 from its pinned, sha256-checked wheel, the pinned dependencies of its model
# path, and this tree's fastvideo/ copied over it (tests/overlay/build.py; docs/fastvideo_migration.md, "The
# overlay"). The install is cached outside the tree (FASTVIDEO_OVERLAY_CACHE, else ~/.cache/fastvideo-overlay);
# each call makes a fresh copy of this tree's files over it. Progress goes to stderr; the last stdout line is the
# PYTHONPATH under which the python imports the overlay:
#
#   PYTHONPATH=$(bash scripts/upstream_overlay.sh | tail -1) python my_job.py
#   bash scripts/upstream_overlay.sh --download-to .whl/overlay   # fill the offline wheel folder (network here)
#   bash scripts/upstream_overlay.sh --wheels .whl/overlay        # install with no network (the default when
#                                                                  # .whl/overlay holds wheels)
#
# The python: $PYTHON, else this tree's .venv, else python3 (--python PY overrides: the one that will run the job).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="${PYTHON:-}"
if [[ -z $PY ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
cd "$ROOT"
PYTHONPATH="$ROOT" exec "$PY" -m tests.overlay.build --python "$PY" "$@"
