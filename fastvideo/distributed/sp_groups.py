"""Sequence-parallel (SP) process groups and their coordinator.

The world is cut into SP groups of ``sp_size`` consecutive ranks (ranks ``[k*sp, (k+1)*sp)``); the
data-parallel groups run across them (ranks with the same SP rank). Each SP group has a *device*
group (NCCL on CUDA, gloo on CPU) that carries the all-to-all, a gloo *CPU* group for host-side
agreement, and a gloo *vote* group that carries the Ulysses helpers' construction and per-call
votes: created once here, shared by every helper built on the group (each with its own generation),
and destroyed with the group, so rebuilding helpers creates no process group. Creation is collective
over the world (``torch.distributed.new_group`` needs every rank).

Settings: ``initialize_sequence_parallel`` validates every ``FASTVIDEO_*`` variable on every rank and
agrees the ones that decide collectives across each SP group (``settings.py``); ranks that differ
decline together to each setting's conservative value, warning on every rank. ``GroupCoordinator.settings``
holds them; nothing re-reads the environment per call (``agree_ulysses_settings()`` re-agrees after a change on
every rank).

This module knows nothing of the layers above it: whoever builds something on a group that must be
torn down before the group (the Ulysses helper) registers a hook with ``add_teardown``. Upstream
FastVideo's entry points (the world and TP groups, init and cleanup) build on these groups in
``parallel_state``, which re-exports every public name here; callers import them from there. The class and
the SP state share this module so that a call's one stop in this layer (``get_sp_group()``, then the
coordinator's ``world_size``) enters one module.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fastvideo import envs
from fastvideo.distributed import settings as _settings
from fastvideo.distributed.communicator import DeviceCommunicatorBase
from fastvideo.distributed.group_transfers import CoordinatorTransfers
from fastvideo.distributed.host_exchange import job_timeout_s
from fastvideo.distributed.settings import AgreedSettings

# name -> the count of coordinators of that name this process built (upstream's ``name:<n>`` group names)
_group_name_counter: defaultdict[str, itertools.count] = defaultdict(itertools.count)
# unique_name -> the coordinator (upstream's registry, which its module-level ``all_reduce(tensor, group_name)`` reads)
_groups: weakref.WeakValueDictionary[str, GroupCoordinator] = weakref.WeakValueDictionary()


@dataclass(init=False, eq=False)
class GroupCoordinator(CoordinatorTransfers):
    """One process group as seen from this rank: its ranks, device group and CPU (gloo) group.

    SP coordinators also own the vote group, the agreed settings and the helper generation counter. The transfers
    of upstream's coordinator (broadcasts, point-to-point objects and tensors, tensor dictionaries, the
    graph-capture context) come from ``CoordinatorTransfers``. ``GroupCoordinator(...)`` is upstream's constructor
    (it creates the process groups), which builds this package's SP, DP and TP groups too; ``GroupCoordinator.of``
    wraps groups that exist already (the world group).
    """

    ranks: list[int]
    rank_in_group: int
    world_size: int  # len(ranks): an attribute, since every call reads it (a property would be a call into here)
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    device: torch.device
    vote_group: dist.ProcessGroup | None = None
    settings: AgreedSettings | None = None
    vote_failure: str | None = None  # set when an exchange on the vote group failed: the group is dead
    timeout_s: float | None = None  # what the group's collectives time out after
    _generation: int = 0
    _teardown: dict[str, Callable[[], None]] = field(default_factory=dict)
    _on_settings: dict[str, Callable[[AgreedSettings, AgreedSettings], None]] = field(default_factory=dict)
    # Upstream FastVideo's coordinator attributes (``device_communicator`` is built on first use).
    local_rank: int = 0
    unique_name: str = ""
    use_device_communicator: bool = True
    mq_broadcaster: Any = None  # upstream's shared-memory broadcaster: none here (objects go over the CPU group)
    use_custom_op_call: bool = False
    _communicator: DeviceCommunicatorBase | None = field(default=None, repr=False)

    def __init__(self, group_ranks: list[list[int]], local_rank: int, torch_distributed_backend: str | dist.Backend,
                 use_device_communicator: bool, use_message_queue_broadcaster: bool = False,
                 group_name: str | None = None, *, created: list[dist.ProcessGroup] | None = None,
                 timeout: datetime.timedelta | None = None, vote_timeout: datetime.timedelta | None = None) -> None:
        """Upstream's constructor. Collective over the world (``torch.distributed.new_group`` needs every rank):
        for every rank list of ``group_ranks``, in order, every rank creates a device group
        (``torch_distributed_backend``) and a gloo CPU group, and keeps the ones of the list it belongs to.
        ``use_message_queue_broadcaster`` is accepted and builds nothing (objects travel over the CPU group). Raises
        ValueError when this rank is in none of them.

        This package's keywords: ``created`` collects every group created (every rank's, in order, for the caller to
        destroy); ``timeout`` bounds the groups' collectives and is the coordinator's ``timeout_s``; ``vote_timeout``
        adds a gloo vote group after each CPU group (the SP group's)."""
        rank, mine = dist.get_rank(), None
        kwargs = {} if timeout is None else {"timeout": timeout}
        for ranks in map(list, group_ranks):
            groups = [dist.new_group(ranks, backend=b, **kwargs) for b in (torch_distributed_backend, "gloo")]
            if vote_timeout is not None:
                groups.append(dist.new_group(ranks, backend="gloo", timeout=vote_timeout))
            if created is not None:
                created += groups
            if rank in ranks:
                mine = (ranks, groups)
        if mine is None:
            raise ValueError(f"GroupCoordinator: this process's rank {rank} is in none of group_ranks={group_ranks}; "
                             "every rank of the world must appear in one list.")
        ranks, (device_group, cpu_group, *vote_group) = mine
        self._assign(ranks, ranks.index(rank), device_group, cpu_group,
                     _device_for_backend(str(torch_distributed_backend)), local_rank=local_rank, unique_name=group_name,
                     vote_group=vote_group[0] if vote_group else None,
                     timeout_s=None if timeout is None else timeout.total_seconds())
        self.use_device_communicator = use_device_communicator

    @classmethod
    def of(cls, ranks: list[int], rank_in_group: int, device_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
           device: torch.device, *, local_rank: int = 0, unique_name: str = "") -> GroupCoordinator:
        """A coordinator over process groups that exist already (local: creates none; the world group, over the
        default group). ``unique_name``: upstream's ``name:<n>`` is derived from it (``"sp"`` -> ``"sp:0"``);
        empty: ``anonymous:<n>``."""
        self = cls.__new__(cls)
        self._assign(ranks, rank_in_group, device_group, cpu_group, device, local_rank=local_rank,
                     unique_name=unique_name)
        return self

    def _assign(self, ranks: list[int], rank_in_group: int, device_group: dist.ProcessGroup,
                cpu_group: dist.ProcessGroup, device: torch.device, *, vote_group: dist.ProcessGroup | None = None,
                timeout_s: float | None = None, local_rank: int = 0, unique_name: str | None = None) -> None:
        """Set the attributes of a new coordinator and register it under upstream's ``name:<n>`` for
        ``unique_name`` (``anonymous:<n>`` where it is empty)."""
        # The fields not set here start at their class defaults (no settings, generation 0, no communicator).
        self.ranks, self.rank_in_group, self.device = list(ranks), rank_in_group, device
        self.world_size = len(self.ranks)
        self.device_group, self.cpu_group, self.vote_group = device_group, cpu_group, vote_group
        self.timeout_s, self._teardown, self._on_settings = timeout_s, {}, {}
        name = unique_name or "anonymous"
        self.local_rank, self.unique_name = local_rank, f"{name}:{next(_group_name_counter[name])}"
        _groups[self.unique_name] = self

    # ---------------------------------------------------------------- upstream FastVideo's coordinator surface

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank_in_group]

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def device_communicator(self) -> DeviceCommunicatorBase:
        """This group's collectives (``DeviceCommunicatorBase``: the all-to-all's NCCL route, all-gather, slice,
        all-reduce, gather, and ``ulysses_a2a`` on the SP group). Built on first use, locally."""
        if self._communicator is None:
            self._communicator = DeviceCommunicatorBase(self.cpu_group, self.device, self.device_group,
                                                        self.unique_name)
        return self._communicator

    def all_gather(self, input_: torch.Tensor, dim: int = -1, *, splits: Sequence[int] | None = None) -> torch.Tensor:
        """Collective: every rank's ``input_`` concatenated along ``dim`` (``splits``: every rank's rows where they
        differ, the same on every rank); differentiable. Size 1: ``input_`` (``dim`` and ``splits`` checked)."""
        return self.device_communicator.all_gather(input_, dim, splits=splits)

    def shard(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool,
              splits: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's chunk along ``dim`` (``splits``: every rank's rows, the same on every rank; None: equal
        chunks); the backward all-gathers (collective). Size 1: ``input_``."""
        if self.world_size == 1:
            return input_
        return self.device_communicator.slice(input_, dim, scale_grad=scale_grad, splits=splits)

    def all_reduce(self, input_: torch.Tensor, op: dist.ReduceOp | None = dist.ReduceOp.SUM) -> torch.Tensor:
        """Collective, out of place; differentiable for SUM. Size 1: ``input_``."""
        return input_ if self.world_size == 1 else self.device_communicator.all_reduce(input_, op)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Collective: the concatenation on the group's rank ``dst``, None elsewhere. Size 1: ``input_``."""
        return input_ if self.world_size == 1 else self.device_communicator.gather(input_, dst, dim)

    def barrier(self) -> None:
        """Collective over the CPU group; blocks the host until every rank of the group reaches it."""
        dist.barrier(group=self.cpu_group)

    def next_generation(self) -> int:
        """The next helper generation on this group. Identical on every rank because helpers are built
        collectively (and the construction exchange checks it)."""
        self._generation += 1
        return self._generation

    def add_teardown(self, key: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (collective) in ``destroy_sequence_parallel`` before the groups go; one hook per key."""
        self._teardown[key] = fn

    def vote_failed(self, why: str) -> None:
        """Local: an exchange on the vote group failed (``why``); a gloo group is unusable after that, so no later
        helper may vote on it (``vote_failure``) until the groups are rebuilt."""
        self.vote_failure = why

    def resync_generation(self, generation: int) -> None:
        """Move the generation counter to ``generation`` (after a construction found ranks out of step), so that
        the next collective construction agrees."""
        self._generation = max(self._generation, generation)

    def on_settings_change(self, key: str, fn: Callable[[AgreedSettings, AgreedSettings], None]) -> None:
        """Call ``fn(previous, agreed)`` (collective where it is) when a re-agreement changes the agreed values;
        one hook per key."""
        self._on_settings[key] = fn

    def destroy(self) -> None:
        """Collective over the group, blocking: upstream's teardown of one coordinator. The registered hooks first
        (the Ulysses helpers, collective: they need the groups), then this group's device, CPU and vote process
        groups (never the default group: ``destroy_distributed_environment`` ends that one), and the device
        communicator is dropped (it holds nothing of its own: ``DeviceCommunicatorBase.destroy`` releases nothing);
        the coordinator is unusable afterwards. A second call does nothing."""
        try:
            hooks, self._teardown = self._teardown, {}  # forgotten first: a second call runs none
            for hook in reversed(list(hooks.values())):  # last registered first
                hook()
        finally:
            default = dist.group.WORLD if dist.is_initialized() else None
            _destroy_groups([g for g in (self.device_group, self.cpu_group, self.vote_group) if g is not default])
            self.device_group = self.cpu_group = self.vote_group = None  # type: ignore[assignment]
            self._communicator = None


_SP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None


def check_group_size(caller: str, name: str, size: object, world: int) -> None:
    """Raise a ValueError naming ``caller`` and ``name`` unless ``size`` is a positive int dividing ``world``."""
    if not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"{caller}: {name}={size!r} must be a positive integer dividing the world size {world}; "
                         f"pick one of {[d for d in range(1, world + 1) if world % d == 0]}.")


def consecutive_groups(caller: str, name: str, size: int, world: int) -> list[list[int]]:
    """The ``world`` ranks cut into groups of ``size`` consecutive ranks (``size``, ``caller``'s argument ``name``,
    checked to divide it: ``check_group_size``)."""
    check_group_size(caller, name, size, world)
    return [list(range(start, start + size)) for start in range(0, world, size)]


def _device_for_backend(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_sequence_parallel(sp_size: int, *, timeout: datetime.timedelta | None = None) -> GroupCoordinator:
    """Create the SP and DP groups and agree the settings. Collective over the world; call once after
    ``init_process_group``.

    ``sp_size`` must divide the world size and be the same on every rank (not compared: where a rank's differs,
    creating the groups waits for the default group's timeout, as torch's ``new_group`` does). ``timeout`` bounds
    every collective of the new groups (device, CPU and vote groups, gloo and NCCL); by default they take the
    default process group's timeout (``init_process_group(timeout=...)``), and so does the Ulysses vote unless
    ``FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S`` says otherwise (``docs/env_vars.md``, "Timeouts"). Raises
    ``settings.SettingsError`` on every rank of an SP group, before any later collective, when one of its ranks
    holds an invalid ``FASTVIDEO_*`` value (the other SP groups' ranks return: the agreement is per group); ranks
    that differ on a setting take its conservative value together, warning.
    """
    global _SP, _DP
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: call torch.distributed.init_process_group first.")
    if _SP is not None:
        raise RuntimeError("initialize_sequence_parallel: SP groups already exist; call destroy_sequence_parallel "
                           "first.")
    world = dist.get_world_size()
    backend = dist.get_backend()
    # The job's timeout unless told otherwise: a stopped peer then ends this rank's collectives within it.
    if timeout is None:
        timeout = datetime.timedelta(seconds=job_timeout_s())
    agree_s = _settings.agreement_timeout_s(timeout.total_seconds())
    created: list[dist.ProcessGroup] = []
    # The vote group takes the vote timeout (helpers may set their own on it).
    sp = GroupCoordinator(consecutive_groups("initialize_sequence_parallel", "sp_size", sp_size, world), 0, backend,
                          True, group_name="sp", created=created, timeout=timeout,
                          vote_timeout=datetime.timedelta(seconds=agree_s))
    dp = GroupCoordinator([list(range(offset, world, sp_size)) for offset in range(sp_size)], 0, backend, True,
                          group_name="dp", created=created, timeout=timeout)
    try:
        _agree(sp, "checked at initialize_sequence_parallel")
    except Exception:
        _destroy_groups(created)  # every rank raises here: nothing half-built is left behind
        raise
    _SP, _DP = sp, dp
    return sp


def agree_ulysses_settings() -> AgreedSettings:
    """Collective over the SP group, blocking: agree the current settings now, after changing them on every rank.

    Settings are agreed once (at ``initialize_sequence_parallel`` and helper construction) and never re-read per
    call: this is how a change of the environment takes effect. When the agreed values change, what was built on
    them follows (``GroupCoordinator.on_settings_change``): the route is resolved again at the next call, and a
    helper built on a value that changed is destroyed (collectively) and rebuilt.
    """
    return _agree(get_sp_group(), "agree_ulysses_settings")


def _agree(sp: GroupCoordinator, where: str) -> AgreedSettings:
    """Collective over ``sp``'s CPU group: agree the settings (``where`` names the call in errors) into
    ``sp.settings``, replacing the ones it holds (none at ``initialize_sequence_parallel``); when the agreed values
    change, call the ``on_settings_change`` hooks."""
    agreed = _settings.agree(sp.cpu_group, sp.ranks, sp.rank_in_group, where=where,
                             timeout_s=_settings.agreement_timeout_s(sp.timeout_s), previous=sp.settings)
    previous, sp.settings = sp.settings, agreed
    if previous is not None and previous.values != agreed.values:
        for hook in list(sp._on_settings.values()):
            hook(previous, agreed)
    return agreed


@contextlib.contextmanager
def override_ulysses_settings(**values: str | None) -> Iterator[AgreedSettings]:
    """Collective over the SP group, blocking, not capture-safe: set FastVideo settings on this rank
    (``envs.override``) and agree them, for the block; restore and re-agree at its end. Every rank must enter
    it with the same values at the same point (ranks that differ decline together to the conservative values).
    What the settings decide follows them: the route, and a helper built on settings that changed."""
    with contextlib.ExitStack() as after:
        with envs.override(**values):  # a name it does not know raises here: before any agreement, so none follows
            after.callback(agree_ulysses_settings)  # the re-agreement, once the block's values are restored
            yield agree_ulysses_settings()


def model_parallel_is_initialized() -> bool:
    return _SP is not None


def get_sp_group() -> GroupCoordinator:
    if _SP is None:
        raise RuntimeError("SP groups are not initialised: call initialize_sequence_parallel(sp_size) first.")
    return _SP


def get_dp_group() -> GroupCoordinator:
    if _DP is None:
        raise RuntimeError("DP groups are not initialised: call initialize_sequence_parallel(sp_size) first.")
    return _DP


def get_sp_world_size() -> int:
    return get_sp_group().world_size


def get_sp_rank() -> int:
    return get_sp_group().rank_in_group


def _destroy_groups(groups: list[dist.ProcessGroup | None]) -> None:
    for group in groups:
        if group is not None:  # None would name the default group
            with contextlib.suppress(RuntimeError, ValueError):  # already gone with the default group
                dist.destroy_process_group(group)


def destroy_sequence_parallel() -> None:
    """Tear down in a safe order: registered hooks (every Ulysses helper built on the SP group, collective) first,
    then the groups.

    Collective over each SP group. Safe to call when nothing was initialised.
    """
    global _SP, _DP
    try:
        if _SP is not None:  # the hooks live on the SP group (the DP group has none)
            _SP.destroy()
    finally:  # a failing hook must not leave the groups behind (``destroy`` ends the SP groups whatever happens)
        if _DP is not None:
            _DP.destroy()
        _SP = _DP = None
