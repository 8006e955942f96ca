def test_comfy_imports_in_process_on_cpu(comfy_host):
    import comfy.model_management as mm
    import torch

    assert mm.get_torch_device() == torch.device("cpu")
    assert hasattr(comfy_host, "load_diffusion_model_state_dict")
