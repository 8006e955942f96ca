"""File formats, with no knowledge of models: the bounded readers and checks of files and JSON (validate), the
safetensors and GGUF readers, the files of a model folder, the packed weight formats (packing.FORMATS) and
the dequantizers."""
