"""Upstream FastVideo 0.2.1's own source files, for the tests that compare this package against them.

``FASTVIDEO_UPSTREAM_ROOT``, where set, is a folder holding an unpacked wheel's ``fastvideo/``. Otherwise the pinned,
sha256-checked wheel is unpacked once into the overlay's cache (``tests/overlay/build.py``: from its wheel folder,
``.whl/overlay`` or ``$FASTVIDEO_OVERLAY_WHEELS``, else downloaded). Where the wheel cannot be had (offline, none
carried) a test that needs it skips, saying so; under ``CI=true``, where it can be downloaded, it fails instead.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.ci import ci
from tests.overlay import build

CI = ci()


@functools.cache
def _find() -> Path | str:
    """The folder holding upstream's ``fastvideo/``, or why there is none."""
    given = os.environ.get("FASTVIDEO_UPSTREAM_ROOT")
    if given:
        if not (Path(given) / "fastvideo" / "__init__.py").is_file():
            return (f"FASTVIDEO_UPSTREAM_ROOT={given} holds no fastvideo/__init__.py: point it at the folder an "
                    f"unpacked {build.UPSTREAM_WHEEL} fills, or unset it to use the pinned wheel")
        return Path(given)
    try:
        return build.upstream_source()
    except build.MissingDownload as exc:
        return f"upstream FastVideo's source is not at hand: {exc}"


def root() -> Path:
    """The folder holding upstream's ``fastvideo/``; skips (fails under CI) where there is none."""
    found = _find()
    if isinstance(found, str):
        if CI:
            pytest.fail(f"{found} (CI=true: a missing download fails here instead of skipping)")
        pytest.skip(found)
    return found


def path(relative: str) -> Path:
    """Upstream's file ``fastvideo/<relative>``; skips (fails under CI) where the source is not at hand, and fails
    where the file is missing from it."""
    file = root() / "fastvideo" / relative
    assert file.is_file(), f"upstream FastVideo 0.2.1 has no fastvideo/{relative} at {file}"
    return file
