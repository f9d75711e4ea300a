"""Upstream FastVideo's attention layers: ``layer.DistributedAttention`` (Ulysses SP) and ``layer.LocalAttention``."""
