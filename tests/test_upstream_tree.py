"""``tests/upstream_tree.py``: where the tests that compare with upstream FastVideo find its source, and what they
say where it is not at hand."""

from __future__ import annotations

import pytest

from tests import upstream_tree
from tests.overlay import build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No cached answer, an empty overlay cache, no wheel folder, no given root."""
    upstream_tree._find.cache_clear()
    monkeypatch.setenv("FASTVIDEO_OVERLAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTVIDEO_UPSTREAM_ROOT", raising=False)
    monkeypatch.delenv("FASTVIDEO_OVERLAY_WHEELS", raising=False)
    yield tmp_path
    upstream_tree._find.cache_clear()


def test_a_given_root_without_upstreams_package_is_named(fresh, monkeypatch):
    monkeypatch.setenv("FASTVIDEO_UPSTREAM_ROOT", str(fresh))
    found = upstream_tree._find()
    assert isinstance(found, str) and f"FASTVIDEO_UPSTREAM_ROOT={fresh}" in found and "fastvideo/__init__.py" in found


def test_a_given_root_is_used_as_is(fresh, monkeypatch):
    (fresh / "fastvideo").mkdir()
    (fresh / "fastvideo" / "__init__.py").write_text("")
    monkeypatch.setenv("FASTVIDEO_UPSTREAM_ROOT", str(fresh))
    assert upstream_tree.root() == fresh
    with pytest.raises(AssertionError, match=r"has no fastvideo/envs\.py"):
        upstream_tree.path("envs.py")


def test_a_wheel_folder_without_the_wheel_is_a_missing_download(fresh, monkeypatch):
    """Offline with a wheel folder that lacks upstream's wheel: skipped with the reason, a failure under CI."""
    (fresh / "whl").mkdir()
    monkeypatch.setenv("FASTVIDEO_OVERLAY_WHEELS", str(fresh / "whl"))
    with pytest.raises(build.MissingDownload, match="is not in the wheel folder"):
        build.upstream_source()
    monkeypatch.setattr(upstream_tree, "CI", False)
    with pytest.raises(pytest.skip.Exception, match="not at hand"):
        upstream_tree.root()
    upstream_tree._find.cache_clear()
    monkeypatch.setattr(upstream_tree, "CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        upstream_tree.root()


def test_the_pinned_wheel_unpacks_upstreams_package(fresh, monkeypatch):
    """From a wheel folder holding the pinned wheel (the one the real cache holds, fetched first as every upstream
    comparison fetches it): the unpacked tree holds upstream's package and is reused. Control: a wheel of other
    bytes is refused by its sha256."""
    monkeypatch.delenv("FASTVIDEO_OVERLAY_CACHE")
    upstream_tree.root()  # skips offline without the wheel, fails under CI
    source = build.cache_dir() / "wheels" / build.UPSTREAM_WHEEL
    monkeypatch.setenv("FASTVIDEO_OVERLAY_CACHE", str(fresh / "cache"))
    (fresh / "whl").mkdir()
    (fresh / "whl" / build.UPSTREAM_WHEEL).write_bytes(source.read_bytes())
    monkeypatch.setenv("FASTVIDEO_OVERLAY_WHEELS", str(fresh / "whl"))
    tree = build.upstream_source()
    assert (tree / "fastvideo" / "envs.py").is_file() and (tree / "DONE").is_file()
    assert build.upstream_source() == tree
    (fresh / "whl" / build.UPSTREAM_WHEEL).write_bytes(b"not the wheel")
    monkeypatch.setenv("FASTVIDEO_OVERLAY_CACHE", str(fresh / "cache2"))
    with pytest.raises(build.OverlayError, match="does not match the pinned"):
        build.upstream_source()


def test_a_cache_entry_is_made_once_and_a_failed_one_leaves_nothing(tmp_path):
    """``build._cached``: what ``fill`` wrote becomes the entry only when it returns; a later call reuses it."""
    calls = []

    def failing(folder):
        (folder / "half").write_text("")
        raise RuntimeError("download cut")

    def fill(folder):
        calls.append(folder)
        (folder / "file").write_text("made")
        return "done\n"

    target = tmp_path / "entry"
    with pytest.raises(RuntimeError, match="download cut"):
        build._cached(target, failing)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == ["entry.lock"]
    assert build._cached(target, fill) == target and (target / "file").read_text() == "made"
    assert (target / "DONE").read_text() == "done\n"
    assert build._cached(target, fill) == target and len(calls) == 1
