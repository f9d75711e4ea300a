"""Ulysses all-to-all helper: agreement, the per-call vote, policy and transports.

Importing this package has no side effects (no process groups, no library loads).
"""
