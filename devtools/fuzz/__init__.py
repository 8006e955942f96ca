"""Mutation fuzzing of every parser and loader entry point, from the pack's own tiny fixtures.

Each target (TARGETS) is one entry point run on model files and folders rebuilt from the tiny/ factory's
output: weights become sparse files (headers real, tensor data a hole), and vocabularies are cut to the 1000
specials and a few hundred ranks so a tokenizer builds in milliseconds. Input `i` of seed `s` is one mutation
(or a short stack) of one file of one of those trees, chosen by random.Random(f"{target}/{s}/{i}"): it is
reproducible from (target, seed, index) alone. Mutations are structure-aware (a JSON value at a random path
retyped, made huge or deeply nested; safetensors header lengths and entries; GGUF counts, values, vocabulary
arrays and tensor dims, types and offsets), raw (bit flips, interesting integers, byte insertions and
deletions, truncation) or of the file's kind (a folder, a FIFO or a symlink loop where the file was).

The oracle: an input passes when the entry point returns normally or raises the pack's Flux2DevError.
Anything else fails: another exception (BaseException included, such as the tokenizers library's
PanicException), more than --cpu seconds of CPU, blocking (a hang without CPU use), a peak memory growth over
256 MiB plus 4x the input's size, an error text quoting a file outside the model folder, or an index naming
shards outside it. Inputs run in forked worker processes that live until one fails, so a hang or a blowup
never takes the harness down.

    python -m comfyui_flux2dev.devtools fuzz                     # quick mode: 100 inputs per target (the tests')
    python -m comfyui_flux2dev.devtools fuzz --long              # the campaign: 20,000 inputs per target
    python -m comfyui_flux2dev.devtools fuzz --target gguf-reader --seed 7 --index 123   # one input, traceback
"""
