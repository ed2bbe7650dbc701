"""What a model load that failed means for the engine process: its exit code and the reason.

A model that can never be served (a family the engine does not run, a file missing, unreadable
or not a model, a configuration the model cannot take, memory too small for it) ends the engine
with EXIT_MODEL_UNSERVABLE: restarting it will not help, and the exit (a crash loop in
Kubernetes, a restarting container in compose, `tessera serve`'s error) shows the reason where
a health check that stays NOT_SERVING forever shows nothing. A failure that may pass (I/O on a
network file system, a timeout) ends it with EXIT_LOAD_FAILED, so that a restart tries again.
"""
from __future__ import annotations

import errno
from typing import NamedTuple

EXIT_LOAD_FAILED = 1       # the load failed for a reason that may pass: a restart may load it
EXIT_MODEL_UNSERVABLE = 3  # the model can never be served as configured: the reason is logged

# OSErrors of the medium rather than of the model: a second try may succeed.
_TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE,
                     errno.ENOLCK, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                     errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.EHOSTDOWN,
                     errno.EMFILE, errno.ENFILE}
# What these say is the whole reason; any other exception's traceback is logged with it.
_SELF_EXPLAINING = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
                    MemoryError)


class LoadFailure(NamedTuple):
    exit_code: int  # EXIT_MODEL_UNSERVABLE or EXIT_LOAD_FAILED
    reason: str     # one line, for a person
    traceback: bool  # whether the traceback helps (an error the reason does not explain)

    @property
    def permanent(self) -> bool:
        return self.exit_code == EXIT_MODEL_UNSERVABLE


def model_path(model: str | None) -> str:
    """The --model value as the log names it (the default model's file when none was given)."""
    if model:
        return model
    from tessera.common.model_source import default_model_path
    try:
        return str(default_model_path())
    except FileNotFoundError:
        return "(the default model, not installed)"


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def classify(exc: BaseException) -> LoadFailure:
    """The exit code and reason for an exception raised while loading the model."""
    if _out_of_memory(exc):
        return LoadFailure(EXIT_MODEL_UNSERVABLE, f"out of memory while loading it ({_one_line(exc)}); give it "
                           "more memory or a smaller --kv-cache-gib / --max-model-len", False)
    if isinstance(exc, (ConnectionError, TimeoutError)) or (
            isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS):
        return LoadFailure(EXIT_LOAD_FAILED, _one_line(exc), True)
    if isinstance(exc, PermissionError):
        return LoadFailure(EXIT_MODEL_UNSERVABLE, f"cannot read it: {_one_line(exc)}", False)
    if isinstance(exc, ValueError) and "GGUF magic" in str(exc):  # gguf's reader on any other file
        return LoadFailure(EXIT_MODEL_UNSERVABLE, f"not a GGUF file ({_one_line(exc)})", False)
    explained = isinstance(exc, _SELF_EXPLAINING)
    reason = _one_line(exc) if explained else f"{type(exc).__name__}: {_one_line(exc)}"
    return LoadFailure(EXIT_MODEL_UNSERVABLE, reason, not explained)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."
