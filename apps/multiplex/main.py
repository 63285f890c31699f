"""Many models behind one service: score answers under several tiny checkpoints, batched per model.

Run (the models are made on the fly in a temporary folder):

    python -m apps.multiplex.main
    python -m apps.multiplex.main --models 8 --replicas 3 --max-models 2 --requests 1000

What it shows:

1. ``--models`` tiny causal LMs (``forge.models.tiny``, one seed each) are written to disk, as a
   fleet of fine-tuned checkpoints would be.
2. One ``Scorer`` service of ``--replicas`` replicas serves all of them. Each replica holds at
   most ``--max-models`` at once: ``@model_loader`` loads one on first use and the replica
   evicts its least recently used idle model when it needs room.
3. Callers name the model per request, ``svc.score.route((prompt, answer), model_id="tiny-2")``;
   ``model_aware`` routing sends the request to a replica that holds that model, and the
   replica batches it with other requests *for the same model* (one forward pass per batch).
4. A check that each answer came from the model it named: one score per model is recomputed
   here, in this process, and compared.
5. A stream of ``--requests`` requests whose models follow a Zipf law, then a summary: loads,
   evictions, hits, and the mean batch size per model.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import forge.controller  # noqa: F401  (before anything imports monarch)
from forge.controller import Batching, ForgeActor, endpoint, model_loader, quiet_monarch
from forge.data.tasks import ToyTask
from forge.models.logprobs import sequence_logprobs
from forge.models.tiny import make_tiny_model

Request = tuple[str, str]  # (prompt, answer)


def load_checkpoint(path: Path) -> tuple[Any, Any]:
    """A tiny model and its tokenizer from disk, in eval mode (quietly)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def score(model: Any, tokenizer: Any, requests: list[Request]) -> list[float]:
    """log p(answer | prompt) of each request, in one padded forward pass."""
    prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p, _ in requests]
    answers = [torch.tensor(tokenizer(a)["input_ids"]) for _, a in requests]
    return [float(lp.sum()) for lp in sequence_logprobs(model, prompts, answers, pad_id=tokenizer.pad_token_id)]


class Scorer(ForgeActor):
    """Scores answers under whichever checkpoint a request names."""

    def __init__(self, root: str):
        self.root = Path(root)
        torch.set_num_threads(1)  # replicas share the machine's cores: one each, no oversubscription

    @model_loader  # how many fit per replica: the service's options(max_models=...)
    async def load_model(self, model_id: str) -> tuple[Any, Any]:
        return load_checkpoint(self.root / model_id)

    @endpoint(batch=Batching(max_size=16, max_wait_s=0.01), multiplexed=True)
    async def score(self, model: tuple[Any, Any], requests: list[Request]) -> list[float]:
        return score(*model, requests)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=5, help="tiny checkpoints to make and serve")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-models", type=int, default=2, help="models one replica holds at most")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=32, help="concurrent callers")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of model popularity")
    parser.add_argument("--dir", help="where to write the models (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the check in step 4 runs here, next to the replicas

    with tempfile.TemporaryDirectory(prefix="forge-multiplex-") as tmp:
        # -------------------------------------------------------------- 1. the checkpoints
        root = Path(args.dir or tmp)
        model_ids = [f"tiny-{k}" for k in range(args.models)]
        for k, model_id in enumerate(model_ids):
            make_tiny_model(root / model_id, seed=k)
        print(f"made {args.models} tiny models in {root}")

        # -------------------------------------------------------------- 2. one service for all
        t0 = time.perf_counter()
        svc = await Scorer.options(num_replicas=args.replicas, max_models=args.max_models).as_service(root=str(root))
        print(
            f"service up: {args.replicas} replicas x at most {args.max_models} models ({time.perf_counter() - t0:.1f}s)"
        )
        try:
            # ---------------------------------------------------------- 3-4. served by the named model
            probe: Request = ("371=", "173")
            served = await asyncio.gather(*(svc.score.route(probe, model_id=m) for m in model_ids))
            for model_id, got in zip(model_ids, served):
                want = score(*load_checkpoint(root / model_id), [probe])[0]
                assert abs(got - want) < 1e-4, f"{model_id}: the service said {got}, the model says {want}"
            print(
                "each model's score of "
                + repr(probe)
                + ": "
                + ", ".join(f"{m} {s:.3f}" for m, s in zip(model_ids, served))
            )

            # ---------------------------------------------------------- 5. a Zipf stream of requests
            rng = random.Random(0)
            weights = [1 / (k + 1) ** args.zipf for k in range(args.models)]
            task = ToyTask(seed=1)
            stream = [
                ((task[i].text, task[i].answer), rng.choices(model_ids, weights)[0]) for i in range(args.requests)
            ]
            todo = iter(stream)

            async def client() -> None:
                for request, model_id in todo:
                    await svc.score.route(request, model_id=model_id)

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.clients)))
            elapsed = time.perf_counter() - t0
            m = svc.metrics()["models"]
        finally:
            await svc.shutdown()

    print(
        f"\n{args.requests} requests over {args.models} models in {elapsed:.1f}s ({args.requests / elapsed:.0f}/s), "
        f"after {args.models} check requests"
    )
    print(
        f"loads {m['loads']}, evictions {m['evictions']}, hits {m['hits']} "
        f"(hit rate {m['hit_rate']:.2f}), mean load {m['mean_load_s'] * 1e3:.0f} ms"
    )
    print(f"{'model':10s} {'requests':>8s} {'loads':>6s} {'batches':>8s} {'mean batch':>10s}")
    for model_id in model_ids:
        p = m["per_model"].get(model_id, {"requests": 0, "loads": 0, "batches": 0, "mean_batch_size": 0.0})
        print(f"{model_id:10s} {p['requests']:8d} {p['loads']:6d} {p['batches']:8d} {p['mean_batch_size']:10.1f}")


if __name__ == "__main__":
    quiet_monarch()
    asyncio.run(main())
