"""Flux2DevPromptUpsampler: a short prompt rewritten by the encoder's own Mistral-Small weights, as Black Forest
Labs recommends for FLUX.2 [dev]."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..host.compat import fixed_seed_control
from ..host.menus import chosen_path, model_choices
from ..loaders.upsampler.generation_settings import LIMITS
from ..tokenizers.chat import MODES
from .shared import CONDITIONING_CATEGORY, schema

(SEED_MIN, SEED_MAX), (TEMPERATURE_MIN, TEMPERATURE_MAX), (TOKENS_MIN, TOKENS_MAX) = (
    LIMITS[name] for name in ("seed", "temperature", "max_new_tokens"))


class Flux2DevPromptUpsampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevPromptUpsampler",
            "Rewrites a short prompt into the long, detailed kind FLUX.2 [dev] was trained on, with the same "
            "Mistral-Small-3.x model that encodes it (Black Forest Labs' recommended prompt upsampling), on this "
            "machine. With reference images it writes one edit instruction about them instead. Needs the whole "
            "model (all 40 layers and its output head): a Hugging Face Mistral-Small-3.x folder, a FLUX.2 [dev] "
            "pipeline, Mistral's consolidated.safetensors or a llama.cpp .gguf; ComfyUI's 30-layer "
            "mistral_3_small_flux2_* files only encode. Connect its text to CLIP Text Encode's text input.",
            [
                io.Combo.Input(
                    "model",
                    options=list(model_choices("language model")),
                    tooltip="The whole Mistral-Small-3.x model, from models/text_encoders (a Hugging Face folder, "
                    "consolidated.safetensors, a .gguf) or a FLUX.2 [dev] pipeline from models/diffusers. Edits need "
                    "its vision tower: a Hugging Face folder or a pipeline (a .gguf keeps it in a separate mmproj "
                    "file, which the pack does not read).",
                ),
                io.String.Input("prompt", multiline=True, default="", tooltip="The prompt to rewrite; for an edit, "
                                "what to change in the reference images."),
                io.Combo.Input("mode", options=list(MODES), default=MODES[0], tooltip="auto: an edit instruction when "
                               "reference images are connected, else a text-to-image prompt. Each mode has Black "
                               "Forest Labs' own system message."),
                io.Int.Input("seed", default=0, min=SEED_MIN, max=SEED_MAX,
                             control_after_generate=fixed_seed_control(),
                             tooltip="The seed of the sampled words. The same seed, prompt and settings give the same "
                             "text (and a conditioning cache hit)."),
                io.Float.Input("temperature", default=0.15, min=TEMPERATURE_MIN, max=TEMPERATURE_MAX, step=0.01,
                               tooltip="How freely words are sampled: 0.15 is the reference's; 0 always takes the most "
                               "likely word (greedy)."),
                io.Int.Input("max_new_tokens", default=512, min=TOKENS_MIN, max=TOKENS_MAX,
                             tooltip="The most tokens the model writes (512 as the reference); it usually stops by "
                             "itself before."),
                io.Boolean.Input("keep_loaded", default=False, tooltip="On: the model stays in memory for the next "
                                 "prompt. Off: it is freed after each run, so the memory goes back to the encoder and "
                                 "the transformer."),
                io.String.Input("cache", default="", optional=True, tooltip="The conditioning cache folder, where each "
                                "rewritten prompt is kept under everything that decides it: the same prompt, images "
                                "and settings are served from here without reading the model. Empty: the "
                                "FLUX2DEV_CACHE_DIR folder if set, else flux2dev-conditioning-cache in ComfyUI's user "
                                "folder."),
                *(io.Image.Input(f"image_{i}", optional=True, tooltip="A reference image for an edit; several are "
                                 "joined side by side, as the reference does.") for i in (1, 2, 3)),
            ],
            [io.String.Output(tooltip="The rewritten prompt: connect it to CLIP Text Encode's text input.")],
            category=CONDITIONING_CATEGORY,
            is_output_node=True,  # it shows the rewritten prompt, and runs on its own for that
        )

    @classmethod
    def execute(cls, model, prompt, mode, seed, temperature, max_new_tokens, keep_loaded, cache="", image_1=None,
                image_2=None, image_3=None) -> io.NodeOutput:
        from ..host.upsampler import node_upsample

        text = node_upsample(chosen_path("language model", model, "The model"), prompt,
                             images=[image_1, image_2, image_3], mode=mode, seed=seed, temperature=temperature,
                             max_new_tokens=max_new_tokens, keep_loaded=keep_loaded, cache=cache)
        return io.NodeOutput(text, ui=ui.PreviewText(text))
