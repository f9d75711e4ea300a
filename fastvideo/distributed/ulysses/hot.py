"""The fused call's hot case in one native call: the hot-path extension (``csrc/ulysses_hot/hot_calls.cpp``) and
the table a native transport keeps in it.

A DiT's layers repeat a few call signatures. Once the helper has proposed, voted and launched one of them fused
on its Python path, the transport holds that signature in a ``HotCalls`` table: the output shape, the launch's
call description and the proposal's vote row. The signature's later eager calls (a forward autograd does not
record, not captured, untagged or tagged, even splits) then make their host path to the launch in one native call,
``HotCalls.run``: match the tensor's metadata, check the stream is not capturing, allocate the output, write the
call's SEQ word, and make the voted ``fvk_launch``. Everything after it (the library's stage, the verdict where it
did not launch, the record, the watchdog) is the Python path's own code. Python stays the oracle: the table holds
only what the Python path decided, and a call it does not hold comes back as None with nothing done.

The extension is built per torch install (``fastvideo-kernel/build_hot.py``) and loaded from beside the kernel
library; a missing, stale or foreign build is a reason (``load``), never an error: calls take the Python path.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

from fastvideo.distributed.ulysses.contract import Field
from fastvideo.distributed.ulysses.launch import Launch
from fastvideo.distributed.ulysses.policy import Plan

logger = logging.getLogger(__name__)

NAME = "fastvideo_ulysses_hot"
INTERFACE = 1  # hot_calls.cpp's kInterface: what run() returns and add() takes
LIMIT = 64  # signatures per table, past which it starts again (a DiT has a few; run() scans them)
BUILD_HINT = "python fastvideo-kernel/build_hot.py --out {directory}"


def torch_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the running torch: what a build of the extension must have been built against."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__)
    return (int(found[1]), int(found[2]), int(found[3])) if found else (0, 0, 0)


def build_record(directory: Path) -> Path:
    """The file ``build_hot.py`` writes beside the extension: what it was built against (read before loading it)."""
    return directory / f"{NAME}.json"


def check_record(record: dict) -> str:
    """Local, pure. Why a build described by ``record`` (``build_record``'s JSON) cannot be loaded here, or ""."""
    if record.get("interface") != INTERFACE:
        return f"built with interface {record.get('interface')}, this code needs {INTERFACE}"
    if tuple(record.get("torch", ())) != torch_version():
        return f"built for torch {record.get('torch')}, this is torch {torch.__version__}"
    if bool(record.get("cuda")) != (torch.version.cuda is not None):
        return f"built {'with' if record.get('cuda') else 'without'} CUDA, this torch is the other kind"
    return ""


@functools.cache
def load(directory: Path) -> tuple[ModuleType | None, str]:
    """Local, never raises, once per directory: (the extension module, "") or (None, why not). ``directory``: the
    kernel library's. A build is loaded only when its record says it was built for this torch (an extension
    built against another torch may not even import)."""
    hint = BUILD_HINT.format(directory=directory)
    try:
        record = json.loads(build_record(directory).read_text())
    except FileNotFoundError:
        return None, f"not built beside the kernel library ({hint})"
    except (OSError, ValueError) as exc:
        return None, f"unreadable build record {build_record(directory)} ({exc}); rebuild: {hint}"
    stale = check_record(record)
    if stale:
        return None, f"{stale}; rebuild: {hint}"
    path = directory / str(record.get("file", ""))
    try:
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_loader(NAME, loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure is a reason: calls take the Python path
        return None, f"cannot load {path}: {type(exc).__name__}: {exc}; rebuild: {hint}"
    if getattr(module, "INTERFACE", None) != INTERFACE:
        return None, f"{path} has interface {getattr(module, 'INTERFACE', None)}, this code needs {INTERFACE}"
    return module, ""


class Held(NamedTuple):
    """One slot of the table: the proposal it runs, and what the C++ entry points at, kept alive with it (the
    launch's call description, the vote row's words: the vote may drop its own reference to them)."""

    proposal: Any
    launch: Launch
    words: Any


class HotPath:
    """One native transport's table of hot signatures, in the extension. Local to the rank; not thread-safe (one
    call at a time, as the transport). ``run``: the extension's ``HotCalls.run`` itself, what the helper calls:
    ``run(x, mode, seq)`` -> None (not a held signature, or a capture: nothing done) or ``hit``, which ``finish``
    takes."""

    def __init__(self, module: ModuleType, launch: int, ctx: int, vote: int,
                 launch_for: Callable[[Any, Plan, torch.dtype, bool], Launch], finish: Callable[..., Any]) -> None:
        self._calls = module.HotCalls(launch, ctx, vote, int(Field.SEQ))
        self.run = self._calls.run
        self._launch_for, self._finish = launch_for, finish
        self._held: list[Held] = []

    def hold(self, x: torch.Tensor, proposal: Any, row: tuple[Any, int]) -> int:
        """Hold ``x``'s signature (its shape, dtype, device; the proposal's mode) with ``proposal`` (its geometry and
        plan) and its vote row ``row`` (``ShmVote.send_row``'s ``(words, address)``). Returns its slot. Raises for a
        plan this build cannot launch through the one entry (nothing held then)."""
        launch = self._launch_for(proposal.geom, proposal.plan, x.dtype, False)
        if launch.desc is None:
            raise ValueError("the hot path needs the one launch entry (fvk_launch)")
        self._held.append(Held(proposal, launch, row[0]))  # first: a slot the table reports is always held here
        try:
            slot = self._calls.add(x, proposal.geom.mode, list(launch.out_shape), ctypes.addressof(launch.desc),
                                   row[1])
        except BaseException:
            self._held.pop()
            raise
        if slot != len(self._held) - 1:
            raise RuntimeError(f"the table's slot {slot} is not the next one, {len(self._held) - 1}")
        return slot

    def proposal(self, slot: int) -> Any:
        """The proposal of ``slot`` (what ``run`` reported it launched)."""
        return self._held[slot].proposal

    def finish(self, x: torch.Tensor, hit: tuple, vote) -> torch.Tensor | None:
        """The transport's end of ``execute`` for a call ``run`` launched (``hit``): its stage, status and
        completion record, as after the transport's own launch."""
        out, slot, _stage, status, raw = hit
        held = self._held[slot]
        return self._finish(out, status, vote, held.launch, held.proposal.plan, x.get_device(), raw)

    def clear(self) -> None:
        """Forget every signature (a replan changes what the Python path would propose)."""
        self._calls.clear()
        self._held.clear()

    def close(self) -> None:
        """Forget every signature for good (the transport or its vote is gone): ``run`` then finds none."""
        self._calls.close()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._calls)


class HotLane:
    """A helper's hot lane: the transport's table (``HotPath``) once it holds a signature, or why there is none.
    Local to the rank; the helper calls ``run`` (the table's bound C++ method itself, None while no signature is
    held) for a forward autograd does not record, with even splits, not captured."""

    __slots__ = ("_table", "_transport", "_vote", "decline", "finish", "generation", "proposal", "run")

    def __init__(self, transport: Any, vote: Any, decline: str, generation: int) -> None:
        self._transport, self._vote, self.generation = transport, vote, generation
        self.decline = decline  # "" while the lane may learn signatures, else why it is off
        self._table: HotPath | None = None
        # The table's own bound methods while it holds signatures (None before): the hot case calls them directly,
        # no frame of this object's in between. ``run(x, mode, seq)``: the launch or None; ``proposal(slot)``: what
        # it launched; ``finish(x, hit, vote)``: the transport's end of that call (``HotPath``).
        self.run: Callable[..., Any] | None = None
        self.proposal: Callable[[int], Any] | None = None
        self.finish: Callable[..., Any] | None = None

    def learn(self, x: torch.Tensor, proposal: Any) -> None:
        """Local, host-only. After the Python path's own voted launch of a call the lane may take: hold its
        signature, with its proposal, in the transport's table; its later calls then take the lane. A table the lane
        did not hold yet (the first, or a new one after the transport closed its last) is emptied first, so it holds
        only proposals of the helper's current plan. Any failure turns the lane off, once, with a warning: every
        call runs on the Python path as before."""
        try:
            table = self._transport.hot_path(self._vote)
            if table is None:
                self.decline = self._transport.hot_decline() or "the transport built no table"
                return
            if table is not self._table or len(table) >= LIMIT:
                table.clear()
            table.hold(x, proposal, self._vote.send_row(proposal.fields))
        except Exception as exc:  # noqa: BLE001 - the Python path still runs every call
            logger.warning("Ulysses hot path off for helper gen%d (%s: %s); calls take the Python path.",
                           self.generation, type(exc).__name__, exc)
            self._table = self.run = self.proposal = self.finish = None
            self.decline = f"turned off after {type(exc).__name__}: {exc}"
            return
        self._table, self.run, self.proposal, self.finish = table, table.run, table.proposal, table.finish

    def switch(self, on: bool) -> str:
        """Local: let the lane learn signatures again (``on``, where its transport can: returns why not otherwise)
        or turn it off; either way it starts empty (the Python path decides every call until it learns)."""
        self.forget()
        self._table = self.run = self.proposal = self.finish = None
        self.decline = (self._transport.hot_decline() if self._transport is not None else "no transport") if on \
            else "turned off"
        return self.decline

    def forget(self) -> None:
        """Local: a replan may change every held signature's proposal; the Python path learns them again."""
        if self._table is not None:
            self._table.clear()

    def report(self) -> dict:
        return {"hot_path": self.decline or "on",
                "hot_signatures": len(self._table) if self._table is not None else 0}
