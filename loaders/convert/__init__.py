"""Writing model files: the text encoder in ComfyUI's single-file layout (bf16 or scaled fp8) and the transformer
as GGUF (quantized, optionally with LoRAs baked in), streamed tensor by tensor through a fresh temporary file; and
what two files are to each other, tensor by tensor (identity.py)."""
