"""What a FLUX.2 file is and what is in it, in plain Python over torch, safetensors, gguf and transformers (never
ComfyUI), in layers, lowest first (tests/pack/test_imports.py holds the order): formats/ (bytes in, tensors out: the
readers, the packed formats and GGUF types, their dequantizers and quantizers), models/ (what a checkpoint is:
variants, layouts, identification, the loaders), upsampler/ (prompt upsampling's models and inputs), cache/ (the
conditioning cache) and convert/ (writing files)."""
