"""torch.distributed inside one actor mesh: rendezvous, FSDP2 sharding, full weights, rank-0 calls.

An SPMD role (the trainer, a sharded reference model) is ONE Monarch actor mesh whose N ranks run
torch.distributed together. Every rank gets the same call; the ranks split the work and run the
collectives; rank 0 answers for the mesh::

    class Trainer(ForgeActor):
        @endpoint
        async def setup(self):
            self.dist = await init_spmd()               # every rank, inside the actor
            self.model = shard_model(model, self.dist)  # FSDP2 per decoder layer

    stats = await call_spmd(trainer.train_step, batch)  # one call per step, whatever N is

The rendezvous goes through Monarch, not a launcher: rank 0 spawns Monarch's ``SPMDActor`` (the
actor behind ``monarch.spmd.setup_torch_elastic_env``) over the role's own proc mesh, which sets
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) in every rank's process;
each rank then joins the process group through a ``TCPStore`` at the address rank 0 handed out
(loopback when every rank is on rank 0's host). gloo on CPU, NCCL on CUDA.
A mesh of one rank makes no process group at all: the model stays a plain module, so a one-rank
trainer can also live in the controller's own process (tests do that).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import context, current_rank, current_size, endpoint
from monarch.spmd import SPMDActor

__all__ = ["SpmdRank", "call_spmd", "full_state_dict", "init_spmd", "local_state_bytes", "shard_model"]


@dataclass(frozen=True)
class SpmdRank:
    """Where this rank stands in its role's mesh."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    device: torch.device
    backend: str | None
    """``gloo``/``nccl``; None for a one-rank mesh (no process group)."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def where(self) -> str:
        return f"rank {self.rank} of {self.world_size} on host {self.host} (pid {os.getpid()})"


# Offers of (master address, port) that rank 0 sent to this process, by actor mesh name. They are
# written by the rendezvous actor and read by the role's actor: two actors of one process.
_offers: dict[str, tuple[str, int]] = {}
_offers_lock = threading.Lock()


class _Rendezvous(SPMDActor):
    """Monarch's SPMDActor (torchrun's env from the mesh coordinates), plus the hand-over of the
    master address to the role's actor living in the same process."""

    @endpoint
    def hostname(self) -> str:
        return socket.gethostname()

    @endpoint
    def offer(self, key: str, master_addr: str, master_port: int) -> None:
        self._setup_env(master_addr, master_port)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...
        with _offers_lock:
            _offers[key] = (master_addr, master_port)


async def init_spmd(backend: str | None = None, timeout_s: float = 300.0) -> SpmdRank:
    """Join the ranks of the calling actor's mesh into one process group; call it on every rank.

    ``backend`` None picks NCCL when CUDA is present, else gloo. Every wait is bounded by
    ``timeout_s``. A failed init raises ``RuntimeError`` naming the backend, this rank and host.
    """
    sizes = dict(current_size())
    world = math.prod(sizes.values()) if sizes else 1
    rank = current_rank().rank if sizes else 0
    local_rank = current_rank()[list(sizes)[-1]] if sizes else 0
    host = socket.gethostname()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world == 1:
        return SpmdRank(0, 1, 0, host, device, None)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    me = SpmdRank(rank, world, local_rank, host, device, backend)
    instance = context().actor_instance
    key = instance.name
    try:
        listen_fd = None
        if rank == 0:
            # Owned by this actor: it lives (and is stopped) with the role's processes.
            rendezvous = instance.proc_mesh.spawn(f"{key}-rendezvous", _Rendezvous)
            hosts = set((await asyncio.wait_for(rendezvous.hostname.call(), timeout_s)).values())
            # Every rank on this host: rendezvous over loopback, and the store listens there only
            # (torch's TCPStore binds every interface by itself). Across hosts it is reached by
            # the host name, which may resolve to another address elsewhere: it keeps torch's bind.
            master = "127.0.0.1" if hosts == {host} else host
            listen_fd, port = _listen_on(master) if master == "127.0.0.1" else (None, _free_port())
            await asyncio.wait_for(rendezvous.offer.call(key, master, port), timeout_s)
        addr, port = await _wait_for_offer(key, timeout_s)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group")
        if addr == "127.0.0.1":  # gloo's and NCCL's own sockets too, unless the user chose
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(var, _loopback_interface())
        store = dist.TCPStore(
            addr, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s), master_listen_fd=listen_fd
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RuntimeError(
            f"torch.distributed ({backend}) init failed on {me.where()}: {type(exc).__name__}: {exc}"
        ) from exc
    return me


