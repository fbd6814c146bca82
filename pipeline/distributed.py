"""Several processes, one round: the ranks of an `accelerate launch` (torch.distributed) job.

A round's trajectories are split over the ranks in contiguous shards (`shard`); what needs the
whole round (group statistics, metrics) is gathered; the LoRA gradients of every minibatch are
summed over the ranks before the optimizer step (`sum_gradients`), so N processes train the
algorithm one process trains, to float rounding, whatever N is. A single process (no
`WORLD_SIZE` > 1 in its environment) never touches torch.distributed.

The process group comes from accelerate (`PartialState`): gloo on CPU, nccl on GPUs, set up
from the environment `accelerate launch` (or torchrun) gives each process.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.config import CreditflowError

#: What a rank that stops because another one did tells the user (their one line).
RESUME = "the rounds checkpointed so far are kept; rerun the same command to resume"


class RankLost(CreditflowError):
    """Another rank of the job is gone (crashed, killed, out of memory): this one stops too."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: rank `index` of `count`."""

    index: int = 0
    count: int = 1

    @property
    def is_main(self) -> bool:
        """The rank that writes what exists once per round (checkpoints, manifests, metrics)."""
        return self.index == 0

    @property
    def distributed(self) -> bool:
        return self.count > 1


SINGLE = Ranks()


def current() -> Ranks:
    """The ranks of this job: `SINGLE` unless launched as several processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return SINGLE
    from accelerate import PartialState

    # accelerate picks multi-CPU (gloo) only when asked for the CPU; nccl where GPUs exist
    state = PartialState(cpu=not torch.cuda.is_available())
    return Ranks(state.process_index, state.num_processes)


def module_command(processes: int, module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command that runs `python -m module args` as `processes` ranks on this machine
    (`accelerate launch` on a free port; a plain process when 1), and its environment: this
    one's, minus any rank variables it was itself launched with, at one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m"]
    if processes > 1:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command += [
            "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), "--module",
        ]  # fmt: skip
    return [*command, module, *args], env


def shard(n: int, ranks: Ranks) -> slice:
    """The rows of an n-row batch that rank `ranks.index` holds: contiguous, in rank order,
    sizes differing by at most one (the first n % count ranks hold one row more)."""
    base, extra = divmod(n, ranks.count)
    start = ranks.index * base + min(ranks.index, extra)
    return slice(start, start + base + int(ranks.index < extra))


_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


@contextmanager
def _together() -> Iterator[None]:
    """A collective call: a peer that vanished mid-call (gloo/nccl raise RuntimeError) becomes
    one line instead of a backend traceback from every surviving rank."""
    try:
        yield
    except RuntimeError as exc:
        # gloo: "[.../pair.cc:553] Connection closed by peer [ip]:port. This is typically ..."
        cause = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip()).split(". ")[0]
        raise RankLost(f"another rank of this job is gone ({cause}): {RESUME}") from exc


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a tensor on `device` must be to take part in a collective of `backend`: nccl
    reduces GPU tensors only (this rank's current GPU), gloo reduces them where they are."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else device


def all_reduce(values: Tensor, ranks: Ranks, op: str = "sum") -> Tensor:
    """`values` reduced elementwise over the ranks with `op` (sum | min | max), in place.
    CPU tensors (counters, metrics) make a round trip through the GPU under nccl."""
    if ranks.distributed:
        import torch.distributed as dist

        moved = values.to(collective_device(dist.get_backend(), values.device))
        with _together():
            dist.all_reduce(moved, op=getattr(dist.ReduceOp, _OPS[op]))
        if moved is not values:
            values.copy_(moved)
    return values


def gather_objects(value: object, ranks: Ranks) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if not ranks.distributed:
        return [value]
    import torch.distributed as dist

    gathered: list = [None] * ranks.count
    with _together():
        dist.all_gather_object(gathered, value)
    return gathered


def sum_gradients(params: list[torch.nn.Parameter], ranks: Ranks) -> None:
    """Sum each parameter's gradient over the ranks (one flat all-reduce). A rank without a
    gradient (no pairs of the minibatch, so no backward) contributes zeros."""
    if not ranks.distributed:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), ranks)
    for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(part.view_as(p))


def barrier(ranks: Ranks) -> None:
    """Wait until every rank is here (e.g. until the main rank has written a round's files)."""
    if ranks.distributed:
        import torch.distributed as dist

        with _together():
            dist.barrier()


def from_main(value: object, ranks: Ranks) -> object:
    """The main rank's `value` on every rank (what it alone computed or read)."""
    if not ranks.distributed:
        return value
    import torch.distributed as dist

    box = [value if ranks.is_main else None]
    with _together():
        dist.broadcast_object_list(box, src=0)
    return box[0]
