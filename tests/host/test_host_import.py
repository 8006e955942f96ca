def test_comfy_imports_in_process_on_the_device_torch_has(comfy_host):
    import comfy.model_management as mm
    import torch

    assert mm.get_torch_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert hasattr(comfy_host, "load_diffusion_model_state_dict")


def test_importing_the_pack_leaves_the_process_alone():
    """Importing every module of the host layer and the command line imports no comfy and changes neither
    sys.argv nor sys.path: only loading a model does (outside ComfyUI, by finding the tree it is told of)."""
    import subprocess
    import sys

    code = """
import sys
argv, path = list(sys.argv), list(sys.path)
import importlib, pkgutil
import comfyui_flux2dev.cli, comfyui_flux2dev.host as host
for module in pkgutil.iter_modules(host.__path__):
    importlib.import_module(f"comfyui_flux2dev.host.{module.name}")
assert not [m for m in sys.modules if m.split(".")[0] in ("comfy", "folder_paths", "comfy_api")], sorted(sys.modules)
assert sys.argv == argv and sys.path == path
"""
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
