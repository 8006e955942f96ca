"""Prompt upsampling's models and inputs: the language model that writes text (`language_model.py`), the vision
tower for edits (`vision.py`), the reference images as it sees them (`images.py`) and the generation settings with
their bounds (`generation_settings.py`, torch-free, so the command line checks them before torch loads). The chat
layout is the tokenizer layer's (tokenizers/chat.py); host/upsampler.py runs it all on the host's objects."""
