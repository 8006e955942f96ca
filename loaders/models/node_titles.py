"""The pack's nodes as ComfyUI shows them: one title each, in one pattern (what it loads, then what sets it
apart), and the words its node search also finds them by. The frontend ranks a phrase found in a short title
above one found in a long one, and reads no alias for its ranking, so the titles are short: "text encoder"
finds the encoder loader before core's other text encoders. nodes/ declares them; the loaders' error messages
name a node by its title, so a message never names a node the UI does not show."""

from __future__ import annotations

# What a user types into ComfyUI's node search for every part of FLUX.2.
FLUX2_WORDS = ("flux2", "flux.2", "flux 2")

# node id -> (title, search aliases). Node ids never change: saved workflows name them. All the encoders are
# FLUX.2 [dev]'s (Mistral-Small); the descriptions say so, and Klein's Qwen3 encoders are refused.
NODES = {
    "Flux2DevEncoderLoader": ("Load FLUX.2 text encoder (Mistral)", (
        *FLUX2_WORDS, "text encoder", "flux2 text encoder", "mistral", "mistral small", "clip", "load clip",
        "gguf text encoder", "fp8 text encoder")),
    "Flux2DevEncoderSource": ("Load FLUX.2 text encoder (pipeline)", (
        *FLUX2_WORDS, "pipeline text encoder", "diffusers", "pipeline", "mistral", "clip")),
    "Flux2DevGGUFTransformerLoader": ("Load FLUX.2 transformer (GGUF)", (
        *FLUX2_WORDS, "gguf", "flux2 gguf", "unet", "unet loader gguf", "diffusion model", "quantized")),
    "Flux2DevTransformerSource": ("Load FLUX.2 transformer (safetensors or pipeline)", (
        *FLUX2_WORDS, "diffusion model", "load diffusion model", "unet", "fp8", "pipeline", "diffusers")),
    "Flux2DevVAESource": ("Load FLUX.2 VAE (file or pipeline)", (
        *FLUX2_WORDS, "vae", "flux2 vae", "load vae", "ae", "autoencoder", "pipeline", "diffusers")),
    "Flux2DevLoraLoader": ("Load FLUX.2 LoRA", (
        *FLUX2_WORDS, "lora", "flux2 lora", "load lora", "lora loader", "lokr", "loha", "lycoris", "turbo lora")),
    "Flux2DevPromptUpsampler": ("FLUX.2 [dev] prompt upsampler", (
        *FLUX2_WORDS, "upsample prompt", "prompt upsampling", "caption upsampling", "enhance prompt", "expand prompt",
        "rewrite prompt", "prompt enhancer", "mistral", "generate text", "llm")),
}


def title(node_id: str) -> str:
    return NODES[node_id][0]
