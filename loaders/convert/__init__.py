"""Writing model files: the text encoder in ComfyUI's single-file layout (bf16 or scaled fp8) or as a llama.cpp GGUF
(encoder_gguf.py), and the transformer as GGUF (quantized, optionally with LoRAs baked in), in the types presets.py
offers, streamed tensor by tensor through a fresh temporary file; and what two files are to each other, tensor by
tensor (identity.py)."""
