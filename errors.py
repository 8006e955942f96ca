"""The errors the pack raises. Each message is written for the person reading ComfyUI's error dialog:
what was found, what was expected, and what to do."""

import unicodedata

# ComfyUI imports the pack under its folder's path, and its error reports name an exception by its module:
# every error type names the installed package instead, whatever the folder is called.
MODULE = "comfyui_flux2dev.errors"


# Characters a message shows as escapes: file names may carry a right-to-left override that reorders what
# the user reads, control characters, or bytes no encoding can print. Newlines and tabs stay (the host's
# own text, quoted by GraphError, has them).
_SHOWN_ESCAPED = ("Cc", "Cf", "Cs", "Zl", "Zp")


def _visible(text: str) -> str:
    return "".join(
        c if c in "\n\t" or unicodedata.category(c) not in _SHOWN_ESCAPED else ascii(c)[1:-1] for c in text
    )


class Flux2DevError(Exception):
    """Base of every error the pack raises on purpose; catch this to catch them all."""

    def __init__(self, *args):
        super().__init__(*(_visible(a) if isinstance(a, str) else a for a in args))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = MODULE


Flux2DevError.__module__ = MODULE


class ModelNotFoundError(Flux2DevError, FileNotFoundError):
    """The file or folder the user named is not there."""


class WrongModelError(Flux2DevError):
    """The file is a real model, but not the one this node loads (a Klein encoder, a VAE, a FLUX.1 ...)."""


class UnknownModelError(Flux2DevError):
    """The file's geometry or layout matches nothing the pack knows; it fails closed rather than guess."""


class MissingWeightsError(Flux2DevError):
    """Tensors the model needs are absent; the pack never fills them with zeros."""


class CorruptFileError(Flux2DevError):
    """The file is truncated, malformed or hostile (bad offsets, absurd counts, unknown types)."""


class TooManyOpenFilesError(Flux2DevError):
    """ComfyUI's process reached its limit of open files (or the system its table of them): the file is fine, the
    limit must be raised."""


class UnsupportedFormatError(Flux2DevError):
    """A weight format or quantization the pack does not read (pickled checkpoints among them)."""


class TokenizerNotFoundError(Flux2DevError):
    """No rung of the tokenizer ladder gave a tokenizer that passed the self-test."""


class VariantMismatchError(Flux2DevError):
    """Parts of different FLUX.2 variants were wired together (a Klein encoder into [dev], ...)."""


class InputError(Flux2DevError):
    """A node input or command-line argument that cannot work as given (an edit without images, ...)."""


class PromptTooLongError(InputError):
    """A prompt is longer than the model reads at once (prompt upsampling's chat)."""


class CacheError(Flux2DevError):
    """The conditioning cache folder cannot be used as given (it holds other files, or is no folder)."""


class HostError(Flux2DevError):
    """ComfyUI itself cannot serve: not found, too old for FLUX.2, or its server failed."""


class GraphError(HostError):
    """The server refused a graph or a node failed while running it; the message is the host's own text."""


class OutputError(Flux2DevError):
    """A file the pack writes cannot be written as asked (something is at its name, its folder is read-only or
    full); nothing is left under its name."""
