"""The nodes' model menus, read from the host's own folder_paths."""

import pytest


@pytest.fixture
def model_folder(comfy_host, tmp_path):
    import folder_paths

    key = "flux2dev_test_models"
    folder_paths.folder_names_and_paths[key] = ([str(tmp_path / "a"), str(tmp_path / "b")], set())
    yield key, tmp_path
    del folder_paths.folder_names_and_paths[key]


def test_menus_list_files_in_subfolders_and_model_folders_once(model_folder):
    from comfyui_flux2dev.nodes.choices import chosen_path, has_config, model_choices

    key, root = model_folder
    for name in ("a/x.safetensors", "a/sub/y.gguf", "a/sub/notes.txt", "a/hf/config.json",
                 "a/hf/model-00001-of-00002.safetensors", "b/x.safetensors", "b/z.safetensors"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")
    choices = model_choices(key, (".safetensors", ".gguf"), has_config)
    assert list(choices) == ["hf/", "sub/y.gguf", "x.safetensors", "z.safetensors"]
    assert choices["x.safetensors"] == str(root / "a" / "x.safetensors")  # the first root wins, as in the host
    assert chosen_path(choices, "hf/", "The text encoder") == str(root / "a" / "hf")
    with pytest.raises(FileNotFoundError, match=r"^The text encoder 'gone.safetensors' is no longer there"):
        chosen_path(choices, "gone.safetensors", "The text encoder")
