"""Upstream FastVideo's path for ``DeviceCommunicatorBase``: the class lives in
``fastvideo/distributed/communicator.py`` (below the SP groups, which build one per group), re-exported here so
that upstream's imports resolve."""

from fastvideo.distributed.communicator import DeviceCommunicatorBase, DistributedAutograd

__all__ = ["DeviceCommunicatorBase", "DistributedAutograd"]
