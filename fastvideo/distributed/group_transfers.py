"""Upstream FastVideo's transfers on a ``GroupCoordinator``: broadcasts, point-to-point objects and tensors, tensor
dictionaries, and the graph-capture context. ``GroupCoordinator`` (``sp_groups``) inherits them.

Every rank argument (``src``, ``dst``) is the rank *in the group* (0 .. world_size - 1), as upstream's; a rank
outside it raises ValueError naming the argument before any communication. Objects travel pickled over the
group's CPU (gloo) group; tensors over the CPU group when they are on the CPU, over the device group otherwise
(NCCL on CUDA), as upstream's. A group of one rank returns at once, as upstream's. Pickled objects are trusted:
they come from the job's own ranks.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastvideo.distributed.communicator import group_peer

if TYPE_CHECKING:
    from fastvideo.distributed.communicator import DeviceCommunicatorBase

__all__ = ["CoordinatorTransfers", "GraphCaptureContext", "TensorMetadata", "split_tensor_dict"]

# What crosses the wire for a tensor in a tensor dictionary: the device *type* (the receiver uses its own device of
# that type), the dtype and the shape.
TensorMetadata = namedtuple("TensorMetadata", ["device", "dtype", "size"])


@dataclass
class GraphCaptureContext:
    """The stream a CUDA-graph capture runs on (None off CUDA)."""

    stream: torch.cuda.Stream | None


def split_tensor_dict(tensor_dict: dict[str, Any],
                      caller: str = "split_tensor_dict") -> tuple[list[tuple[str, Any]], list[torch.Tensor]]:
    """``(metadata, tensors)``: the dictionary's items in order with each tensor replaced by its ``TensorMetadata``,
    and the tensors in the same order. A ValueError naming ``caller`` unless ``tensor_dict`` is a dict."""
    if not isinstance(tensor_dict, dict):
        raise ValueError(f"{caller}: tensor_dict must be a dict on the sending rank, got {type(tensor_dict).__name__}.")
    metadata: list[tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            metadata.append((key, TensorMetadata(value.device.type, value.dtype, value.size())))
            tensors.append(value)
        else:
            metadata.append((key, value))
    return metadata, tensors


class CoordinatorTransfers:
    """The transfers of upstream's ``GroupCoordinator`` (a mixin: the coordinator supplies the attributes below)."""

    ranks: list[int]
    rank_in_group: int
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup
    device: torch.device

    world_size: int  # a property of the coordinator
    device_communicator: DeviceCommunicatorBase

    def _carrier(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        return self.cpu_group if tensor.is_cpu else self.device_group

    def _empty(self, meta: TensorMetadata) -> torch.Tensor:
        """A tensor to receive ``meta`` into: on this group's device when the sender's was of its type."""
        device = self.device if meta.device == self.device.type else torch.device(meta.device)
        return torch.empty(meta.size, dtype=meta.dtype, device=device)

    def _placeholders(self, metadata: list[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``split_tensor_dict``'s inverse on a receiver: the dictionary with a new tensor (``_empty``) in place of
        each ``TensorMetadata``, and those tensors by key, in order."""
        result = {key: self._empty(value) if isinstance(value, TensorMetadata) else value for key, value in metadata}
        return result, {key: result[key] for key, value in metadata if isinstance(value, TensorMetadata)}

    # ------------------------------------------------------------------------------------------- broadcasts

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Collective over the device group, blocking: group rank ``src``'s ``input_`` into every rank's ``input_``
        (in place, returned). Size 1: ``input_``."""
        return self._broadcast_in_place(dist.broadcast, "broadcast", input_, src, self.device_group)

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """Collective over the CPU group, blocking: group rank ``src``'s picklable ``obj``, returned on every rank
        (``obj`` itself on ``src``). Size 1: ``obj``."""
        return self._broadcast_in_place(dist.broadcast_object_list, "broadcast_object", [obj], src, self.cpu_group)[0]

    def broadcast_object_list(self, obj_list: list[Any], src: int = 0,
                              group: dist.ProcessGroup | None = None) -> list[Any]:
        """Collective over the device group, blocking: group rank ``src``'s list into every rank's ``obj_list`` (in
        place, returned; every rank passes a list of the same length). ``group`` is accepted for upstream's
        signature and, as there, unused. Size 1: ``obj_list``."""
        return self._broadcast_in_place(dist.broadcast_object_list, "broadcast_object_list", obj_list, src,
                                        self.device_group)

    def _broadcast_in_place(self, collective: Callable[..., Any], caller: str, value: Any, src: int,
                            group: dist.ProcessGroup) -> Any:
        """``collective`` (``dist.broadcast`` or ``dist.broadcast_object_list``) over ``group`` from group rank
        ``src`` into every rank's ``value`` (a tensor, or a list whose items the source's replace), returned (size 1:
        at once). ``caller`` names the public method in the error for a bad ``src``."""
        root = group_peer(caller, "src", src, self.ranks)
        if self.world_size > 1:
            collective(value, src=root, group=group)
        return value

    # ------------------------------------------------------------------------------------------- point to point

    def send_object(self, obj: Any, dst: int) -> None:
        """Point to point over the CPU group, blocking: pickle ``obj`` to group rank ``dst`` (which calls
        ``recv_object(src=<this rank>)``). Sending to oneself raises ValueError."""
        peer = group_peer("send_object", "dst", dst, self.ranks, self.rank_in_group)
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=peer, group=self.cpu_group)
        dist.send(payload, dst=peer, group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        """Point to point over the CPU group, blocking: the object group rank ``src`` sent with ``send_object``."""
        peer = group_peer("recv_object", "src", src, self.ranks, self.rank_in_group)
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self.cpu_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=peer, group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Point to point over the device group, blocking: ``tensor`` to group rank ``dst`` (default: the next
        rank), which receives it with ``recv(size, dtype, src)``."""
        self.device_communicator.send(tensor, dst)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Point to point over the device group, blocking: a new ``size`` x ``dtype`` tensor on this group's device,
        from group rank ``src`` (default: the previous rank)."""
        return self.device_communicator.recv(size, dtype, src)

    # ------------------------------------------------------------------------------------------- tensor dictionaries

    def broadcast_tensor_dict(self, tensor_dict: dict[str, Any] | None = None, src: int = 0,
                              group: dist.ProcessGroup | None = None,
                              metadata_group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
        """Collective, blocking: group rank ``src``'s dictionary on every rank. Non-tensor values travel pickled with
        the tensors' metadata (CPU group); tensors are broadcast, CPU ones over the CPU group and the others over
        the device group, into new tensors on the receivers (on this group's device for device tensors). ``src``
        returns its own dictionary. ``group`` / ``metadata_group`` are accepted for upstream's signature and, as
        there, unused. Size 1 (or no default process group): ``tensor_dict``."""
        root = group_peer("broadcast_tensor_dict", "src", src, self.ranks)
        if not dist.is_initialized() or self.world_size == 1:
            return tensor_dict
        if self.rank_in_group == src:
            metadata, tensors = split_tensor_dict(tensor_dict, "broadcast_tensor_dict")
            self.broadcast_object(metadata, src=src)
            result = tensor_dict
            # A source tensor travels as it is when it can (broadcast reads it), else as a contiguous copy.
            tensors = [t.contiguous() for t in tensors]
        else:
            result, placeholders = self._placeholders(self.broadcast_object(None, src=src))
            tensors = list(placeholders.values())
        pending = [dist.broadcast(t, src=root, group=self._carrier(t), async_op=True) for t in tensors if t.numel()]
        for work in pending:
            work.wait()
        return result

    def send_tensor_dict(self, tensor_dict: dict[str, Any], dst: int | None = None,
                         all_gather_group: CoordinatorTransfers | None = None) -> dict[str, Any] | None:
        """Point to point, blocking: ``tensor_dict`` to group rank ``dst`` (default: the next rank), which calls
        ``recv_tensor_dict``. With ``all_gather_group``, a tensor whose size divides by that group's size travels
        as this rank's share of it only (the receivers all-gather the shares back). Returns None; size 1 (or no
        default process group): ``tensor_dict``."""
        if not dist.is_initialized() or self.world_size == 1:
            return tensor_dict
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        peer = group_peer("send_tensor_dict", "dst", dst, self.ranks, self.rank_in_group)
        metadata, tensors = split_tensor_dict(tensor_dict, "send_tensor_dict")
        self.send_object(metadata, dst=dst)
        for tensor in tensors:
            if not tensor.numel():
                continue
            if all_gather_group is not None and tensor.numel() % all_gather_group.world_size == 0:
                tensor = tensor.reshape(all_gather_group.world_size, -1)[all_gather_group.rank_in_group]
            dist.send(tensor.contiguous(), dst=peer, group=self._carrier(tensor))
        return None

    def recv_tensor_dict(self, src: int | None = None,
                         all_gather_group: CoordinatorTransfers | None = None) -> dict[str, Any] | None:
        """Point to point, blocking: the dictionary group rank ``src`` (default: the previous rank) sent with
        ``send_tensor_dict``, its tensors new on this rank (on this group's device for device tensors). With
        ``all_gather_group`` (the sender's), shared tensors are all-gathered over it (collective there). Size 1
        (or no default process group): None."""
        if not dist.is_initialized() or self.world_size == 1:
            return None
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        peer = group_peer("recv_tensor_dict", "src", src, self.ranks, self.rank_in_group)
        parts = 1 if all_gather_group is None else all_gather_group.world_size
        received, placeholders = self._placeholders(self.recv_object(src=src))
        for key, tensor in placeholders.items():
            if not tensor.numel():
                continue
            shared = all_gather_group is not None and tensor.numel() % parts == 0
            # Shared: this rank's share arrives alone and the group's all-gather rebuilds the whole.
            target = tensor.new_empty(tensor.numel() // parts) if shared else tensor
            dist.recv(target, src=peer, group=self._carrier(target))
            if shared:
                assert all_gather_group is not None
                received[key] = all_gather_group.all_gather(target, dim=0).reshape(tensor.shape)
        return received

    # ------------------------------------------------------------------------------------------- capture

    @contextlib.contextmanager
    def graph_capture(self, graph_capture_context: GraphCaptureContext | None = None
                      ) -> Iterator[GraphCaptureContext]:
        """Local: the context a CUDA-graph capture runs in. On CUDA, a side stream (``graph_capture_context``'s, or
        a new one) that first waits for the current stream, made current for the block; off CUDA, a context
        without a stream."""
        if self.device.type != "cuda":
            yield graph_capture_context if graph_capture_context is not None else GraphCaptureContext(None)
            return
        if graph_capture_context is None:
            graph_capture_context = GraphCaptureContext(torch.cuda.Stream(device=self.device))
        stream = graph_capture_context.stream
        assert stream is not None
        current = torch.cuda.current_stream(self.device)
        if current != stream:
            stream.wait_stream(current)  # work queued before the capture is done before it starts
        with torch.cuda.stream(stream):
            yield graph_capture_context

    # ------------------------------------------------------------------------------------------- the all-to-all

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
        """Collective: the Ulysses all-to-all's NCCL route over this group (``device_communicator.all_to_all_4D``);
        differentiable. The fused route is taken through ``sequence_model_parallel_all_to_all_4D``. Size 1:
        ``input_`` (checked as at any size)."""
        return self.device_communicator.all_to_all_4D(input_, scatter_dim, gather_dim)
