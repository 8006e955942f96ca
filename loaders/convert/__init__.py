"""Writing model files: the text encoder in ComfyUI's single-file layout (bf16 or scaled fp8) and the transformer
as GGUF (quantized, optionally with LoRAs baked in), streamed tensor by tensor through a fresh temporary file; and
what two files are to each other, tensor by tensor (identity.py)."""

# The GGUF types `flux2dev convert transformer --type` writes (transformer.TYPES maps each to its GGUF and llama.cpp
# file type); here, where the command line reads them without importing torch or gguf.
WRITTEN_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "BF16", "F16")
