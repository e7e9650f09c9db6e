"""Launching Gloo ranks on localhost for the distributed tests: one place for ports, process
start-up and collecting each rank's result or traceback.

A worker is a module-level function ``worker(rank, port, out_dir, *args)`` (spawned processes
import it by name). It calls :func:`init_gloo`, runs inside :func:`reporting_errors` so a failure
leaves ``rank{r}.err`` with its traceback, and saves its result to ``rank{r}.pt``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """Join a Gloo group of ``world`` ranks on localhost, one intra-op thread per rank."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kwargs)


@contextlib.contextmanager
def reporting_errors(rank: int, out_dir: str) -> Iterator[None]:
    """Write the traceback of anything raised in the block to ``rank{rank}.err``, then re-raise."""
    try:
        yield
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn(
    target: Callable[..., None], world: int, out_dir: Path, *args: Any, timeout_s: float = 150
) -> list[mp.Process]:
    """Start ``target(rank, port, out_dir, *args)`` on ranks 0..world-1, wait for each up to
    ``timeout_s`` and kill any that is still alive; returns the finished processes."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, str(out_dir), *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return procs


def run_ranks(
    target: Callable[..., None], world: int, out_dir: Path, *args: Any, timeout_s: float = 150
) -> list[Any]:
    """:func:`spawn`, then assert that no rank failed or aborted and load every ``rank{r}.pt``."""
    procs = spawn(target, world, out_dir, *args, timeout_s=timeout_s)
    errors = [f.read_text() for f in sorted(out_dir.glob("*.err"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world  # no abort inside the backend, no hang
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
