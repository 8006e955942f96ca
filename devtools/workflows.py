"""The official FLUX.2 [dev] graph (API format) with the three loader nodes supplied by the caller.

ComfyUI's own graph is UNETLoader + CLIPLoader(type flux2) + VAELoader -> CLIPTextEncode -> FluxGuidance
-> BasicGuider -> SamplerCustomAdvanced(RandomNoise, KSamplerSelect euler, Flux2Scheduler,
EmptyFlux2LatentImage) -> VAEDecode -> SaveImage. The pack replaces the three loaders and nothing else."""

from __future__ import annotations


def node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def official_dev_graph(model: dict, clip: dict, vae: dict, *, prompt: str = "a red fox in the snow",
                       width: int = 64, height: int = 64, steps: int = 2, guidance: float = 4.0,
                       seed: int = 0, filename_prefix: str = "flux2dev") -> dict:
    """`model`, `clip` and `vae` are loader nodes (see `node`) whose first output is MODEL, CLIP, VAE."""
    return {
        "model": model,
        "clip": clip,
        "vae": vae,
        "text": node("CLIPTextEncode", clip=["clip", 0], text=prompt),
        "guidance": node("FluxGuidance", conditioning=["text", 0], guidance=guidance),
        "guider": node("BasicGuider", model=["model", 0], conditioning=["guidance", 0]),
        "noise": node("RandomNoise", noise_seed=seed),
        "sampler": node("KSamplerSelect", sampler_name="euler"),
        "sigmas": node("Flux2Scheduler", steps=steps, width=width, height=height),
        "latent": node("EmptyFlux2LatentImage", width=width, height=height, batch_size=1),
        "sample": node("SamplerCustomAdvanced", noise=["noise", 0], guider=["guider", 0], sampler=["sampler", 0],
                       sigmas=["sigmas", 0], latent_image=["latent", 0]),
        "decode": node("VAEDecode", samples=["sample", 0], vae=["vae", 0]),
        "save": node("SaveImage", images=["decode", 0], filename_prefix=filename_prefix),
    }
