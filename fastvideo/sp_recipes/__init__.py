"""This package's own recipes and test models, kept apart from every upstream FastVideo module path so that the
package can be copied over upstream without shadowing anything: a small Wan-style video DiT used by the
benchmarks and the offline GPU hosts (``video_dit``), the SP self-attention block with its single-device
reference (``attention_block``), the training pieces (FSDP2 wrapping ``fsdp``, safetensors ``checkpoint``,
synthetic latents ``data``, the per-step ``progress`` line) and the entry points that use them."""
