"""Errors the runtime raises to its callers. The server maps each to an OpenAI-shaped body."""

from __future__ import annotations


class PagecastError(Exception):
    """Base class of every error pagecast raises on purpose."""


class InvalidRequestError(PagecastError, ValueError):
    """The request cannot be served as asked (HTTP 400). ``param`` names the offending field,
    ``code`` is a machine-readable reason such as ``context_length_exceeded``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineDeadError(PagecastError, RuntimeError):
    """The engine loop has stopped (HTTP 503); no further request can be served. The message
    holds the failure's details (for Python callers and the log); ``error_id`` names the log
    line that has them, which is all the server tells its clients."""

    def __init__(self, message: str, error_id: str | None = None):
        super().__init__(message)
        self.error_id = error_id


class ArtifactError(PagecastError):
    """An artifact that cannot be loaded: the message says what is wrong and what to do."""


class BuildError(PagecastError):
    """enginebuild cannot build this checkpoint: the message says what is wrong and what to do."""
