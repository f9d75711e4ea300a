"""The tests' CPU plan transport (``tests/plan_transport.py``) for the edited upstream tests run on this path: the
overlay holds the package alone, so this module loads the simulation from its file in this repository's tree."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "plan_transport.py"
_spec = importlib.util.spec_from_file_location("_fastvideo_tests_plan_transport", _PATH)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)

GlooPlanTransport = _module.GlooPlanTransport
