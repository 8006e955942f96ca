"""What a FLUX.2 file is and what is in it, in plain Python over torch, safetensors, gguf and transformers (never
ComfyUI), in three layers: formats/ (bytes in, tensors out: the readers, packed formats and dequantizers),
models/ (what a checkpoint is: variants, layouts, identification, the loaders) and cache/ (the conditioning
cache)."""
