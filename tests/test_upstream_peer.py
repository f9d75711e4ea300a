"""The upstream peer's loader (``benchmarks/cases/upstream_peer.py``) and the extension build's checks, on CPU:
each import line it points elsewhere must match exactly, or loading fails naming the line (a different upstream
file never runs in its place); the build refuses archives that are not the pinned ones, a sources folder whose
SOURCES.json names other archives or whose files changed since, and an NCCL library that lacks a symbol the
compiled code needs; ``scripts/build_nccl.sh`` refuses what is not an NCCL checkout and packs a built tree."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.cases import upstream_peer
from benchmarks.harness import header

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_upstream_comm", ROOT / "scripts" / "build_upstream_comm.py")
assert _spec is not None and _spec.loader is not None
buc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(buc)


def test_each_substitution_applies_exactly(tmp_path):
    f = tmp_path / "comm_ops.py"
    f.write_text(f"import torch\n{upstream_peer.EXT_IMPORT}\n")
    out = upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})
    assert out == "import torch\n_ops = X\n"


def test_negative_control_a_file_without_the_line_is_refused(tmp_path):
    f = tmp_path / "comm_ops.py"
    f.write_text("from somewhere_else import _ops\n")
    with pytest.raises(RuntimeError, match="found 0 times, expected 1"):
        upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})
    f.write_text(f"{upstream_peer.EXT_IMPORT}\n{upstream_peer.EXT_IMPORT}\n")  # twice where once is expected
    with pytest.raises(RuntimeError, match="found 2 times, expected 1"):
        upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})


def test_a_missing_build_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run scripts/build_upstream_comm\.py"):
        upstream_peer.load(tmp_path)


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/build_upstream_comm.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_build_refuses_archives_that_are_not_the_pinned_ones(tmp_path):
    fake = tmp_path / "fastvideo_kernel-0.3.5.tar.gz"
    fake.write_bytes(b"not the sdist")
    proc = _build("--sdist", str(fake), "--wheel", str(fake), "--nccl-home", str(tmp_path), "--out", str(tmp_path))
    assert proc.returncode != 0 and "not the pinned f2c865cd" in proc.stderr
    proc = _build("--sdist", str(tmp_path / "absent.tar.gz"), "--wheel", str(fake), "--nccl-home", str(tmp_path),
                  "--out", str(tmp_path))
    assert proc.returncode != 0 and "does not exist (fetch it into .whl/" in proc.stderr


def _files() -> dict[str, bytes]:
    """Stand-ins for the four files (the real ones come from the pinned archives, which tests do not carry)."""
    return {name: f"// {name}\n".encode() for name in buc.SOURCES}


def test_a_sources_folder_round_trips(tmp_path):
    buc.write_sources(_files(), tmp_path)
    manifest = json.loads((tmp_path / buc.MANIFEST).read_text())
    assert manifest["sdist"] == {"name": buc.SDIST_NAME, "sha256": buc.SDIST_SHA256}
    assert manifest["wheel"] == {"name": buc.WHEEL_NAME, "sha256": buc.WHEEL_SHA256}
    assert manifest["files"]["ulysses_a2a.py"]["from"] == "wheel:" + buc.SOURCES["ulysses_a2a.py"][1]
    assert buc.read_sources(tmp_path) == _files()
    buc.write_src(buc.read_sources(tmp_path), tmp_path / "src")
    assert (tmp_path / "src/include/comm/ulysses_all_to_all.cuh").is_file()
    assert (tmp_path / "src/binding.cpp").read_text() == buc.BINDING


def test_a_changed_file_is_refused_naming_it(tmp_path):
    buc.write_sources(_files(), tmp_path)
    assert buc.read_sources(tmp_path)  # negative control: untouched, it passes
    (tmp_path / "include/comm/ulysses_all_to_all.cuh").write_text("// edited\n")
    with pytest.raises(SystemExit, match=r"include/comm/ulysses_all_to_all\.cuh has sha256 \w+, not the \w+ "
                       r"SOURCES\.json records"):
        buc.read_sources(tmp_path)
    (tmp_path / "include/comm/ulysses_all_to_all.cuh").unlink()
    with pytest.raises(SystemExit, match=r"include/comm/ulysses_all_to_all\.cuh is missing"):
        buc.read_sources(tmp_path)


def test_a_folder_from_other_archives_is_refused(tmp_path):
    buc.write_sources(_files(), tmp_path)
    manifest = json.loads((tmp_path / buc.MANIFEST).read_text())
    assert buc.read_sources(tmp_path)  # negative control: the pinned archives pass
    other = json.loads(json.dumps(manifest))
    other["sdist"] = {"name": "fastvideo_kernel-0.3.6.tar.gz", "sha256": "0" * 64}
    (tmp_path / buc.MANIFEST).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"SOURCES\.json: its files come from the sdist fastvideo_kernel-0\.3\.6"
                       r"\.tar\.gz \(sha256 0+\), not the pinned fastvideo_kernel-0\.3\.5\.tar\.gz"):
        buc.read_sources(tmp_path)
    other = json.loads(json.dumps(manifest))
    other["wheel"]["sha256"] = "1" * 64  # the right name, another file
    (tmp_path / buc.MANIFEST).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"from the wheel fastvideo-0\.2\.1-py3-none-any\.whl \(sha256 1+\)"):
        buc.read_sources(tmp_path)
    other = json.loads(json.dumps(manifest))
    del other["files"]["comm_ops.py"]
    (tmp_path / buc.MANIFEST).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"lists .*, not the files the build uses"):
        buc.read_sources(tmp_path)
    (tmp_path / buc.MANIFEST).unlink()
    with pytest.raises(SystemExit, match=r"no SOURCES\.json \(remake the folder: --sdist"):
        buc.read_sources(tmp_path)


def _nccl_home(path: Path, minor: int = 30) -> Path:
    (path / "include").mkdir(parents=True)
    (path / "include/nccl_device.h").write_text("")
    (path / "include/nccl.h").write_text(f"#define NCCL_MAJOR 2\n#define NCCL_MINOR {minor}\n#define NCCL_PATCH 7\n")
    return path


def test_the_build_refuses_a_changed_sources_folder_before_compiling(tmp_path):
    sources, home = tmp_path / "sources", _nccl_home(tmp_path / "nccl")
    buc.write_sources(_files(), sources)
    (sources / "comm_ops.py").write_text("# edited\n")
    proc = _build("--sources", str(sources), "--nccl-home", str(home), "--out", str(tmp_path / "out"))
    assert proc.returncode != 0 and "comm_ops.py has sha256" in proc.stderr, proc.stderr
    proc = _build("--sources", str(sources), "--sdist", str(tmp_path), "--nccl-home", str(home), "--out",
                  str(tmp_path / "out"))
    assert proc.returncode == 2 and "one way of the two" in proc.stderr, proc.stderr
    proc = _build("--sdist", str(tmp_path / "a.tar.gz"), "--sources-out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--sources-out takes the files from --sdist and --wheel" in proc.stderr


def _cc(tmp_path: Path, name: str, code: str, *flags: str) -> Path:
    if shutil.which("cc") is None or shutil.which("nm") is None:
        pytest.skip("needs cc and nm")
    (tmp_path / f"{name}.c").write_text(code)
    out = tmp_path / name
    subprocess.run(["cc", *flags, str(tmp_path / f"{name}.c"), "-o", str(out)], check=True)
    return out


def test_the_symbol_check_names_what_a_library_lacks(tmp_path):
    obj = _cc(tmp_path, "ext.o", "void ncclNew(void); void ncclOld(void); void f(void) { ncclNew(); ncclOld(); }",
              "-c", "-fPIC")
    new = _cc(tmp_path, "libnew.so", "void ncclNew(void) {} void ncclOld(void) {}", "-shared", "-fPIC")
    old = _cc(tmp_path, "libold.so", "void ncclOld(void) {}", "-shared", "-fPIC")
    assert buc.needed_nccl_symbols([obj]) == ["ncclNew", "ncclOld"]
    report = buc.check_symbols([obj], [new, old])
    assert report[str(new)]["missing"] == []  # negative control: a library with both passes
    assert report[str(old)]["missing"] == ["ncclNew"]
    assert buc._symbols_verdict({str(new): report[str(new)]}) == 0
    assert buc._symbols_verdict(report) == 1
    with pytest.raises(SystemExit, match=r"--check-symbols .*absent\.so: no such file"):
        buc.check_symbols([obj], [tmp_path / "absent.so"])


def test_the_build_preloads_its_nccl_because_a_loaded_one_captures_the_soname(tmp_path):
    """The loader fact ``preloaded_env`` rests on: a process that already holds one ``libnccl.so.2`` (torch's,
    loaded by path) binds a new module's ``libnccl.so.2`` to it, whatever the module's rpath says; preloading the
    tree's library is what makes the module load."""
    for tree in ("old", "new"):
        (tmp_path / tree / "lib").mkdir(parents=True)
        (tmp_path / tree / "include").mkdir()
    soname = "-Wl,-soname,libnccl.so.2"
    old = _cc(tmp_path, "old/lib/libnccl.so.2", "void ncclOld(void) {}", "-shared", "-fPIC", soname)
    _cc(tmp_path, "new/lib/libnccl.so.2", "void ncclOld(void) {} void ncclNew(void) {}", "-shared", "-fPIC", soname)
    new_lib = tmp_path / "new" / "lib"
    ext = _cc(tmp_path, "ext.so", "void ncclNew(void); void f(void) { ncclNew(); }", "-shared", "-fPIC",
              f"-L{new_lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{new_lib}")
    program = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); ctypes.CDLL(sys.argv[2]); print('loaded')"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}

    def run(environ: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", program, str(old), str(ext)], capture_output=True, text=True,
                              env=environ, timeout=60)

    bare = run(env)  # negative control: the module binds to the library already loaded, which lacks ncclNew
    assert bare.returncode != 0 and "ncclNew" in bare.stderr
    preloaded = buc.preloaded_env(tmp_path / "new", env)
    assert preloaded is not None and preloaded["LD_PRELOAD"].split(":")[0] == str((new_lib / "libnccl.so.2").resolve())
    assert run(preloaded).stdout.strip() == "loaded"
    assert buc.preloaded_env(tmp_path / "new", preloaded) is None  # already first: the re-run does not loop
    assert buc.preloaded_env(tmp_path / "headers-only", env) is None  # no library: nothing to preload


