"""The exception types kvpool raises on purpose (every one derives from KVPoolError), and
the one check of integer arguments the core uses."""

MAX_PAGES = 2**31 - 1  # page ids travel in int32 page tables


class KVPoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


class OutOfPages(KVPoolError, MemoryError):
    """Not enough free pages for the request; nothing was changed."""


class OutOfStateSlots(KVPoolError, MemoryError):
    """Not enough free state slots in a MambaPool; nothing was changed."""


class InvalidStateSlot(KVPoolError, ValueError):
    """A state slot that is not allocated (e.g. a double free); nothing was changed."""


class InvalidPage(KVPoolError, ValueError):
    """A page id out of range or not allocated (e.g. a double free); nothing was changed."""


class UnknownSequence(KVPoolError, KeyError):
    """No sequence with this id exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequence(KVPoolError, ValueError):
    """A sequence with this id already exists."""


class InvalidPrompt(KVPoolError, ValueError):
    """A prompt the engine cannot take: empty, a token id outside the vocabulary, or text for
    a model without a tokenizer; nothing was changed."""


class SequenceTooLong(KVPoolError, ValueError):
    """A sequence would grow past its per-sequence token limit."""


class StepFailed(KVPoolError, RuntimeError):
    """A request failed inside a step (e.g. while sampling); it alone finished with "error"."""


class EngineStateError(KVPoolError, RuntimeError):
    """A call the engine refuses in its present state (a request while it sleeps, sleep()
    with requests unfinished, wake() while awake); nothing was changed."""


class EngineDied(KVPoolError, RuntimeError):
    """An engine process (the prefill side of a DisaggregatedLLM) died or stopped answering
    within its timeout; the requests waiting on it failed."""


class RankFailed(EngineDied):
    """A rank of a tensor-parallel engine died or raised: the message names it. The engine's
    ranks are out of step, so it runs no further step: an engine that died."""


class ConfigError(KVPoolError, ValueError):
    """A model config is missing, malformed, or describes an unsupported architecture."""


class CheckpointError(KVPoolError, ValueError):
    """A checkpoint's weights do not match its config (missing, unexpected or misshapen)."""


class OutOfMemory(KVPoolError, MemoryError):
    """Memory for a pool or a tier could not be had; the message names the bytes asked for."""


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` if it is an int (not a bool) in `[low, high]`; else TypeError for another
    type, ValueError out of range, each naming `name`, the range and the value. The one
    argument check of the core."""
    if type(value) is int and low <= value and (high is None or value <= high):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return int(value)


class ServerFailed(KVPoolError, RuntimeError):
    """An HTTP server refused or failed a request sent to it (`kvpool bench --url`): its
    status and message."""
