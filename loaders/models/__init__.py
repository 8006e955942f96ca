"""What a checkpoint is: the FLUX.2 variants, model kinds, the text encoder's layouts, identification and plan,
and the loaders of the encoder, the transformer (safetensors and GGUF), the VAE and pipeline folders, and
`flux2dev inspect`."""
