"""Check forge's trainer-side GPU paths on any CUDA machine, with torch and transformers only.

No Monarch, vLLM or config: copy the repository to a GPU machine with torch and transformers
installed and run it (a few minutes at most; the model is made in memory, nothing downloaded):

    python scripts/gpu_check.py                    # every visible GPU, NCCL
    python scripts/gpu_check.py --world-size 1     # one GPU
    python scripts/gpu_check.py --allow-cpu        # the same checks on CPU with gloo (no GPU here)

It checks, and prints as ONE JSON line (exit code 0 if every check passed, 1 if one failed,
2 if no CUDA device is visible and --allow-cpu was not given):

- ``fsdp_step``: one GRPO trainer step with FSDP2 (``fully_shard`` per decoder layer, then the
  root) over NCCL across the ranks, each rank on its slice of the batch, global grad-norm
  clipping, AdamW; its updated weights against the same step taken unsharded on one device.
- ``logprobs``: forge's trainer logprobs (``forge.models.logprobs``: decoder hidden states,
  head in chunks) against a plain Hugging Face forward (``log_softmax(logits / T)``), in fp32
  and in bf16, plus how far bf16 is from fp32.
- ``grpo_backward``: ``forge.losses.grpo_loss`` and its backward on the device: finite loss,
  finite non-zero gradient, ratio 1 when the behaviour logprobs are the trainer's own.
- ``publish``: the full state dict copied to CPU, in bytes per second: from one device's
  module, and gathered from the FSDP2 shards (what the trainer does to publish weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

try:
    from forge.losses.grpo import grpo_loss
    from forge.models.logprobs import padded_token_logprobs
except ImportError:  # a copy of the repository that is not installed: import it from here
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from forge.losses.grpo import grpo_loss
    from forge.models.logprobs import padded_token_logprobs

SIZES: dict[str, dict[str, int]] = {
    # ~0.25 B parameters with Qwen3's vocabulary: big enough for real kernels and a real publish.
    "small": {"hidden_size": 1024, "num_layers": 8, "vocab_size": 151_936, "batch": 8, "prompt": 64, "response": 192},
    # Seconds on a CPU (the --allow-cpu run).
    "tiny": {"hidden_size": 64, "num_layers": 2, "vocab_size": 512, "batch": 4, "prompt": 8, "response": 8},
}

LR = 1e-3
TOLERANCE = {
    # fp32: sharded and unsharded steps differ only in reduction order. As a share of the learning
    # rate, the most one AdamW step moves a weight (see compare_first_steps).
    "fsdp_weights_per_lr": 1e-3,
    "logprobs_fp32": 1e-4,
    "logprobs_bf16": 0.125,  # bf16 logits have ~3 significant digits; the two paths shape matmuls differently
}
TEMPERATURE = 0.7
SEED = 0


# ----------------------------------------------------------------------------- model and batch
def make_model(size: dict[str, int], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random-init Qwen3 of ``size`` (the same weights for the same seed)."""
    heads = size["hidden_size"] // 64
    config = transformers.Qwen3Config(
        hidden_size=size["hidden_size"],
        intermediate_size=3 * size["hidden_size"],
        num_hidden_layers=size["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        vocab_size=size["vocab_size"],
        max_position_embeddings=size["prompt"] + size["response"],
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype)


def make_batch(size: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids, a response mask, advantages and behaviour/ref offsets."""
    g = torch.Generator().manual_seed(SEED)
    b, p, r = size["batch"], size["prompt"], size["response"]
    ids = torch.randint(0, size["vocab_size"], (b, p + r), generator=g)
    lengths = torch.randint(r // 2, r + 1, (b,), generator=g)  # responses of different lengths
    attention = torch.ones(b, p + r, dtype=torch.long)
    response = torch.zeros(b, p + r - 1, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        attention[i, p + n :] = 0
        response[i, p - 1 : p - 1 + n] = True
    return {
        "input_ids": ids.to(device),
        "attention_mask": attention.to(device),
        "mask": response.to(device),
        "advantages": torch.randn(b, generator=g).to(device),
        "noise": (0.05 * torch.randn(b, p + r - 1, generator=g)).to(device),
    }


def loss_of(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], rows: slice = slice(None), on_policy: bool = False
) -> tuple:
    """forge's GRPO loss of ``batch[rows]`` under ``model``: (loss, stats). The behaviour
    logprobs are the model's own (``on_policy``: ratio 1) or off by the batch's noise."""
    ids, attn, mask = batch["input_ids"][rows], batch["attention_mask"][rows], batch["mask"][rows]
    lp = padded_token_logprobs(model, ids, attn, TEMPERATURE, positions=mask)
    noise = batch["noise"][rows]
    behaviour = lp.detach() if on_policy else lp.detach() + noise
    return grpo_loss(lp, behaviour, lp.detach() - noise, batch["advantages"][rows], mask, clip_eps=0.2, beta=0.04)


def plain_hf_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``log_softmax(logits / T)`` of every next token from a plain Hugging Face forward."""
    attn = batch["attention_mask"]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=attn, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- single-device checks
def check_logprobs(size: dict[str, int], device: torch.device) -> dict[str, Any]:
    """forge's trainer logprobs against a plain HF forward, fp32 and bf16."""
    batch = make_batch(size, device)
    mask = batch["mask"]
    out: dict[str, Any] = {}
    per_dtype = {}
    with torch.no_grad():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = make_model(size, device, dtype)
            trainer = padded_token_logprobs(
                model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, positions=mask
            )
            plain = plain_hf_logprobs(model, batch)
            per_dtype[name] = trainer[mask]
            out[f"{name}_max_abs_diff"] = float((trainer[mask] - plain[mask]).abs().max())
            del model
    out["bf16_vs_fp32_max_abs_diff"] = float((per_dtype["bf16"] - per_dtype["fp32"]).abs().max())
    out["ok"] = (
        out["fp32_max_abs_diff"] <= TOLERANCE["logprobs_fp32"]
        and out["bf16_max_abs_diff"] <= TOLERANCE["logprobs_bf16"]
    )
    return out


def check_grpo_backward(size: dict[str, int], device: torch.device) -> dict[str, Any]:
    """The GRPO loss and its backward on ``device``, and the state-dict copy rate to CPU."""
    model = make_model(size, device)
    batch = make_batch(size, device)
    loss, stats = loss_of(model, batch, on_policy=True)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    backward = {
        "loss": float(loss),
        "grad_norm": grad_norm,
        "ratio_mean": float(stats["ratio_mean"]),
        "ok": bool(torch.isfinite(loss))
        and 0 < grad_norm < float("inf")
        and abs(float(stats["ratio_mean"]) - 1) < 1e-5,
    }
    sync(device)
    t0 = time.perf_counter()
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    seconds = time.perf_counter() - t0
    publish = {"bytes": state_bytes(state), "seconds": seconds, "bytes_per_s": state_bytes(state) / seconds}
    return {"grpo_backward": backward, "publish_one_device": publish}


# ----------------------------------------------------------------------------- the FSDP2 step
def fsdp_rank(rank: int, world: int, backend: str, size: dict[str, int], init_file: str, out_dir: str) -> None:
    """One rank of the sharded step (``torch.multiprocessing.spawn`` target); writes its result."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    result: dict[str, Any] = {"rank": rank}
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # A file rendezvous: no TCP store listening on every interface of the machine.
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        model = make_model(size, device)
        reference = copy.deepcopy(model) if rank == 0 else None
        batch = make_batch(size, device)
        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        share = size["batch"] // world
        sync(device)
        t0 = time.perf_counter()
        # Each rank's loss is the mean over its slice; FSDP2 averages the gradients over ranks,
        # which is the gradient of the mean over the whole batch (equal slices).
        loss, _ = loss_of(model, batch, slice(rank * share, (rank + 1) * share))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        sync(device)
        result["step_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        result["publish_s"] = time.perf_counter() - t0
        local = sum(p.to_local().numel() for p in model.parameters())
        result["param_share"] = local / sum(p.numel() for p in model.parameters())
        if rank == 0:
            result["publish_bytes"] = state_bytes(full)
            initial = {k: v.detach().cpu().float().clone() for k, v in reference.state_dict().items()}
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
            ref_loss, _ = loss_of(reference, batch)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_state = {k: v.detach().cpu().float() for k, v in reference.state_dict().items()}
            result.update(compare_first_steps({k: v.float() for k, v in full.items()}, ref_state, initial))
            result["grad_norm"], result["ref_grad_norm"] = float(grad_norm), float(ref_norm)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # reported in the JSON line, naming the rank
        result["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"[:1000]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def compare_first_steps(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> dict[str, float]:
    """How far two first AdamW steps from ``initial`` land apart, as a share of the learning rate.

    A first AdamW step moves each weight by lr * g / (|g| + eps). Where |g| is float noise (a
    k_proj bias's gradient is 0 in exact arithmetic: softmax ignores a shift of every score), the
    share of lr it moves follows that noise, which differs with the reduction order. Those weights,
    the ones the reference moved by less than 0.99 lr, are left out and counted; every other weight
    moved by the full lr, so a wrong gradient shows as a difference of up to 2 lr."""
    noisy = {k: (want[k] - initial[k]).abs() < 0.99 * LR for k in want}
    kept = [(got[k] - want[k])[~noisy[k]].abs() for k in want]
    diff = max((float(d.max()) for d in kept if d.numel()), default=0.0)
    left_out = sum(int(m.sum()) for m in noisy.values())
    return {
        "max_abs_weight_diff_per_lr": diff / LR,
        "noise_moved_fraction": left_out / max(1, sum(m.numel() for m in noisy.values())),
    }


def check_fsdp_step(size: dict[str, int], world: int, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="forge-gpu-check-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(fsdp_rank, args=(world, backend, size, init_file, tmp), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"ok": False, "backend": backend, "world_size": world, "errors": errors}
    main = ranks[0]
    publish_s = max(r["publish_s"] for r in ranks)
    out = {
        "backend": backend,
        "world_size": world,
        "step_s": max(r["step_s"] for r in ranks),
        "max_abs_weight_diff_per_lr": main["max_abs_weight_diff_per_lr"],
        "noise_moved_fraction": main["noise_moved_fraction"],
        "grad_norm": main["grad_norm"],
        "ref_grad_norm": main["ref_grad_norm"],
        "param_share_per_rank": [round(r["param_share"], 4) for r in ranks],
        "publish_gathered": {
            "bytes": main["publish_bytes"],
            "seconds": publish_s,
            "bytes_per_s": main["publish_bytes"] / publish_s,
        },
    }
    out["ok"] = (
        out["max_abs_weight_diff_per_lr"] <= TOLERANCE["fsdp_weights_per_lr"]
        and out["noise_moved_fraction"] <= 0.01
        and abs(out["grad_norm"] - out["ref_grad_norm"]) <= 1e-4 * max(1.0, out["ref_grad_norm"])
        and all(abs(s - 1 / world) < 0.1 for s in out["param_share_per_rank"])
    )
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the checks on CPU with gloo")
    parser.add_argument(
        "--world-size", type=int, default=None, help="FSDP2 ranks (default: the visible GPUs; 2 on CPU)"
    )
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: small on GPU)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        message = (
            f"no CUDA device is visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}); run this "
            "on a GPU machine, or pass --allow-cpu to run the same checks on CPU with gloo"
        )
        print(f"gpu_check: {message}", file=sys.stderr)
        print(json.dumps({"ok": False, "error": message}))
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    world = args.world_size or (torch.cuda.device_count() if cuda else 2)
    if world < 1 or (cuda and world > torch.cuda.device_count()):
        parser.error(f"--world-size must be between 1 and the {torch.cuda.device_count()} visible GPUs, got {world}")
    size = SIZES[args.size or ("small" if cuda else "tiny")]
    if size["batch"] % world:
        parser.error(f"--world-size ({world}) must divide the batch of {size['batch']} sequences")
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "size": args.size or ("small" if cuda else "tiny"),
    }
    checks: dict[str, Any] = {"logprobs": check_logprobs(size, device)}
    checks.update(check_grpo_backward(size, device))
    checks["fsdp_step"] = check_fsdp_step(size, world, "nccl" if cuda else "gloo")
    report["checks"] = checks
    report["publish_bytes_per_s"] = checks["publish_one_device"]["bytes_per_s"]
    report["ok"] = all(c.get("ok", True) for c in checks.values())
    report["elapsed_s"] = time.perf_counter() - t0
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
