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
from apps.common.shared_adapters import SharedAdapters, multi_adapter_policy

if TYPE_CHECKING:
    from apps.serve.config import ServeConfig
    from forge.models.lora import LoraSettings


async def run(cfg: ServeConfig, terminal: Any, resume_from: Any = None) -> str:
    """Start the policy service and the HTTP server; serve until a signal; stop both."""
    from transformers import AutoTokenizer

    from forge.serving import FrontSettings, make_app
    from forge.serving.server import start_server

    cli.record_config(cfg, terminal, "serve")
    model_path = make_model(cfg.model).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    adapters = read_adapters(cfg.policy.adapters)
    spec = policy_spec(cfg, str(model_path), adapters)
    resources = await open_run(cfg)
    policy = None
    served = 0
    try:
        try:
            policy = await start_role(spec, cfg, assign_gpus(cfg, roles=("policy",)), resources.host_pool)
            if adapters:
                shared = SharedAdapters(policy, cfg.server.request_timeout_s)  # also a restarted replica's resync
                for name, (_, tensors) in adapters.items():
                    await shared.add(name)
                    await shared.publish(name, tensors, version=1)
        except Exception as exc:
            raise RoleFailed("policy", exc) from exc
        s = cfg.server
        settings = FrontSettings(
            model_name=s.model_name or model_path.name,
            adapters=tuple(adapters),
            max_model_len=cfg.policy.max_model_len,
            default_max_tokens=cfg.policy.max_tokens,
            api_key=s.api_key,
            max_concurrent=s.max_concurrent,
            request_timeout_s=s.request_timeout_s,
            batched_engine=cfg.policy.engine_mode == "batched",
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


def read_adapters(folders: dict[str, str]) -> dict[str, tuple[LoraSettings, dict[str, Any]]]:
    """Each adapter of ``policy.adapters``: its settings and tensors; adapters whose rank, alpha or
    targets differ are refused (one policy serves them with one LoRA shape), naming both."""
    from forge.models.lora import read_adapter_folder

    adapters = {name: read_adapter_folder(folder) for name, folder in folders.items()}
    shapes = {name: settings for name, (settings, _) in adapters.items()}
    if len({(s.rank, s.alpha, tuple(s.target_modules)) for s in shapes.values()}) > 1:
        listed = ", ".join(f"{n}: r={s.rank} alpha={s.alpha} targets={s.target_modules}" for n, s in shapes.items())
        raise ValueError(f"policy.adapters must share one rank, alpha and target modules; got {listed}")
    return adapters


def policy_spec(cfg: ServeConfig, model_path: str, adapters: dict[str, Any]) -> RoleSpec:
    """The policy service: a ``Policy``, or with adapters a ``MultiLoraPolicy`` that holds
    ``policy.adapters_per_replica`` of them (0: all) and routes each request by its model."""
    from forge.actors import Policy

    config = policy_config(cfg, model_path, group_size=1)
    # More than one batch in flight: a request arriving mid-batch joins the engine at its next step.
    options: dict[str, Any] = {
        "endpoint_routers": {"sample": cfg.server.router},
        "concurrent_batches": {"sample": cfg.policy.concurrent_batches},
    }
    if not adapters:
        return RoleSpec("policy", Policy, config, POLICY_ENV, options=options)
    config.lora = next(iter(adapters.values()))[0]
    options["concurrent_batches"]["sample_adapter"] = cfg.policy.concurrent_batches
    return multi_adapter_policy(config, cfg.policy.adapters_per_replica or len(adapters), options)


main = cli.entry("serve", "apps.serve.config:ServeConfig", run, __doc__, resumable=False, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