def test_two_nccl_libraries_in_one_process_are_named_and_refused(tmp_path):
    """What the upstream peer checks before handing torch's communicator to upstream's extension: every libnccl
    mapped into the process, with its version; one passes, two are refused, naming both.

    The fakes are compared against what the process had mapped before loading them: a CUDA torch maps its own
    libnccl at import (a GPU host), a CPU torch none. Each case also runs with a third fake preloaded, standing in
    for a CUDA torch's own library, so that both kinds of host are exercised on every host."""
    libs = []
    for tree, code in (("a", 22809), ("b", 23007), ("torch", 22809)):
        (tmp_path / tree).mkdir()
        libs.append(_cc(tmp_path, f"{tree}/libnccl.so.2", f"int ncclGetVersion(int *v) {{ *v = {code}; return 0; }}",
                        "-shared", "-fPIC"))
    program = ("import ctypes, json, sys; from benchmarks.cases import upstream_peer as u\n"
               "from benchmarks.harness import header as h\n"
               "before = h.nccl_libraries()\n"
               "[ctypes.CDLL(p) for p in sys.argv[1:]]\n"
               "found = h.nccl_libraries(); new = {p: v for p, v in found.items() if p not in before}\n"
               "print(json.dumps([before, new, u.nccl_conflict('2.28.9', new), u.nccl_conflict('2.28.9', found)]))")

    def run(*paths: Path, preload: Path | None = None) -> tuple[dict[str, str], dict[str, str], str, str]:
        env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, [str(preload or ""), os.environ.get("LD_PRELOAD")]))}
        done = subprocess.run([sys.executable, "-c", program, *map(str, paths)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=True, env=env)
        before, new, why_new, why_all = json.loads(done.stdout.splitlines()[-1])
        return before, new, why_new, why_all

    a, b, own = (str(lib.resolve()) for lib in libs)
    for preload in (None, libs[2]):
        before, one, why_one, why_process = run(libs[0], preload=preload)
        if preload is not None:
            assert before.get(own) == "2.28.9", before  # the stand-in for a CUDA torch's own libnccl
        assert one == {a: "2.28.9"} and why_one == ""
        # The process as a whole: one library passes; a CUDA torch's own beside the fake is two, both named.
        if before:
            assert why_process.startswith(f"{len(before) + 1} NCCL libraries loaded"), why_process
            assert all(path in why_process for path in [*before, a]), why_process
        else:
            assert why_process == ""
        _, both, why_both, why_process = run(*libs[:2], preload=preload)  # the control: a second, another version
        assert both == {a: "2.28.9", b: "2.30.7"}
        assert why_both.startswith("2 NCCL libraries loaded") and b in why_both
        assert why_process.startswith(f"{len(before) + 2} NCCL libraries loaded"), why_process
    assert upstream_peer.nccl_conflict("2.30.7", {}) == ""
    # The header names the NCCL that runs, not only the one torch was built against.
    assert header.describe_nccl("2.28.9", ["2.30.7"]) == "2.30.7 (torch built against 2.28.9)"
    assert header.describe_nccl("2.28.9", ["2.28.9"]) == header.describe_nccl("2.28.9", []) == "2.28.9"


def _nccl_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/build_nccl.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def _nccl_checkout(path: Path, minor: int = 30, built: str | None = "2.30.7") -> Path:
    """A stand-in checkout: NCCL's version file and, where ``built``, a build tree as its make leaves it."""
    (path / "makefiles").mkdir(parents=True)
    (path / "src").mkdir()
    (path / "src/Makefile").write_text("")
    (path / "makefiles/version.mk").write_text(f"NCCL_MAJOR   := 2\nNCCL_MINOR   := {minor}\nNCCL_PATCH   := 7\n"
                                               "NCCL_SUFFIX  :=\nPKG_REVISION := 1\n")
    if built:
        _nccl_home(path / "build", int(built.split(".")[1]))
        lib = path / "build/lib"
        lib.mkdir()
        _cc(path, f"build/lib/libnccl.so.{built}", "int ncclStandIn(void) { return 0; }", "-shared", "-fPIC")
        (lib / "libnccl.so.2").symlink_to(f"libnccl.so.{built}")
    return path


def test_build_nccl_refuses_a_missing_or_wrong_source(tmp_path):
    proc = _nccl_script("--arch", "90", "--out", str(tmp_path / "n.tar.xz"))
    assert proc.returncode != 0 and "--source DIR is required: a checkout of https://github.com/NVIDIA/nccl" \
        in proc.stderr, proc.stderr
    proc = _nccl_script("--source", str(tmp_path / "absent"), "--arch", "90", "--out", str(tmp_path / "n.tar.xz"))
    assert proc.returncode != 0 and "--source " in proc.stderr and "does not exist" in proc.stderr
    proc = _nccl_script("--source", str(tmp_path), "--arch", "90", "--out", str(tmp_path / "n.tar.xz"))
    assert proc.returncode != 0 and "not an NCCL checkout" in proc.stderr
    old = _nccl_checkout(tmp_path / "old", minor=28, built=None)
    proc = _nccl_script("--source", str(old), "--arch", "90", "--out", str(tmp_path / "n.tar.xz"))
    assert proc.returncode != 0 and "is NCCL 2.28.7; upstream's kernel needs 2.29 or later" in proc.stderr
    proc = _nccl_script("--source", str(old), "--arch", "sm_90", "--out", str(tmp_path / "n.tar.xz"))
    assert proc.returncode != 0 and "--arch sm_90: an SM version such as 90" in proc.stderr


def test_build_nccl_packs_a_built_tree_without_rebuilding(tmp_path):
    # Negative control of the refusals above: a checkout already built at its version packs (make never runs:
    # this checkout has no Makefile for it), the library stripped and its two links kept.
    source = _nccl_checkout(tmp_path / "nccl")
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin/nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin/nvcc").chmod(0o755)
    out = tmp_path / "up" / "nccl-2.30.7-sm90.tar.xz"
    proc = _nccl_script("--source", str(source), "--arch", "90", "--out", str(out), env={"CUDA_HOME": str(cuda)})
    assert proc.returncode == 0, proc.stderr
    assert "make skipped" in proc.stdout and "NCCL 2.30.7 (nccl.h), sm_90" in proc.stdout
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["lib/libnccl.so.2.30.7"].isfile()
    assert members["lib/libnccl.so.2"].linkname == "libnccl.so.2.30.7"
    assert members["lib/libnccl.so"].linkname == "libnccl.so.2"
    assert members["include/nccl.h"].isfile() and members["include/nccl_device.h"].isfile()
    # A build recorded for another architecture is not taken for this one (NCCL's make would only relink it).
    (source / "build/BUILT_FOR_ARCH").write_text("100\n")
    proc = _nccl_script("--source", str(source), "--arch", "90", "--out", str(out), env={"CUDA_HOME": str(cuda)})
    assert proc.returncode != 0 and "was built for sm_100, not sm_90: run 'make -C" in proc.stderr, proc.stderr
    # A build of another version is not taken for the source's.
    other = _nccl_checkout(tmp_path / "stale", built="2.29.1")
    proc = _nccl_script("--source", str(other), "--arch", "90", "--out", str(out), env={"CUDA_HOME": str(cuda)})
    assert proc.returncode != 0 and "holds NCCL 2.29.1, not the source's 2.30.7" in proc.stderr
