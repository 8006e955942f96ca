"""Damaged and hostile files at the loaders' boundaries (JSON files, safetensors headers, shard indexes,
paths): each ends in the pack's own error naming what is wrong, without opening anything outside the
model folder, without quoting a byte of a file that is not a model file, and in bounded memory."""

from __future__ import annotations

import json
import os
import signal
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comfyui_flux2dev.errors import CorruptFileError, Flux2DevError, MissingWeightsError, UnknownModelError
from comfyui_flux2dev.loaders.formats.files import ENCODER_CONFIG, PIPELINE_INDEX, TRANSFORMER_CONFIG, part_files
from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles
from comfyui_flux2dev.loaders.formats.validate import JSON_LIMITS, checked
from comfyui_flux2dev.loaders.models.encoder import plan_encoder
from comfyui_flux2dev.loaders.models.inspect import inspect_path
from comfyui_flux2dev.loaders.models.pipeline import describe_pipeline
from comfyui_flux2dev.loaders.models.transformer_layout import identify_transformer
from comfyui_flux2dev.loaders.models.vae import load_vae_state_dict

SECRET = b"marker:x:0:0:marker:/home/marker:/bin/sh\n"  # what a file that is no model file holds


@contextmanager
def no_blocking(seconds: int = 20):
    """Fail instead of hanging when the code under test opens a FIFO (an open blocks until a writer comes)."""

    def hung(*_):
        raise AssertionError("the loader opened a FIFO and blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refusal(error_type, call, *args) -> str:
    with no_blocking(), pytest.raises(error_type) as e:
        call(*args)
    return str(e.value)


def raw_safetensors(path: Path, header, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def diffusers_folder(folder: Path, index: dict | None = None) -> Path:
    """A diffusers transformer folder with one small real shard and, if given, an index."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"x_embedder.weight": torch.zeros(2, 2), "transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)},
              folder / "shard-1.safetensors")
    if index is not None:
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return folder


# --- safetensors headers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("entry, words", [
    ({"shape": [2], "data_offsets": [0, 8]}, "lacks dtype"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "has shape '2'"),
    ({"dtype": "F32", "shape": [2 ** 63], "data_offsets": [0, 8]}, "has shape a list of 1 items"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "not a list of at most 8 sizes"),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 8]}, "not a list of at most 8 sizes"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "not a type name"),
    (b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 1e400]}}', "not two byte offsets"),
    ({"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 8]}, "does not fill its 8 bytes"),
    ({"dtype": "F4", "shape": [2 ** 40], "data_offsets": [0, 8]}, "does not fill its 8 bytes"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 64]}, "points outside the file"),
])
def test_a_bad_tensor_entry_is_refused_naming_the_field(tmp_path, entry, words):
    path = raw_safetensors(tmp_path / "bad.safetensors", entry if isinstance(entry, bytes) else {"t": entry},
                           b"\0" * 16)
    message = refusal(CorruptFileError, SafetensorsFiles, [str(path)])
    assert words in message and "damaged" in message


def test_infinity_in_a_header_is_not_a_number(tmp_path):
    header = b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, Infinity]}}'
    message = refusal(CorruptFileError, SafetensorsFiles, [str(raw_safetensors(tmp_path / "inf.safetensors", header))])
    assert "not valid JSON" in message and "Infinity is not a number JSON allows" in message


def _peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        call()
    except Flux2DevError:
        pass
    else:
        raise AssertionError("the damaged header was accepted")
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# Built when the test runs, not when it is collected (they are tens of MB).
HUGE_HEADER_BODIES = {
    "600k-entries": lambda: b'"__metadata__": {}, ' + b", ".join(b'"%d": {}' % i for i in range(600_000)),
    "2M-nested-shape": lambda: b'"t": {"dtype": "F32", "shape": [' + b",".join([b"[]"] * 2_000_000)
    + b'], "data_offsets": [0, 0]}',
}


@pytest.mark.parametrize("body", sorted(HUGE_HEADER_BODIES))
def test_a_huge_damaged_header_is_refused_in_memory_near_its_own_size(tmp_path, body):
    header = b"{" + HUGE_HEADER_BODIES[body]() + b"}"
    path = raw_safetensors(tmp_path / "huge.safetensors", header)
    peak = _peak_bytes(lambda: SafetensorsFiles([str(path)]))
    assert peak < 4 * len(header), (peak, len(header))


def test_a_header_longer_than_any_real_one_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "long.safetensors"
    with open(path, "wb") as f:  # a sparse file: the claimed header is there, but never read
        f.write(struct.pack("<Q", JSON_LIMITS["header"] + 1))
        f.truncate(JSON_LIMITS["header"] + 64)
    peak = _peak_bytes(lambda: SafetensorsFiles([str(path)]))
    assert peak < 1 << 20


def test_a_text_file_named_safetensors_is_refused_without_quoting_it(tmp_path):
    path = tmp_path / "passwd.safetensors"
    path.write_bytes(SECRET * 4)
    message = refusal(CorruptFileError, SafetensorsFiles, [str(path)])
    assert "not a readable safetensors file" in message
    assert "marker" not in message and str(struct.unpack("<Q", SECRET[:8])[0]) not in message


def test_shards_of_one_model_never_share_a_tensor(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "one.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "two.safetensors")
    message = refusal(CorruptFileError, SafetensorsFiles,
                      [str(tmp_path / "one.safetensors"), str(tmp_path / "two.safetensors")])
    assert "hold tensor 'a'" in message


# --- only regular files are opened -------------------------------------------------------------------------


def test_a_fifo_named_like_weights_is_refused_without_blocking(tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    os.mkfifo(folder / "diffusion_pytorch_model.safetensors")
    assert "not a regular file" in refusal(CorruptFileError, identify_transformer, folder)
    os.mkfifo(tmp_path / "model.safetensors")
    assert "not a regular file" in refusal(CorruptFileError, identify_transformer, tmp_path / "model.safetensors")
    assert "not a regular file" in refusal(CorruptFileError, plan_encoder, str(tmp_path / "model.safetensors"))
    assert "not a regular file" in refusal(CorruptFileError, inspect_path, tmp_path / "model.safetensors")


def test_a_fifo_named_like_a_config_is_refused_without_blocking(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "config.json")
    assert "not a regular file" in refusal(CorruptFileError, plan_encoder, str(tmp_path))


def test_a_folder_named_like_a_file_is_the_packs_error(tmp_path):
    (tmp_path / "diffusion_pytorch_model.safetensors").mkdir()
    message = refusal(CorruptFileError, load_vae_state_dict, tmp_path)
    assert "is a folder, but a weights file was expected there" in message
    (tmp_path / "encoder" / "x.safetensors").mkdir(parents=True)
    (tmp_path / "encoder" / "config.json").write_text("{}")
    assert "is a folder" in refusal(CorruptFileError, plan_encoder, str(tmp_path / "encoder"))


def test_a_symlink_loop_is_the_packs_error(tmp_path):
    (tmp_path / "loop.safetensors").symlink_to(tmp_path / "loop.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert "cannot be opened" in refusal(CorruptFileError, plan_encoder, str(tmp_path))
    assert "cannot be opened" in refusal(CorruptFileError, plan_encoder, str(tmp_path / "loop.safetensors"))
    assert "cannot be opened" in refusal(CorruptFileError, inspect_path, tmp_path / "loop.safetensors")
    assert "cannot be opened" in refusal(CorruptFileError, identify_transformer, tmp_path / "loop.safetensors")


# --- shard indexes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, words", [
    ("../outside/secret.safetensors", "names a file outside the model folder"),
    ("{outside}/secret.safetensors", "names a file outside the model folder"),
    ("sub/../../outside/secret.safetensors", "names a file outside the model folder"),
    ("sub\\..\\..\\outside\\secret.safetensors", "names a file outside the model folder"),
    # a link the user keeps in the folder is followed (the Hugging Face cache is made of them), but what it
    # leads to must be a regular file: this one is a FIFO, refused without being opened
    ("link.safetensors", "link.safetensors is not a regular file"),
])
def test_an_index_naming_a_file_outside_the_folder_never_opens_it(tmp_path, name, words):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "secret.safetensors")  # opening it would block: the alarm would fail the test
    (tmp_path / "plain.txt").write_bytes(SECRET)
    folder = diffusers_folder(tmp_path / "model", {"weight_map": {
        "x_embedder.weight": "shard-1.safetensors", "y": name.format(outside=outside)}})
    (folder / "link.safetensors").symlink_to(outside / "secret.safetensors")
    message = refusal(CorruptFileError, identify_transformer, folder)
    assert words in message and "secret" not in message


def test_an_index_naming_a_text_file_outside_never_quotes_it(tmp_path):
    (tmp_path / "passwd").write_bytes(SECRET * 2)
    before = os.stat(tmp_path / "passwd").st_atime_ns
    os.utime(tmp_path / "passwd", ns=(before - 10 ** 10, before - 10 ** 10))
    folder = diffusers_folder(tmp_path / "model", {"weight_map": {"x_embedder.weight": str(tmp_path / "passwd")}})
    for call in (identify_transformer, inspect_path):
        message = refusal(CorruptFileError, call, folder)
        assert "outside the model folder" in message and "marker" not in message
    assert os.stat(tmp_path / "passwd").st_atime_ns == before - 10 ** 10  # never read


@pytest.mark.parametrize("index, words", [
    ([1, 2], "holds a list of 2 items, expected a JSON object"),
    ({"weights": {}}, "lacks weight_map"),
    ({"weight_map": ["shard-1.safetensors"]}, "weight_map is a list of 1 items, expected an object"),
    ({"weight_map": {"a": 1}}, "must map each tensor to a shard file name"),
    ({"weight_map": {"a": ["shard-1.safetensors"]}}, "must map each tensor to a shard file name"),
    ({"weight_map": {"a": ""}}, "outside the model folder"),
    ({"weight_map": {"a": "missing.safetensors"}}, "the index names shard(s) that are not there: missing.safetensors"),
])
def test_a_damaged_index_is_refused_naming_what_is_wrong(tmp_path, index, words):
    folder = diffusers_folder(tmp_path / "model", index)
    error = MissingWeightsError if "not there" in words else CorruptFileError
    assert words in refusal(error, part_files, folder, "transformer", "")


def test_an_index_bigger_than_any_real_one_is_refused_unread(tmp_path):
    folder = diffusers_folder(tmp_path / "model", {})
    with open(folder / "diffusion_pytorch_model.safetensors.index.json", "r+b") as f:
        f.truncate(JSON_LIMITS["index"] + 1)  # sparse: costs nothing unless read
    peak = _peak_bytes(lambda: part_files(folder, "transformer", ""))
    assert peak < 1 << 20


# --- JSON files: every field the pack computes with is declared and checked ------------------------------


def _pipeline(tmp_path, model_index, transformer_config=None) -> Path:
    folder = tmp_path / "pipeline"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(model_index if isinstance(model_index, str) else json.dumps(model_index))
    (folder / "transformer" / "config.json").write_text(json.dumps(transformer_config or {}))
    save_file({"x_embedder.weight": torch.zeros(2, 2)}, folder / "transformer" / "diffusion_pytorch_model.safetensors")
    return folder


@pytest.mark.parametrize("model_index, words", [
    ([], "model_index.json holds a list of 0 items, expected a JSON object"),
    ({"_class_name": ["Flux2Pipeline"]}, "_class_name is a list of 1 items, expected a string"),
    ({"_class_name": "Flux2Pipeline", "vae": "AutoencoderKLFlux2"},
     "vae is 'AutoencoderKLFlux2', expected a list or null"),
    ("[" * 100 + "]" * 100, "nests deeper than 32 levels"),
    ("[" * 100_000, "holds more strings, objects and lists than any real config file"),
    ('{"_class_name": NaN}', "NaN is not a number JSON allows"),
    (b"\xff\xfe\xfa".decode("latin-1"), "not valid JSON"),
])
def test_a_damaged_model_index_is_refused_naming_the_field(tmp_path, model_index, words):
    assert words in refusal(CorruptFileError, describe_pipeline, _pipeline(tmp_path, model_index))


@pytest.mark.parametrize("config, words", [
    ({"num_attention_heads": "a" * 100, "attention_head_dim": 10 ** 9},
     "num_attention_heads is a string of 100 characters"),
    ({"num_attention_heads": 48, "attention_head_dim": 10 ** 9},
     "attention_head_dim is 1000000000, expected an integer from 1 to 4096"),
    ({"num_attention_heads": [1] * 10}, "num_attention_heads is a list of 10 items"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"guidance_embeds": "yes"}, "guidance_embeds is 'yes', expected true or false"),
    ({"joint_attention_dim": 1.5}, "joint_attention_dim is 1.5"),
])
def test_a_damaged_transformer_config_is_refused_before_any_arithmetic(tmp_path, config, words):
    folder = _pipeline(tmp_path, {"_class_name": "Flux2Pipeline"}, config)
    message = refusal(CorruptFileError, describe_pipeline, folder)
    assert "transformer/config.json" in message and words in message


def test_a_config_bigger_than_any_real_one_is_refused_unread(tmp_path):
    folder = _pipeline(tmp_path, {"_class_name": "Flux2Pipeline"})
    with open(folder / "transformer" / "config.json", "r+b") as f:
        f.truncate(100 << 20)  # sparse
    peak = _peak_bytes(lambda: describe_pipeline(folder))
    assert peak < 4 << 20


# Real configs the pack meets (FLUX.2 [dev] and Klein 4B from the published pipelines, FLUX.1 and SD3's
# transformers, Mistral-Small-3.2 and Qwen3-4B text encoders): validation passes them all, so the loaders can
# name the wrong ones as the wrong model.
REAL_TRANSFORMERS = [
    {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 128, "joint_attention_dim": 15360,
     "num_attention_heads": 48, "num_layers": 8, "num_single_layers": 48, "out_channels": None, "patch_size": 1,
     "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "timestep_guidance_channels": 256, "mlp_ratio": 3.0},
    {"attention_head_dim": 128, "guidance_embeds": False, "in_channels": 128, "joint_attention_dim": 7680,
     "num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20},
    {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
     "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "pooled_projection_dim": 768},
    {"attention_head_dim": 64, "caption_projection_dim": 1536, "in_channels": 16, "joint_attention_dim": 4096,
     "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2, "sample_size": 128},
]
REAL_ENCODERS = [
    {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": {
        "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
     "vision_config": {"hidden_size": 1024}},
    {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 2560, "intermediate_size": 9728,
     "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
     "rope_scaling": None, "rope_theta": 1000000, "vocab_size": 151936, "tie_word_embeddings": True},
    {"model_type": "mistral", "head_dim": None, "hidden_size": 4096, "num_key_value_heads": 8,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "vocab_size": 32000},
]


@pytest.mark.parametrize("config", REAL_TRANSFORMERS)
def test_real_transformer_configs_pass(config):
    assert checked(config, TRANSFORMER_CONFIG, "config.json") is config


@pytest.mark.parametrize("config", REAL_ENCODERS)
def test_real_encoder_configs_pass(config):
    assert checked(config, ENCODER_CONFIG, "config.json") is config


def test_real_model_indexes_pass():
    flux2 = {"_class_name": "Flux2Pipeline", "_diffusers_version": "0.36.0", "scheduler": ["diffusers", "X"],
             "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"], "tokenizer": [None, None],
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}
    assert checked(flux2, PIPELINE_INDEX, "model_index.json") is flux2


@pytest.mark.parametrize("text_config, words", [
    ("wide", "text_config is 'wide', expected an object"),
    ({"hidden_size": "5120"}, "text_config.hidden_size is '5120', expected an integer"),
    ({"rope_theta": "1e9"}, "text_config.rope_theta is '1e9', expected a number or null"),
    ({"rope_parameters": {"rope_theta": -1}}, "text_config.rope_parameters.rope_theta is -1"),
])
def test_a_damaged_encoder_config_is_refused_naming_the_field(tmp_path, text_config, words):
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral3", "text_config": text_config}))
    message = refusal(CorruptFileError, plan_encoder, str(tmp_path))
    assert "config.json" in message and words in message


@pytest.fixture(scope="module")
def native_folder(tmp_path_factory) -> Path:
    from comfyui_flux2dev.devtools.tiny.encoders import write_native

    folder = tmp_path_factory.mktemp("native")
    write_native(str(folder))
    return folder


def _params(folder: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "native"
    copy.mkdir()
    for f in folder.iterdir():
        os.symlink(f, copy / f.name)
    os.unlink(copy / "params.json")
    params = json.loads((folder / "params.json").read_text())
    (copy / "params.json").write_text(json.dumps({**params, **changes}))
    return copy


def test_params_heads_that_disagree_with_the_weights_are_refused(native_folder, tmp_path):
    assert plan_encoder(str(native_folder)).unpermute_heads == {"self_attn.q_proj": 2, "self_attn.k_proj": 1}
    message = refusal(UnknownModelError, plan_encoder, str(_params(native_folder, tmp_path, n_heads=4)))
    assert "states 4 attention heads and 1 key/value heads" in message and "with 2 and 1" in message


@pytest.mark.parametrize("changes, words", [
    ({"n_heads": "2"}, "n_heads is '2', expected an integer"),
    ({"n_kv_heads": 0}, "n_kv_heads is 0, expected an integer from 1"),
    ({"rope_theta": [1e9]}, "rope_theta is a list of 1 items, expected a number"),
])
def test_damaged_params_are_refused_naming_the_field(native_folder, tmp_path, changes, words):
    message = refusal(CorruptFileError, plan_encoder, str(_params(native_folder, tmp_path, **changes)))
    assert "params.json" in message and words in message


# --- shapes from headers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, words", [((), "has shape []"), ((0, 64), "has shape [0, 64]"),
                                          ((131072,), "has shape [131072]")])
def test_an_embedding_that_is_no_table_is_refused(tmp_path, shape, words):
    save_file({"model.embed_tokens.weight": torch.zeros(shape)}, tmp_path / "enc.safetensors")
    message = refusal(UnknownModelError, plan_encoder, str(tmp_path / "enc.safetensors"))
    assert "embedding table" in message and words in message


def test_a_tensor_name_longer_than_any_real_one_is_refused(tmp_path):
    save_file({f"model.layers.{'9' * 5000}.self_attn.q_proj.weight": torch.zeros(2, 2)}, tmp_path / "enc.safetensors")
    assert "a tensor name is 5037 characters long" in refusal(CorruptFileError, plan_encoder,
                                                              str(tmp_path / "enc.safetensors"))


def test_layer_numbers_are_plain_digits(tmp_path):
    # "²" is a digit to str.isdigit but not to int(); a layer number of 7 digits is no real model's
    tensors = {"model.embed_tokens.weight": torch.zeros(131072, 1),
               "model.layers.².self_attn.q_proj.weight": torch.zeros(2, 2),
               "model.layers.1000000.self_attn.q_proj.weight": torch.zeros(2, 2)}
    save_file(tensors, tmp_path / "enc.safetensors")
    assert "lacks an embedding table or layer-0" in refusal(UnknownModelError, plan_encoder,
                                                            str(tmp_path / "enc.safetensors"))


def test_transformer_and_vae_inputs_must_be_matrices(tmp_path):
    save_file({"img_in.weight": torch.zeros(4), "txt_in.weight": torch.zeros(4, 2),
               "double_stream_modulation_img.lin.weight": torch.zeros(2, 2)}, tmp_path / "t.safetensors")
    assert "img_in.weight [4]" in refusal(UnknownModelError, identify_transformer, tmp_path / "t.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(4), "bn.running_mean": torch.zeros(4)},
              tmp_path / "ae.safetensors")
    assert "not a convolution's" in refusal(UnknownModelError, load_vae_state_dict, tmp_path / "ae.safetensors")


@pytest.mark.parametrize("declaration, words", [
    (b"not json", "not valid JSON"),
    (b'{"format": 4}', "format is 4, expected a string"),
    (b'["nvfp4"]', "holds a list of 1 items"),
    (b"{}", "lacks format"),
])
def test_a_damaged_quantization_declaration_is_refused(tmp_path, declaration, words):
    tensors = {"model.embed_tokens.weight": torch.zeros(2, 2),
               "model.layers.0.mlp.gate_proj.comfy_quant": torch.frombuffer(bytearray(declaration), dtype=torch.uint8)}
    save_file(tensors, tmp_path / "enc.safetensors")
    message = refusal(CorruptFileError, plan_encoder, str(tmp_path / "enc.safetensors"))
    assert "quantization declaration" in message and words in message


def test_a_folder_name_with_brackets_is_a_name_not_a_pattern(tmp_path):
    folder = tmp_path / "mistral [fp8]"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"x.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    assert "lacks an embedding table" in refusal(UnknownModelError, plan_encoder, str(folder))
