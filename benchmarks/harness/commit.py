"""The commit a tree's files are: its ``COMMIT`` stamp (what an exported tree carries instead of ``.git``) or its
checkout's HEAD (``describe_commit``). One rule for every record: the benchmark header imports it, and the GPU
scripts run it (``python3 benchmarks/harness/commit.py DIR``: the commit on stdout, the note, if any, on stderr).
Standard library only, so any python runs it, before any set-up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def _changed(tree: Path, rev: str) -> int:
    """How many tracked paths of ``tree``'s files differ from ``rev`` (0: the files are ``rev``'s)."""
    return len(_git(tree, "diff", "--name-only", rev, "--").splitlines())


def describe_commit(tree: Path) -> tuple[str, str | None]:
    """``(commit, note)``: the commit ``tree``'s files are, and where a ``COMMIT`` stamp and the checkout's HEAD
    disagree, a note saying which was recorded and why (else None). ``scripts/gpu_lib.sh``'s ``tree_commit`` runs
    this module.

    Not a checkout of its own (an exported tree, a folder inside another repository): the stamp, else "unknown".
    A checkout without a stamp, or whose stamp is its HEAD: HEAD, plus ``-dirty`` for changed tracked files.
    Where they disagree, the files decide, since either can be the stale one: a stamp left behind in a checkout
    that moved on names an older commit, and a tree copied over a checkout of another commit (a GPU host's copy)
    carries a ``.git`` whose HEAD is not its files'. A stamp this checkout's git does not know cannot be compared:
    it is recorded unless the files are exactly HEAD's (no changed tracked file, no untracked one). A stamp it
    knows: the one of the two with fewer changed tracked paths (HEAD on a tie), plus ``-dirty`` where any differ.
    """
    stamp_file = tree / "COMMIT"
    stamp = stamp_file.read_text().strip() if stamp_file.is_file() else ""
    try:
        head = _git(tree, "rev-parse", "HEAD")
        own = Path(_git(tree, "rev-parse", "--show-toplevel")).resolve() == tree.resolve()
    except (OSError, subprocess.SubprocessError):
        own = False
    if not own:
        return stamp or "unknown", None
    try:
        return _decide(tree, stamp, head)
    except (OSError, subprocess.SubprocessError) as exc:
        return stamp or head, f"git failed in {tree} ({exc}): recorded {'the COMMIT stamp' if stamp else 'HEAD'}"


def _decide(tree: Path, stamp: str, head: str) -> tuple[str, str | None]:
    """``describe_commit`` for a checkout of its own whose HEAD is ``head``."""
    try:
        known = _git(tree, "rev-parse", "--verify", "--quiet", f"{stamp}^{{commit}}") if stamp else head
    except subprocess.CalledProcessError:  # not a commit this checkout has
        known = ""
    if known == head:
        dirty = _git(tree, "status", "--porcelain", "--untracked-files=no")
        return head + ("-dirty" if dirty else ""), None
    changed_head = _changed(tree, head)
    said = f"the COMMIT stamp {stamp} disagrees with this checkout's HEAD {head}"
    if not known:
        if changed_head == 0 and not _git(tree, "ls-files", "--others", "--exclude-standard"):
            return head, f"{said}: the stamp names no commit of this checkout and the files are HEAD's: recorded HEAD"
        return stamp, (f"{said}: the stamp names no commit of this checkout (a tree copied over a checkout of another "
                       "commit?) and the files are not HEAD's: recorded the stamp, unchecked")
    changed_stamp = _changed(tree, known)
    chosen, changed, which = ((known, changed_stamp, "the stamp") if changed_stamp < changed_head
                              else (head, changed_head, "HEAD"))
    commit = chosen + ("-dirty" if changed else "")
    return commit, (f"{said}: {changed_head} tracked path(s) differ from HEAD, {changed_stamp} from the stamp: "
                    f"recorded {which} ({commit})")


def tree_commit(tree: Path) -> str:
    """The commit ``tree``'s files are (``describe_commit``, without the note)."""
    return describe_commit(tree)[0]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR (prints the commit DIR's files are; a note on stderr)")
    commit, note = describe_commit(Path(sys.argv[1]))
    print(commit)
    if note:
        print(note, file=sys.stderr)
