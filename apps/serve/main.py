"""Serve a model over an OpenAI-compatible HTTP API, through a forge policy service.

Run:

    python -m apps.serve.main --config configs/serve_tiny.yaml
    python -m apps.serve.main --config configs/serve_tiny.yaml server.port=0 policy.num_replicas=2

``policy.num_replicas`` vLLM replicas behind one service named ``policy`` (as in the GRPO app),
prebatched and routed by key (``X-Session-ID``, else ``user``, else the prompt), and a uvicorn
server in front (``forge.serving``). Prints the base URL once it serves; SIGINT or SIGTERM stops
the server, then the replicas.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.inputs import make_model
from apps.common.launch import RoleSpec, assign_gpus, open_run, policy_config, start_role
from apps.common.roles import POLICY_ENV, RoleFailed

if TYPE_CHECKING:
    from apps.serve.config import ServeConfig


async def run(cfg: ServeConfig, terminal: Any, resume_from: Any = None) -> str:
    """Start the policy service and the HTTP server; serve until a signal; stop both."""
    from transformers import AutoTokenizer

    from forge.actors import Policy
    from forge.serving import FrontSettings, make_app
    from forge.serving.server import start_server

    cli.record_config(cfg, terminal, "serve")
    model_path = make_model(cfg.model).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    resources = await open_run(cfg)
    spec = RoleSpec(
        "policy",
        Policy,
        policy_config(cfg, str(model_path), group_size=1),
        POLICY_ENV,
        options={
            "endpoint_routers": {"sample": cfg.server.router},
            # More than one batch in flight: a request arriving mid-batch joins the engine at its next step.
            "concurrent_batches": {"sample": cfg.policy.concurrent_batches},
        },
    )
    policy = None
    served = 0
    try:
        try:
            policy = await start_role(spec, cfg, assign_gpus(cfg, roles=("policy",)), resources.host_pool)
        except Exception as exc:
            raise RoleFailed("policy", exc) from exc
        s = cfg.server
        settings = FrontSettings(
            model_name=s.model_name or model_path.name,
            max_model_len=cfg.policy.max_model_len,
            default_max_tokens=cfg.policy.max_tokens,
            api_key=s.api_key,
            max_concurrent=s.max_concurrent,
            request_timeout_s=s.request_timeout_s,
            streaming=cfg.policy.engine_mode == "batched",
        )
        app = make_app(policy, tokenizer, settings)
        running = await start_server(app, s.host, s.port, own_signals=True)
        print(f"serving {settings.model_name!r} at {running.base_url}", flush=True)
        await running.task  # until SIGINT or SIGTERM (uvicorn's handlers)
        served = int(app.state.front.served)
    finally:
        if policy is not None:
            await policy.shutdown()
        resources.close()
    return f"serve: stopped after {served} requests"


main = cli.entry("serve", "apps.serve.config:ServeConfig", run, __doc__, resumable=False, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
