"""FastVideo: sequence-parallel (Ulysses) building blocks for video diffusion transformers."""

__version__ = "0.1.0"