async def _wait_for_offer(key: str, timeout_s: float) -> tuple[str, int]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        with _offers_lock:
            if key in _offers:
                return _offers.pop(key)
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"rank 0 sent no rendezvous address within {timeout_s:.0f}s")
        await asyncio.sleep(0.01)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _listen_on(address: str) -> tuple[int, int]:
    """A TCP socket listening on the IP ``address`` only (a free port): its file descriptor,
    handed over to the TCPStore that serves the rendezvous, and its port."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store owns the descriptor from now on


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def shutdown_spmd() -> None:
    """Leave the process group (a role's stop hook); a no-op without one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- sharding
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the classes a Hugging Face model names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}); "
            "FSDP2 needs one unit per layer"
        )
    return layers


def shard_model(model: torch.nn.Module, where: SpmdRank, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` on every decoder layer, then on the root (embeddings, norm, head).

    A no-op on a one-rank mesh. Gradients are reduced as sums, not means: each rank's loss is
    already its share of the global mean (see ``Trainer.train_step``). ``reshard_after_forward``
    False keeps a layer's gathered weights from its forward to its backward: one all-gather per
    layer and micro-batch instead of two, for the memory of the unsharded layers during a step.
    """
    if not where.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(where.device.type, (where.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def full_state_dict(model: torch.nn.Module, where: SpmdRank, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights as CPU tensors on rank 0 (one gather); ``{}`` on other ranks.

    ``trainable_only``: the parameters that require grad alone (a LoRA adapter), so only they are
    gathered. Every rank must call it (it is a collective when the model is sharded).
    """
    if not where.distributed:
        if trainable_only:
            return {k: p.detach().cpu() for k, p in model.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters and optimizer state this rank holds (its shards, for DTensors)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += local(value).numel() * value.element_size()
    return total


# ----------------------------------------------------------------------------- collectives
def all_reduce_sum(values: dict[str, float], where: SpmdRank) -> dict[str, float]:
    """Sum each value over the ranks (one all_reduce); unchanged on a one-rank mesh."""
    if not where.distributed or not values:
        return values
    names = sorted(values)
    t = torch.tensor([values[n] for n in names], dtype=torch.float64, device=where.device)
    dist.all_reduce(t)
    return dict(zip(names, t.tolist()))


def all_reduce_max(values: dict[str, float], where: SpmdRank) -> dict[str, float]:
    """The largest of each value over the ranks; unchanged on a one-rank mesh."""
    if not where.distributed or not values:
        return values
    names = sorted(values)
    t = torch.tensor([values[n] for n in names], dtype=torch.float64, device=where.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist()))


def gather_objects(obj: Any, where: SpmdRank) -> list[Any]:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not where.distributed:
        return [obj]
    out: list[Any] = [None] * where.world_size
    dist.all_gather_object(out, obj)
    return out


def map_shares(items: list[Any], fn: Callable[[list[Any]], list[Any]], where: SpmdRank) -> list[Any]:
    """``fn(items)`` with each rank computing a contiguous share, gathered in order on every rank:
    how a sharded replica (FSDP2) scores one batch. A rank left without items still runs ``fn``
    once, on ``items[:1]``, and drops the answer: the forward's all-gathers must pair up."""
    if not where.distributed:
        return fn(items)
    share = math.ceil(len(items) / where.world_size)
    lo = min(where.rank * share, len(items))
    hi = min(lo + share, len(items))
    if hi > lo:
        mine = fn(items[lo:hi])
    else:
        fn(items[:1])  # the stand-in pass; its answer is dropped
        mine = []
    return [x for part in gather_objects(mine, where) for x in part]


def broadcast_object(obj: Any, where: SpmdRank) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not where.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def side_group(where: SpmdRank) -> Any:
    """A second gloo process group of every rank, for collectives that run in a background
    thread (a checkpoint's write) while training runs its own on the default group; None for a
    one-rank mesh. Every rank must call it, at the same point."""
    if not where.distributed:
        return None
    return dist.new_group(backend="gloo")


def barrier(where: SpmdRank) -> None:
    if where.distributed:
        dist.barrier()


# ----------------------------------------------------------------------------- the controller side
async def call_spmd(endpoint_: Any, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """Call ``endpoint_`` on every rank of an SPMD actor mesh and return rank 0's result.

    The one call per step that the controller makes, whatever the mesh's size: every rank must
    get the call because every rank takes part in its collectives. A rank's error or process
    death fails the call (Monarch's supervision); ``timeout_s`` also bounds the wait.
    """
    values = await asyncio.wait_for(_awaited(endpoint_.call(*args, **kwargs)), timeout_s)
    for point, value in values.items():
        if point.rank == 0:
            return value
    raise RuntimeError(f"no rank 0 among the {len(values)} replies")  # a sliced mesh without rank 0


async def _awaited(future: Any) -> Any:
    return await future
