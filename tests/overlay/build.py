"""The upstream overlay: FastVideo 0.2.1 from its pinned wheel with this repository's ``fastvideo/`` copied over it.

Test tooling, not product code (``scripts/upstream_overlay.sh`` runs it; ``tests/test_upstream_overlay.py`` and the
training job use it). What it builds, under a cache outside the tree
(``$FASTVIDEO_OVERLAY_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/fastvideo-overlay``):

* ``wheels/``: the upstream wheel, checked against its sha256;
* ``install-KEY/``: upstream unpacked (``upstream/``), the pinned dependencies its model path imports
  (``deps/``, ``pip install --no-deps --target``) and stand-ins for the heavy packages it imports at module level
  but never calls on that path (``stand_ins/``: torchvision and scipy, written only where the python given
  cannot import the real one). KEY hashes the pins, the python's version and what the stand-ins need, so a
  change of any rebuilds it; a finished one is reused (``DONE`` marker, built in a temporary folder and renamed);
* ``overlays/RUN/fastvideo``: a fresh copy per call, upstream's files hard-linked from the install and every
  file of this tree's ``fastvideo/`` copied over them (cheap).

Run it with a python (``--python``, default this one) and it prints, on its last stdout line, the
``PYTHONPATH`` under which that python imports the overlay (overlay first, then the pinned dependencies, then the
stand-ins); progress goes to stderr. Offline: ``--download-to DIR`` fills a wheel folder here (the upstream wheel,
every pin, and for the compiled pins their wheels for CPython 3.11 and 3.12), ``--wheels DIR`` (or
``$FASTVIDEO_OVERLAY_WHEELS``) installs from one with no network; ``/.whl/overlay/`` in the repository root
(git-ignored) is used by default when it holds wheels.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WHEELS = ROOT / ".whl" / "overlay"

UPSTREAM = "fastvideo"
UPSTREAM_VERSION = "0.2.1"
UPSTREAM_SHA256 = "47e97668dc7b9f3fdeef7f2790e8057646913d344b79d0ff807a0ddcf9e68738"
UPSTREAM_WHEEL = f"{UPSTREAM}-{UPSTREAM_VERSION}-py3-none-any.whl"

# What upstream's model path imports (fastvideo/__init__ -> configs, pipelines, models.dits, forward_context,
# platforms, utils, and transformers/diffusers/huggingface_hub under them), found by importing
# fastvideo.models.dits.wanvideo, its config, forward_context and pipeline_batch_info until nothing was missing.
# Installed with --no-deps: this list is the whole closure.
PURE = {
    "certifi": "2026.10.19.post1",
    "cloudpickle": "3.1.3",
    "diffusers": "0.42.1",
    "einops": "0.8.2",
    "ftfy": "6.3.1",
    "h11": "0.16.0",
    "httpcore2": "2.16.2",
    "httpx2": "2.16.2",
    "huggingface_hub": "2.4.0",
    "idna": "3.20",
    "imageio": "2.38.2",
    "remote-pdb": "2.1.0",
    "requests": "2.34.2",
    "tqdm": "4.70.1",
    "transformers": "5.24.0",
    "truststore": "0.10.5",
    "urllib3": "2.8.0",
    "wcwidth": "0.2.13",  # the last pure-python release; later ones are compiled
}
# Compiled, one wheel for every CPython 3 (stable ABI): transformers needs tokenizers' classes at import, the
# scheduler's module imports psutil through diffusers.
ABI3 = {"tokenizers": "0.23.3", "psutil": "7.2.2"}
# Compiled per CPython version (no pure wheel exists): upstream's utils imports yaml; transformers imports regex.
PER_PYTHON = {"pyyaml": "6.0.4", "regex": "2026.11.19"}
PYTHONS = ("3.11", "3.12")  # CI and the developers' machines; the GPU hosts
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64")
# Provided by the python that runs the overlay (torch's own dependencies, or the project's): checked, not installed.
HOST = {"torch": "torch", "numpy": "numpy", "PIL": "pillow", "safetensors": "safetensors", "filelock": "filelock",
        "fsspec": "fsspec", "packaging": "packaging", "typing_extensions": "typing_extensions"}
# Imported at module level on the model path, never called there; too heavy (scipy) or without a CPU wheel on
# the package index (torchvision). Written only where the python cannot import the real package.
STAND_INS = ("torchvision", "scipy")
WHEEL_DIR_LIMIT_BYTES = 48 << 20  # the wheel folder travels with the tree to the GPU hosts (64 MiB in all)
STAND_IN_VERSION = 1  # bump when the stand-in source changes: it is part of the install key
INSTALL_LAYOUT = 2  # bump when what an install holds changes (2: upstream's bytecode): part of the install key


class OverlayError(RuntimeError):
    """A step of the build failed; the message names the step, what is missing and the fix."""


class MissingDownload(OverlayError):
    """A file the build needs could not be fetched (no network and no wheel folder holding it)."""


def _log(msg: str) -> None:
    print(f"overlay: {msg}", file=sys.stderr, flush=True)


def _pins() -> dict[str, str]:
    return {**PURE, **ABI3, **PER_PYTHON}


def cache_dir() -> Path:
    base = os.environ.get("FASTVIDEO_OVERLAY_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastvideo-overlay"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _python_info(python: str) -> dict:
    code = ("import json, sys, importlib.util as u; "
            f"print(json.dumps({{'version': '%d.%d' % sys.version_info[:2], "
            f"'found': {{m: u.find_spec(m) is not None for m in {list(HOST) + list(STAND_INS)!r}}}}}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise OverlayError(f"cannot run the python {python!r} (--python): {exc}") from exc
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_pip(python: str, args: list[str], what: str, *, offline_hint: str) -> None:
    cmd = [python, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        missing = any(s in tail for s in ("No matching distribution", "Could not find a version", "NewConnectionError",
                                          "Network is unreachable", "Temporary failure in name resolution",
                                          "No such file or directory"))
        cls = MissingDownload if missing else OverlayError
        raise cls(f"{what} failed ({' '.join(cmd)}):\n{tail}\n{offline_hint}")


def _wheel_tags(name: str) -> tuple[str, str, str]:
    parts = name[:-4].split("-")
    return parts[-3], parts[-2], parts[-1]


def check_wheel_dir(wheels: Path) -> list[str]:
    """The problems of a wheel folder (empty when fine): a pin without its wheel, a wheel that is compiled
    where it should be pure or is for another platform, a wrong upstream hash, a folder over the size limit."""
    problems = []
    files = sorted(p.name for p in wheels.glob("*.whl"))
    up = wheels / UPSTREAM_WHEEL
    if not up.exists():
        problems.append(f"{UPSTREAM_WHEEL} is missing")
    elif sha256(up) != UPSTREAM_SHA256:
        problems.append(f"{UPSTREAM_WHEEL}: sha256 {sha256(up)}, expected {UPSTREAM_SHA256}")
    for name, version in _pins().items():
        stem = f"{name.replace('-', '_').lower()}-{version}-"
        mine = [f for f in files if f.lower().startswith(stem)]
        if not mine:
            problems.append(f"no wheel for {name}=={version}")
            continue
        for f in mine:
            _, abi, plat = _wheel_tags(f)
            if name in PURE and (abi != "none" or plat != "any"):
                problems.append(f"{f}: compiled, expected a pure-python wheel (py3-none-any)")
            if name in ABI3 and (abi != "abi3" or "x86_64" not in plat):
                problems.append(f"{f}: expected a stable-ABI (abi3) x86_64 wheel")
        if name in PER_PYTHON:
            for v in PYTHONS:
                tag = "cp" + v.replace(".", "")
                if not any(_wheel_tags(f)[1] == tag and "x86_64" in _wheel_tags(f)[2] for f in mine):
                    problems.append(f"no {tag} x86_64 wheel for {name}=={version}")
    size = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    if size > WHEEL_DIR_LIMIT_BYTES:
        problems.append(f"{wheels}: {size >> 20} MiB of wheels, over the {WHEEL_DIR_LIMIT_BYTES >> 20} MiB limit")
    return problems


def _platform_args() -> list[str]:
    return [arg for plat in PLATFORMS for arg in ("--platform", plat)]


def download_to(wheels: Path, python: str = sys.executable) -> Path:
    """Fill ``wheels`` (network needed) with everything an offline build takes; returns it."""
    wheels.mkdir(parents=True, exist_ok=True)
    hint = "this step needs the package index"
    _log(f"downloading {UPSTREAM}=={UPSTREAM_VERSION} into {wheels}")
    _run_pip(python, ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
                      f"{UPSTREAM}=={UPSTREAM_VERSION}"], f"downloading {UPSTREAM}=={UPSTREAM_VERSION}",
             offline_hint=hint)
    for name, version in {**PURE, **ABI3}.items():
        _log(f"downloading {name}=={version}")
        _run_pip(python, ["download", "-q", "--no-deps", "--only-binary=:all:", *_platform_args(),
                          "--python-version", "3.11", "--implementation", "cp", "-d", str(wheels),
                          f"{name}=={version}"], f"downloading {name}=={version}", offline_hint=hint)
    for name, version in PER_PYTHON.items():
        for v in PYTHONS:
            _log(f"downloading {name}=={version} for CPython {v}")
            _run_pip(python, ["download", "-q", "--no-deps", "--only-binary=:all:", *_platform_args(),
                              "--python-version", v, "--implementation", "cp", "-d", str(wheels),
                              f"{name}=={version}"], f"downloading {name}=={version} (CPython {v})",
                     offline_hint=hint)
    problems = check_wheel_dir(wheels)
    if problems:
        raise OverlayError(f"the wheel folder {wheels} is not usable:\n  " + "\n  ".join(problems))
    size = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    _log(f"{wheels}: {len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    return wheels


def _fetch_upstream(python: str, wheels: Path | None) -> Path:
    dest_dir = cache_dir() / "wheels"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / UPSTREAM_WHEEL
    if not (dest.exists() and sha256(dest) == UPSTREAM_SHA256):
        if wheels is not None:
            src = wheels / UPSTREAM_WHEEL
            if not src.exists():
                raise MissingDownload(f"{UPSTREAM_WHEEL} is not in the wheel folder {wheels} (fill it with "
                                      f"scripts/upstream_overlay.sh --download-to {wheels} where there is a network)")
            shutil.copyfile(src, dest)
        else:
            _log(f"downloading {UPSTREAM}=={UPSTREAM_VERSION} (--no-deps)")
            _run_pip(python, ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest_dir),
                              f"{UPSTREAM}=={UPSTREAM_VERSION}"], f"downloading {UPSTREAM}=={UPSTREAM_VERSION}",
                     offline_hint="offline: pass --wheels DIR (a folder filled by --download-to DIR)")
    got = sha256(dest)
    if got != UPSTREAM_SHA256:
        dest.unlink()
        raise OverlayError(f"{UPSTREAM_WHEEL}: sha256 {got} does not match the pinned {UPSTREAM_SHA256}; "
                           "the file was deleted (a corrupt download, or another build under this name)")
    return dest


def _install_key(info: dict) -> str:
    stand_ins = sorted(m for m in STAND_INS if not info["found"][m])
    key = json.dumps([UPSTREAM_SHA256, sorted(_pins().items()), info["version"], stand_ins, STAND_IN_VERSION,
                      INSTALL_LAYOUT])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cached(target: Path, fill: Callable[[Path], str]) -> Path:
    """``target``, made once per cache: ``fill(folder)`` fills a fresh folder beside it and returns the text of its
    DONE marker, and the folder becomes ``target`` in one rename, so a half-made one is never used. One maker at a
    time (a lock beside it): pytest workers and a job beside them wait, then reuse what the first made."""
    if (target / "DONE").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "DONE").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
        try:
            (tmp / "DONE").write_text(fill(tmp))
            if target.exists():  # an unfinished earlier one (no DONE)
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(python: str, wheels: Path | None, info: dict) -> Path:
    target = cache_dir() / f"install-{_install_key(info)}"
    if (target / "DONE").exists():
        _log(f"install cached: {target}")
        return target
    t0 = time.monotonic()

    def fill(tmp: Path) -> str:
        wheel = _fetch_upstream(python, wheels)
        _log(f"unpacking {wheel.name}")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(f"{UPSTREAM}/")]
            zf.extractall(tmp / "upstream", members)
        # Its modules' bytecode, once, by the python that runs them (its version's tag): the copies hard-link it, so
        # no process compiles upstream again (its tests are compiled by pytest, which rewrites their asserts).
        _log("compiling upstream's modules")
        # A module that does not compile is left to the import that needs it (which then fails as it would).
        subprocess.run([python, "-m", "compileall", "-q", "-j", "0", "-x", r"/fastvideo/tests/", str(tmp / "upstream")],
                       capture_output=True, timeout=600)
        pins = [f"{n}=={v}" for n, v in _pins().items()]
        source = (["--no-index", "--find-links", str(wheels)] if wheels is not None else [])
        _log(f"installing {len(pins)} pinned packages (--no-deps) {'from ' + str(wheels) if wheels else ''}")
        _run_pip(python, ["install", "-q", "--no-deps", "--only-binary=:all:", "--no-compile", "--target",
                          str(tmp / "deps"), *source, *pins], "installing the pinned dependencies",
                 offline_hint=("the wheel folder lacks a pin: refill it with --download-to" if wheels else
                               "offline: pass --wheels DIR (a folder filled by --download-to DIR)"))
        for name in STAND_INS:
            if not info["found"][name]:
                _log(f"{name} does not import on {python}: writing a stand-in")
                write_stand_in(tmp / "stand_ins", name)
        return json.dumps({"pins": _pins(), "python": info["version"],
                           "seconds": round(time.monotonic() - t0, 1)}) + "\n"

    _cached(target, fill)
    _log(f"install ready in {time.monotonic() - t0:.1f} s: {target}")
    return target


STAND_IN_SOURCE = '''"""Stand-in for {name}, written by tests/overlay/build.py: every {name}.* module and name
imports (upstream FastVideo imports them at module level); calling or instantiating one raises. Not the real package."""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"
STAND_IN = True


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(cls.__qualname__ + "." + name)

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("{name}." + cls.__qualname__ + " is not available: {name} is a stand-in here")


_STUBS = {{}}


def _stub(qualname):
    if qualname not in _STUBS:
        _STUBS[qualname] = _StubMeta(qualname.rsplit(".", 1)[-1], (), {{"__qualname__": qualname}})
    return _STUBS[qualname]


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub((self.__name__[len("{name}."):] + "." + name).lstrip("."))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("{name}."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return importlib.import_module("{name}." + name)
'''


def write_stand_in(folder: Path, name: str) -> None:
    (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / name / "__init__.py").write_text(STAND_IN_SOURCE.format(name=name))


@dataclass(frozen=True)
class Overlay:
    root: Path  # holds fastvideo/ (upstream with this tree's files over it)
    install: Path  # the cached install (upstream/, deps/, stand_ins/)
    pythonpath: tuple[Path, ...]
    stand_ins: tuple[str, ...]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose python imports the overlay (and not this tree, nor an installed fastvideo)."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = os.pathsep.join(map(str, self.pythonpath))
        return env


def _make_overlay(install: Path, dest: Path | None, copy_tree: bool = True) -> Path:
    runs = cache_dir() / "overlays"
    runs.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in runs.iterdir():  # the copies of earlier runs: a day old and more
        try:
            if now - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    root = Path(tempfile.mkdtemp(prefix="run-", dir=runs)) if dest is None else dest
    target = root / UPSTREAM
    if target.exists():
        shutil.rmtree(target)
    # Upstream hard-linked (no copy of its 14 MB), then every file of this tree copied over: a link is
    # unlinked first, so the cached install is never written through.
    shutil.copytree(install / "upstream" / UPSTREAM, target, copy_function=os.link)
    if not copy_tree:
        _log(f"pure upstream {UPSTREAM_VERSION} in {target}")
        return root
    ours = ROOT / UPSTREAM
    copied = 0
    for src in sorted(ours.rglob("*")):
        if "__pycache__" in src.parts or src.suffix == ".pyc" or src.is_dir():
            continue
        dst = target / src.relative_to(ours)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        for stale in (dst.parent / "__pycache__").glob(f"{dst.stem}.*.pyc"):  # upstream's bytecode of it
            stale.unlink()
        shutil.copy2(src, dst)
        copied += 1
    _log(f"overlay: {copied} files of {ours} over upstream {UPSTREAM_VERSION} in {target}")
    return root


def _wheel_folder(wheels: Path | str | None, index: bool) -> Path | None:
    """The wheel folder to install from: ``wheels``, else ``$FASTVIDEO_OVERLAY_WHEELS``, else a filled
    ``.whl/overlay``; None (the package index) where there is none, or with ``index``."""
    if wheels is None and not index and os.environ.get("FASTVIDEO_OVERLAY_WHEELS"):
        wheels = os.environ["FASTVIDEO_OVERLAY_WHEELS"]
    if wheels is None and not index and DEFAULT_WHEELS.is_dir() and any(DEFAULT_WHEELS.glob("*.whl")):
        wheels = DEFAULT_WHEELS
    wheels = Path(wheels).resolve() if wheels is not None else None
    if wheels is not None:
        if not wheels.is_dir():
            raise MissingDownload(f"--wheels {wheels}: no such folder (fill one with --download-to {wheels})")
        _log(f"installing offline from {wheels}")
    return wheels


def upstream_source(*, python: str = sys.executable, wheels: Path | str | None = None, index: bool = False) -> Path:
    """The pinned upstream wheel's ``fastvideo/`` package unpacked once into the cache (nothing installed, nothing
    imported): the folder that holds it. The wheel comes as for ``build_overlay``; raises ``MissingDownload`` where
    it cannot be had."""
    target = cache_dir() / f"upstream-{UPSTREAM_VERSION}-{UPSTREAM_SHA256[:16]}"
    if (target / "DONE").exists():
        return target

    def fill(tmp: Path) -> str:
        with zipfile.ZipFile(_fetch_upstream(python, _wheel_folder(wheels, index))) as zf:
            zf.extractall(tmp, [m for m in zf.namelist() if m.startswith(f"{UPSTREAM}/")])
        return f"{UPSTREAM_WHEEL} sha256 {UPSTREAM_SHA256}\n"

    _cached(target, fill)
    _log(f"upstream {UPSTREAM}=={UPSTREAM_VERSION} unpacked: {target}")
    return target


def build_overlay(*, python: str = sys.executable, wheels: Path | str | None = None,
                  dest: Path | None = None, index: bool = False, pure: bool = False) -> Overlay:
    """Build (or reuse) the cached install and make a fresh overlay copy; see the module docstring. ``index``:
    download from the package index even where a wheel folder is found. ``pure``: the copy is upstream's alone
    (nothing of this tree over it), set up exactly as the overlay is, for comparisons."""
    wheels = _wheel_folder(wheels, index)
    info = _python_info(python)
    missing = sorted(pkg for mod, pkg in HOST.items() if not info["found"][mod])
    if missing:
        raise OverlayError(f"{python} lacks {', '.join(missing)}, which the overlay takes from the python that "
                           f"runs it: pip install {' '.join(missing)}")
    install = _install(python, wheels, info)
    root = _make_overlay(install, dest, copy_tree=not pure)
    stand_ins = tuple(sorted(p.name for p in (install / "stand_ins").glob("*"))) if (
        install / "stand_ins").is_dir() else ()
    path = [root, install / "deps"] + ([install / "stand_ins"] if stand_ins else [])
    return Overlay(root=root, install=install, pythonpath=tuple(path), stand_ins=stand_ins)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the python that will run the overlay")
    parser.add_argument("--wheels", type=Path, help=f"install offline from this folder (default {DEFAULT_WHEELS} "
                                                    "when it holds wheels)")
    parser.add_argument("--download-to", type=Path, metavar="DIR", help="fill DIR with every wheel an offline "
                                                                        "build needs, then stop")
    parser.add_argument("--index", action="store_true", help="download from the package index even where a wheel "
                                                                 "folder exists")
    parser.add_argument("--dest", type=Path, help="make the overlay copy here (default: a new folder in the cache)")
    args = parser.parse_args(argv)
    try:
        if args.download_to is not None:
            download_to(args.download_to.resolve(), args.python)
            return 0
        t0 = time.monotonic()
        overlay = build_overlay(python=args.python, wheels=args.wheels, dest=args.dest, index=args.index)
    except MissingDownload as exc:  # exit 3: offline without the wheels (the main job then says so and falls back)
        print(f"overlay: FAILED: {exc}", file=sys.stderr)
        return 3
    except OverlayError as exc:
        print(f"overlay: FAILED: {exc}", file=sys.stderr)
        return 1
    _log(f"ready in {time.monotonic() - t0:.1f} s; stand-ins: {', '.join(overlay.stand_ins) or 'none'}")
    print(os.pathsep.join(map(str, overlay.pythonpath)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
