"""The nodes' model menus, read from the host's own folder_paths."""

import pytest


@pytest.fixture
def model_folder(comfy_host, tmp_path):
    import folder_paths

    key = "flux2dev_test_models"
    folder_paths.folder_names_and_paths[key] = ([str(tmp_path / "a"), str(tmp_path / "b")], set())
    yield key, tmp_path
    del folder_paths.folder_names_and_paths[key]


@pytest.fixture
def encoder_menu(model_folder, monkeypatch):
    """The encoder loader's menu, over the test's two model folders."""
    from comfyui_flux2dev.host import menus

    key, root = model_folder
    monkeypatch.setitem(menus.MENUS, "encoder", (menus.Source(key, (".safetensors", ".gguf"), menus.has_config),))
    return root


def test_menus_list_files_in_subfolders_and_model_folders_once(encoder_menu):
    from comfyui_flux2dev.host.menus import chosen_path, model_choices

    root = encoder_menu
    for name in ("a/x.safetensors", "a/sub/y.gguf", "a/sub/notes.txt", "a/hf/config.json",
                 "a/hf/model-00001-of-00002.safetensors", "b/x.safetensors", "b/z.safetensors"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")
    choices = model_choices("encoder")
    assert list(choices) == ["hf/", "sub/y.gguf", "x.safetensors", "z.safetensors"]
    assert choices["x.safetensors"] == str(root / "a" / "x.safetensors")  # the first root wins, as in the host
    for name, path in choices.items():
        assert chosen_path("encoder", name, "The text encoder") == path
    for gone in ("gone.safetensors", "sub/notes.txt", "sub/", "../b/z.safetensors", str(root / "b" / "z.safetensors"), ""):
        with pytest.raises(FileNotFoundError, match=r"^The text encoder '.*' is no longer there"):
            chosen_path("encoder", gone, "The text encoder")


def test_a_looping_models_folder_is_listed_once(encoder_menu):
    from comfyui_flux2dev.host.menus import model_choices

    root = encoder_menu
    (root / "a" / "sub").mkdir(parents=True)
    (root / "a" / "sub" / "y.gguf").write_bytes(b"")
    (root / "a" / "sub" / "loop").symlink_to(root / "a", target_is_directory=True)
    assert list(model_choices("encoder")) == ["sub/y.gguf"]
