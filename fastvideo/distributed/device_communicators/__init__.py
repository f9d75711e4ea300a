"""Per-group device communicators, as upstream FastVideo's ``GroupCoordinator.device_communicator`` exposes them.

``base_device_communicator.DeviceCommunicatorBase``: the collectives of one group (the NCCL route of the
Ulysses all-to-all, all-gather, shard, all-reduce, gather). ``ulysses_a2a``: the SP group's Ulysses helper as
``device_communicator.ulysses_a2a`` (and ``is_enabled()``). Importing this package has no side effects.
"""
