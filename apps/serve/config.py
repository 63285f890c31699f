"""The serve app's config: the model, the policy service (``policy``) and the HTTP server."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.config import LoggingSection, PolicySection, RunSections


@dataclass(kw_only=True)
class ServerSection:
    host: str = "127.0.0.1"
    """Address to bind. Anything but a loopback address needs ``api_key``."""
    port: int = 8000
    """Port to bind; 0: any free one (the base URL printed at start says which)."""
    api_key: str | None = None
    """Clients must send ``Authorization: Bearer <api_key>``; None: no key (loopback only)."""
    max_concurrent: int = 256
    """Requests served at once; one more gets 429 with ``Retry-After``."""
    request_timeout_s: float = 600.0
    """Longest a request waits for the policy service (then 504)."""
    model_name: str = ""
    """The model id clients name; empty: the name of ``model.path``'s folder."""
    router: str = "key_affinity"
    """How a request picks its replica: ``key_affinity`` sends every turn of a session (its
    ``X-Session-ID``, else ``user``, else the prompt) to the replica that holds its prefix; any
    other registered router (``round_robin``, ``least_loaded``) ignores the key."""


@dataclass(kw_only=True)
class ServePolicySection(PolicySection):
    """The policy section (``PolicySection``), and the LoRA adapters served beside the base."""

    adapters: dict[str, str] = field(default_factory=dict)
    """Model id -> a PEFT LoRA adapter folder (of this base; all with one rank, alpha and targets):
    a request's ``model`` picks the base (``server.model_name``) or one of them. Routed by model
    (``model_aware``) and batched per model, through forge's multiplexing."""
    adapters_per_replica: int = 0
    """Adapters a replica holds in vLLM at once (past it the least recently used idle one is
    evicted, and loaded again when asked for); 0: every adapter."""


@dataclass(kw_only=True)
class ServeConfig(RunSections):
    """Serve ``model.path`` over an OpenAI-compatible API (the sections every app shares,
    ``RunSections``: ``policy`` is the vLLM engine and its placement, ``policy.num_replicas`` of it)."""

    policy: ServePolicySection = field(default_factory=ServePolicySection)
    server: ServerSection = field(default_factory=ServerSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/serve"))

    def __post_init__(self) -> None:
        s = self.server
        if isinstance(s.port, bool) or not isinstance(s.port, int) or not 0 <= s.port <= 65535:
            raise ValueError(f"server.port must be an int in 0..65535, got {s.port!r}")
        if s.max_concurrent < 1:
            raise ValueError(f"server.max_concurrent must be >= 1, got {s.max_concurrent}")
        if s.request_timeout_s <= 0:
            raise ValueError(f"server.request_timeout_s must be > 0, got {s.request_timeout_s}")
        from forge.controller.routing import make_router

        try:
            make_router(s.router)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"server.router: {exc}") from None
        if s.api_key is not None and not s.api_key:
            raise ValueError("server.api_key is empty; give a key or leave it unset (null)")
        p = self.policy
        for name, folder in p.adapters.items():
            if not name or not isinstance(folder, str) or not folder:
                raise ValueError(f"policy.adapters maps a model id to an adapter folder, got {name!r}: {folder!r}")
            if name == s.model_name:
                raise ValueError(
                    f"policy.adapters.{name}: the base model is served as {name!r}; name the adapter otherwise"
                )
        if isinstance(p.adapters_per_replica, bool) or p.adapters_per_replica < 0:
            raise ValueError(
                f"policy.adapters_per_replica must be >= 0 (0: every adapter), got {p.adapters_per_replica}"
            )
        if p.adapters and p.engine_mode != "batched":
            raise ValueError(f"policy.adapters needs policy.engine_mode 'batched', got {p.engine_mode!r}")
        if not is_loopback(s.host) and s.api_key is None:
            raise ValueError(
                f"server.host {s.host!r} is not a loopback address: set server.api_key, so that only clients "
                "holding it are served"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
