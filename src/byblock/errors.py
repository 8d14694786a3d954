"""Errors a user can cause and fix. The CLI prints them as one line and exits with code 2."""


class ByblockError(Exception):
    """A user-facing error: bad input, missing model, invalid parameter. Its message is one line."""


class ModelNotFoundError(ByblockError):
    """The model name, path or hub id could not be resolved to weights on this machine."""


class InvalidParameterError(ByblockError, ValueError):
    """A sampling or decoding parameter is out of range."""


class ContextLengthError(ByblockError):
    """The prompt plus requested tokens does not fit in the model's context window."""
