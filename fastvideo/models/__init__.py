"""Models built on the package's sequence-parallel layers (``video_dit``: a small Wan-style video DiT)."""
