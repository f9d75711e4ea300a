"""The recipes and demo models built on the ``fastvideo`` package, outside it (the wheel ships ``fastvideo``
alone; these import it, never the reverse): a small Wan-style video DiT used by the benchmarks and the offline GPU
hosts (``video_dit``), the SP self-attention block with its single-device reference (``attention_block``), the
training pieces (FSDP2 wrapping ``fsdp``, safetensors ``checkpoint``, synthetic latents ``data``, the per-step
``progress`` line) and the entry points that use them. Importable as ``sp_recipes`` with ``examples/`` on the
path: ``PYTHONPATH=examples python -m sp_recipes.train_video_dit compare ...`` from the repository root."""
