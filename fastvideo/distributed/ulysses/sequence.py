"""A helper's call-site tags: the SEQ word a tagged call votes (``contract.py``, field 1). Local.

The helper numbers every call, and an untagged forward votes that number; a tagged forward votes its tag's own
count for its phase (``contract.tag_seq``), kept here; a backward votes the word its forward voted (carried in the
op's saved outcome), so ranks whose autograd reaches the backward exchanges of two calls in different orders
differ in SEQ and raise together instead of swapping gradients (two backward passes over one call vote one word:
their order is the caller's to keep, as an untagged call's is).
"""

from __future__ import annotations

import logging

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import Phase

logger = logging.getLogger("fastvideo.distributed.ulysses.helper")

TAGS_WARN = 4096  # distinct call tags per helper past which a warning says tags name call sites, not calls
_FORWARD_GRAD, _BACKWARD = Phase.FORWARD_GRAD, Phase.BACKWARD


class TagCounter:
    """Each call-site tag's counts per phase (identical on every rank that makes the same calls)."""

    __slots__ = ("_tags", "generation")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        # Per tag: [count per phase (3), the SEQ word of call 0 per phase (3)] (``contract.tag_bases``, hashed once).
        self._tags: dict[str, list[int]] = {}

    def word(self, phase: Phase, tag: str, word: int) -> int:
        """The SEQ word of the next call tagged ``tag`` in ``phase``, which it counts: for a backward ``word``,
        its forward's."""
        entry = self._tags.get(tag)
        if entry is None:  # a new tag: its SEQ words of call 0 hashed once
            entry = self._tags[tag] = [0, 0, 0, *contract.tag_bases(tag)]
            if len(self._tags) == TAGS_WARN:
                logger.warning("Ulysses helper gen%d has seen %d distinct call tags: a tag should name a call site "
                               "(e.g. 'blocks.3.attn.qkv'), not a call; each one is kept for the helper's life.",
                               self.generation, TAGS_WARN)
        count = entry[phase]
        entry[phase] = count + 1
        return word if phase is _BACKWARD else entry[phase + 3] ^ count

    def rollback(self, tag: str | None, phase: Phase, word: int) -> int:
        """A call that raised on every rank is not counted for its tag: returns the count it had (0 untagged; for a
        backward, its forward's count, from the SEQ word ``word`` it voted)."""
        if tag is None:
            return 0
        entry = self._tags[tag]
        entry[phase] -= 1
        return entry[phase] if phase is not _BACKWARD else (word ^ entry[3 + _FORWARD_GRAD]) & contract.TAG_COUNT_MASK

    def tag_counts(self) -> dict[str, tuple[int, int, int]]:
        """Each tag's calls so far, per phase (``Phase`` order)."""
        return {tag: tuple(entry[:3]) for tag, entry in self._tags.items()}
