"""Whether the fastvideo-kernel package Python imports is the given wheel, byte for byte, and its library loads.

    python scripts/check_kernel_wheel.py WHEEL

Run by ``scripts/gpu_lib.sh``'s ``gpu_kernel_wheel`` after installing the wheel it built from this tree: a package
installed earlier (another tree's build of the same version, a copy earlier on ``sys.path``) must not be what a run
tests. Every file the wheel puts under ``fastvideo_kernel/`` is compared (SHA-256) with the same path of the imported
package, and the library ``fastvideo_kernel.library_path()`` names (``FASTVIDEO_KERNEL_LIBRARY`` where set) with the
wheel's; then ``fastvideo_kernel.load()`` must open it. Exit 0, or 1 naming each mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import zipfile
from pathlib import Path

PACKAGE = "fastvideo_kernel"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mismatches(wheel: Path) -> tuple[list[str], str]:
    """(what differs between ``wheel`` and the imported package, one line on what was compared)."""
    try:
        import fastvideo_kernel
    except ImportError as exc:
        return [f"import {PACKAGE} failed: {exc}"], ""
    package = Path(fastvideo_kernel.__file__).resolve().parent
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        members = {name: archive.read(name) for name in archive.namelist()
                   if name.startswith(f"{PACKAGE}/") and not name.endswith("/")}
    if not members:
        return [f"{wheel.name} holds no {PACKAGE}/ files"], ""
    for name, data in sorted(members.items()):
        installed = package.parent / name
        if not installed.is_file():
            problems.append(f"{name}: in {wheel.name}, missing from the imported package {package}")
        elif (found := _sha256(installed.read_bytes())) != _sha256(data):
            problems.append(f"{name}: {installed} (sha256 {found}) is not the wheel's (sha256 {_sha256(data)})")
    library = f"{PACKAGE}/lib/{fastvideo_kernel.LIBRARY_NAME}"
    used = Path(fastvideo_kernel.library_path())
    if library not in members:
        problems.append(f"{wheel.name} holds no {library}")
    elif used.resolve() != (package.parent / library).resolve():  # FASTVIDEO_KERNEL_LIBRARY names another file
        if not used.is_file() or _sha256(used.read_bytes()) != _sha256(members[library]):
            problems.append(f"the library load() opens, {used} (FASTVIDEO_KERNEL_LIBRARY), is not the wheel's")
    return problems, f"{PACKAGE} imported from {package}: {len(members)} file(s) of {wheel.name} compared"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path, help="the fastvideo-kernel wheel just built from this tree")
    args = parser.parse_args(argv)
    problems, compared = mismatches(args.wheel)
    print(compared or f"nothing compared with {args.wheel}")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if problems:
        print(f"the installed {PACKAGE} is not the wheel built from this tree ({args.wheel})")
        return 1
    import fastvideo_kernel

    try:
        fastvideo_kernel.load()
    except Exception as exc:  # noqa: BLE001 - reported: the wheel's own library does not load here
        print(f"the installed {PACKAGE} is this tree's wheel, but load() failed: {type(exc).__name__}: {exc}")
        return 1
    print(f"the installed {PACKAGE} is the wheel built from this tree, byte for byte, and its library loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
