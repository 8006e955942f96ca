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
    monkeypatch.setitem(menus.MENUS, "encoder", (menus.MenuSource(key, (".safetensors", ".gguf"), menus.has_config),))
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
    for gone in ("gone.safetensors", "sub/notes.txt", "sub/", "../b/z.safetensors", str(root / "b" / "z.safetensors"),
                 ""):
        with pytest.raises(FileNotFoundError, match=r"^The text encoder '.*' is no longer there"):
            chosen_path("encoder", gone, "The text encoder")


def test_a_looping_models_folder_is_listed_once(encoder_menu):
    from comfyui_flux2dev.host.menus import model_choices

    root = encoder_menu
    (root / "a" / "sub").mkdir(parents=True)
    (root / "a" / "sub" / "y.gguf").write_bytes(b"")
    (root / "a" / "sub" / "loop").symlink_to(root / "a", target_is_directory=True)
    assert list(model_choices("encoder")) == ["sub/y.gguf"]


def test_a_name_in_two_folders_of_one_menu_is_listed_from_each(comfy_host, tmp_path, monkeypatch):
    import folder_paths

    from comfyui_flux2dev.host import menus

    for key in ("flux2dev_test_first", "flux2dev_test_second"):
        (tmp_path / key / "same").mkdir(parents=True)
        (tmp_path / key / "same" / "config.json").write_text("{}")
        (tmp_path / key / f"only-{key}.safetensors").write_bytes(b"")
        monkeypatch.setitem(folder_paths.folder_names_and_paths, key, ([str(tmp_path / key)], set()))
    sources = tuple(menus.MenuSource(key, (".safetensors",), menus.has_config)
                    for key in ("flux2dev_test_first", "flux2dev_test_second"))
    monkeypatch.setitem(menus.MENUS, "vae", sources)
    choices = menus.model_choices("vae")
    assert choices == {
        "flux2dev_test_first:same/": str(tmp_path / "flux2dev_test_first" / "same"),
        "flux2dev_test_second:same/": str(tmp_path / "flux2dev_test_second" / "same"),
        "only-flux2dev_test_first.safetensors":
            str(tmp_path / "flux2dev_test_first" / "only-flux2dev_test_first.safetensors"),
        "only-flux2dev_test_second.safetensors":
            str(tmp_path / "flux2dev_test_second" / "only-flux2dev_test_second.safetensors"),
    }
    for name, path in choices.items():
        assert menus.chosen_path("vae", name, "The VAE") == path
    # A workflow saved before both folders held the name still finds it, in the first folder.
    assert menus.chosen_path("vae", "same/", "The VAE") == str(tmp_path / "flux2dev_test_first" / "same")


def test_the_dev_encoder_source_lists_dev_pipelines_only(comfy_host, tiny_root):
    import folder_paths

    from comfyui_flux2dev.host.menus import model_choices

    folder_paths.add_model_folder_path("diffusers", str(tiny_root / "diffusers"))
    try:
        pipelines, dev = model_choices("pipeline"), model_choices("dev pipeline")
    finally:
        folder_paths.folder_names_and_paths["diffusers"][0].remove(str(tiny_root / "diffusers"))
    assert "flux2-klein-4b-tiny-pipeline/" in pipelines and "flux2-dev-tiny-pipeline/" in pipelines
    assert list(dev) == ["flux2-dev-tiny-pipeline/"]
