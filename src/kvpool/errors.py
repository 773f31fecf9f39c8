"""The exception types kvpool raises on purpose; every one derives from KVPoolError."""


class KVPoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


class OutOfPages(KVPoolError, MemoryError):
    """Not enough free pages for the request; nothing was changed."""


class InvalidPage(KVPoolError, ValueError):
    """A page id out of range or not allocated (e.g. a double free); nothing was changed."""


class UnknownSequence(KVPoolError, KeyError):
    """No sequence with this id exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequence(KVPoolError, ValueError):
    """A sequence with this id already exists."""


class SequenceTooLong(KVPoolError, ValueError):
    """A sequence would grow past its per-sequence token limit."""


class ConfigError(KVPoolError, ValueError):
    """A model config is missing, malformed, or describes an unsupported architecture."""


class CheckpointError(KVPoolError, ValueError):
    """A checkpoint's weights do not match its config (missing, unexpected or misshapen)."""
