"""Training pieces shared by the recipe and the benchmarks: FSDP2 wrapping (``fsdp``), safetensors checkpoints
(``checkpoint``), synthetic video latents (``data``) and the per-step progress line (``progress``)."""
