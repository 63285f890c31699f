"""Exception types a caller of a forge service can catch.

Every failure on a message path reaches its caller as one of these (or as the remote
exception's own type inside ``EndpointError.remote``), never as a silent hang.
"""

from __future__ import annotations

from forge.describe import describe

__all__ = [
    "BatchResultError",
    "EndpointError",
    "ForgeError",
    "ModelLoadError",
    "NoHealthyReplica",
    "Overloaded",
    "ReplicaFailed",
    "RequestTimeout",
    "ServiceStopped",
    "UnsendableArgument",
    "describe",
]


class ForgeError(Exception):
    """Base class of every error raised by forge's service layer."""


class EndpointError(ForgeError):
    """The endpoint's code raised. Carries the remote exception's type name and message.

    The original exception object, when it could be transported, is ``remote`` (and
    ``__cause__``), so ``except EndpointError as e: isinstance(e.remote, ValueError)`` works.
    """

    def __init__(self, endpoint: str, type_name: str, message: str, remote: BaseException | None = None):
        super().__init__(f"{endpoint} raised {type_name}: {message}")
        self.endpoint = endpoint
        self.type_name = type_name
        self.remote_message = message
        self.remote = remote


class ModelLoadError(EndpointError):
    """A multiplexed model failed to load on a replica; only the requests for that model get it.

    ``endpoint`` names the loader and the model, e.g. ``Predictor.load_model('m7')@r0``; a later
    request for the same model tries the load again.
    """


class BatchResultError(ForgeError):
    """A batched endpoint returned a result that cannot be split back to its callers."""


class ReplicaFailed(ForgeError):
    """The replica's process died (or was stopped) before it answered this request."""


class RequestTimeout(ForgeError, TimeoutError):
    """The request got no answer within its timeout."""


class Overloaded(ForgeError):
    """The service's admission limits were full for longer than the caller's wait allowed."""


class NoHealthyReplica(ForgeError):
    """No replica of the service can take traffic right now."""


class ServiceStopped(ForgeError):
    """The service was shut down; queued and new requests get this instead of hanging."""


class UnsendableArgument(ForgeError, TypeError):
    """A request argument cannot be serialised for the trip to the replica (not picklable)."""
