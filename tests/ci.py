"""Whether the tests run under CI, read as the scripts read it (``scripts/ci.sh``'s ``_fv_ci``): ``CI`` set
to anything but empty, ``0`` or ``false`` (any case). Under CI what a machine lacks fails instead of skipping."""

from __future__ import annotations

import os


def ci() -> bool:
    """Read now, so that a test that sets ``CI`` for itself sees its own value."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")
