"""Upstream FastVideo's own SP model tests, changed only in device and backend, for the overlay test.

Each test (``fastvideo/tests/distributed/test_sp_*.py`` of the pinned wheel) compares one process with SP = 2 under
torchrun on CUDA. Here it is read from the overlay, changed by the named patches below and written to a folder of
the test's own; upstream's file in the cache is never edited. Every patch must apply (a changed upstream fails the
test, naming the patch). The backend needs no source change: with the GPUs hidden
(``CUDA_VISIBLE_DEVICES=""``, which the runner sets) ``maybe_init_distributed_environment_and_model_parallel``
initialises gloo.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TESTS = ("test_sp_wan.py", "test_sp_hunyuanvideo.py", "test_sp_ltx2.py", "test_sp_lingbot_video.py")
UPSTREAM_DIR = Path("fastvideo") / "tests" / "distributed"

CPU_ATTENTION_BACKEND = '''
# patched: cpu-attention-backend. Upstream's CpuPlatform.get_attn_backend_cls returns "" (no backend) and no
# attention layer can be built; on the CPU it returns upstream's SDPA backend, as upstream's MPS platform does.
from fastvideo.platforms.cpu import CpuPlatform as _CpuPlatform  # noqa: E402

_CpuPlatform.get_attn_backend_cls = classmethod(
    lambda cls, selected_backend, head_size, dtype: "fastvideo.attention.backends.sdpa.SDPABackend")

'''


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    pattern: str  # a regular expression (re.M)
    replacement: str
    optional_in: tuple[str, ...] = ()  # files where it may find nothing (already in the wanted form)


PATCHES = (
    Patch("cpu-device", "no GPU: each rank's device is the CPU",
          r'torch\.device\(f"cuda:\{local_rank\}"\)', 'torch.device("cpu")  # patched: cpu-device'),
    Patch("no-set-device", "torch.cuda.set_device needs CUDA; the CPU needs none",
          r"^(\s*)torch\.cuda\.set_device\(device\)$", r"\1pass  # patched: no-set-device"),
    Patch("no-cuda-skip", "the test skips without CUDA devices; on the CPU it runs",
          r"^(\s*)if (not torch\.cuda\.is_available\(\)|torch\.cuda\.device_count\(\) < SP_WORLD_SIZE):$",
          r"\1if False:  # patched: no-cuda-skip"),
    Patch("torchrun-module", "`torchrun` is on PATH only in an activated environment: the same launcher, as a module "
          "of the python that runs the test", r'^(\s*)"torchrun",$',
          r'\1sys.executable, "-m", "torch.distributed.run",', optional_in=("test_sp_lingbot_video.py",)),
    Patch("import-sys", "for torchrun-module", r"^import argparse$", "import argparse\nimport sys",
          optional_in=("test_sp_lingbot_video.py",)),
    Patch("cpu-attention-backend", "upstream's CPU platform picks no attention backend",
          r"^(SP_WORLD_SIZE = )", CPU_ATTENTION_BACKEND + r"\1"),
)


class PatchError(RuntimeError):
    pass


def patched_source(source: str, test_name: str) -> tuple[str, dict[str, int]]:
    """``source`` with every patch applied; how many places each changed. Raises PatchError naming a patch that
    found nothing to change where it must."""
    counts = {}
    for patch in PATCHES:
        if patch.name == "import-sys" and re.search(r"^import sys$", source, re.M):
            counts[patch.name] = 0
            continue
        source, n = re.subn(patch.pattern, patch.replacement, source, flags=re.M)
        if n == 0 and test_name not in patch.optional_in:
            raise PatchError(f"{test_name}: patch {patch.name!r} ({patch.why}) found nothing to change; upstream's "
                             f"test is not the one it was written for (pattern {patch.pattern!r})")
        counts[patch.name] = n
    return source, counts


def write_patched(overlay_root: Path, test_name: str, dest: Path) -> tuple[Path, dict[str, int]]:
    src = overlay_root / UPSTREAM_DIR / test_name
    text, counts = patched_source(src.read_text(), test_name)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / test_name
    out.write_text(text)
    return out, counts
