"""Writing model files: the text encoder in ComfyUI's single-file layout (bf16 or scaled fp8) or as a llama.cpp GGUF
(encoder_gguf.py), and the transformer as GGUF (quantized, optionally with LoRAs baked in), streamed tensor by tensor
through a fresh temporary file; and what two files are to each other, tensor by tensor (identity.py)."""

# llama.cpp's K presets for image models (ComfyUI-GGUF's tools/lcpp.patch, img_tensor_get_type) -> the GGUF type of
# their weights, and of the fused attention qkv tensors where the patch's rule raises it. Of its rules only that one
# names FLUX.2 tensors (double_blocks.N.img_attn.qkv and txt_attn.qkv): FLUX.2 has no attention v tensor of its own,
# and its feed-forward down tensors (img_mlp.2, txt_mlp.2, linear2) match none of the rule's ffn_down spellings.
K_PRESETS = {
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"),
    "Q5_K_S": ("Q5_K", "Q5_K"),
    "Q4_K_M": ("Q4_K", "Q5_K"),
    "Q4_K_S": ("Q4_K", "Q4_K"),
    "Q3_K_L": ("Q3_K", "Q4_K"),
    "Q3_K_M": ("Q3_K", "Q4_K"),
    "Q3_K_S": ("Q3_K", "Q3_K"),
    "Q2_K": ("Q2_K", "Q2_K"),
}
# What `flux2dev convert transformer --type` (and `convert encoder ... OUT.gguf --type`) writes: one GGUF type for
# every weight, or a K preset (transformer.TYPES maps each to its GGUF types and llama.cpp's file type); here, where
# the command line reads them without importing torch or gguf.
WRITTEN_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", *K_PRESETS, "BF16", "F16")
