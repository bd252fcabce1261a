"""Domain errors shared by every service. Pure: no grpc import here; the one interceptor in
hybridserve.grpc_server maps them to status codes."""

from __future__ import annotations


class HybridServeError(Exception):
    """Base of every error a service raises on purpose; the message is shown to the caller."""


class InvalidArgumentError(HybridServeError, ValueError):
    """The caller sent something that can never succeed as sent (-> INVALID_ARGUMENT)."""


class ResourceExhaustedError(HybridServeError):
    """No capacity now; the same call may succeed later (-> RESOURCE_EXHAUSTED)."""


class NotFoundError(HybridServeError, KeyError):
    """The named thing does not exist (-> NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the plain message
        return str(self.args[0]) if self.args else ""


class UnavailableError(HybridServeError):
    """A dependency (scheduler, cache, Redis) did not answer in time (-> UNAVAILABLE)."""


class DeadlineExceededError(HybridServeError):
    """The request's own deadline passed (-> DEADLINE_EXCEEDED)."""


class AbortedError(HybridServeError):
    """The server gave up on this call for a reason of its own (a failed engine step, a drain); the
    same call may succeed if sent again, here or elsewhere (-> ABORTED)."""
