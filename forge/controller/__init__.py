"""forge's service layer over Monarch: actors, batched endpoints, routers, services.

Import this before ``monarch`` so that forge's Monarch settings (fast failure detection,
quiet logs) are in the environment when Monarch reads them.
"""

from forge.controller import _env  # noqa: F401  (must run before monarch is imported)
from forge.controller.actor import ActorLauncher, ForgeActor
from forge.controller.attach import AttachedReplicas, ServiceView, attach, attached_replicas, service_view
from forge.controller.batching import Batcher, Batching
from forge.controller.endpoint import endpoint
from forge.controller.errors import (
    BatchResultError,
    EndpointError,
    ForgeError,
    ModelLoadError,
    NoHealthyReplica,
    Overloaded,
    ReplicaFailed,
    RequestTimeout,
    ServiceStopped,
)
from forge.controller.handle import EndpointHandle, ServiceInterface
from forge.controller.hosts import HostPool, NotEnoughHosts
from forge.controller.multiplex import Multiplexing, model_loader
from forge.controller.options import ActorOptions
from forge.controller.provisioner import InsufficientGpus, split_gpus
from forge.controller.quiet import quiet_monarch
from forge.controller.replica import ReplicaState
from forge.controller.routing import (
    KeyAffinity,
    LeastLoaded,
    ModelAware,
    RoundRobin,
    Router,
    RouteRequest,
    RouteTrace,
    Sticky,
    register_router,
)
from forge.controller.service import Service
from forge.wire import install as _install_fast_tensors

_install_fast_tensors()  # small tensors cross processes as numpy arrays (see forge.wire)

__all__ = [
    "AttachedReplicas",
    "ServiceView",
    "attach",
    "attached_replicas",
    "service_view",
    "ActorLauncher",
    "ActorOptions",
    "Batcher",
    "Batching",
    "BatchResultError",
    "EndpointError",
    "EndpointHandle",
    "ForgeActor",
    "ForgeError",
    "HostPool",
    "InsufficientGpus",
    "KeyAffinity",
    "LeastLoaded",
    "ModelAware",
    "ModelLoadError",
    "Multiplexing",
    "NoHealthyReplica",
    "NotEnoughHosts",
    "Overloaded",
    "ReplicaFailed",
    "ReplicaState",
    "RequestTimeout",
    "RoundRobin",
    "RouteRequest",
    "RouteTrace",
    "Router",
    "Service",
    "ServiceInterface",
    "ServiceStopped",
    "Sticky",
    "endpoint",
    "model_loader",
    "register_router",
    "quiet_monarch",
    "split_gpus",
]
