"""The gather of one sharded parameter onto the writers
(``weight_bridge.checkpoint.dtensor.ShardGather``), in two real gloo processes: the full tensor
on each writer, equal to the one that was sharded, for FSDP2's layout (rows split as
``torch.chunk`` splits them, uneven and empty shards included), a replicated tensor, and a
layout it leaves to ``full_tensor()``; with one writer and with one per rank (``node_local``).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [
    ((8, 3), "shard0"),
    ((5, 3), "shard0"),  # uneven: rows 3 + 2
    ((1, 4), "shard0"),  # rank 1's shard is empty
    ((5,), "shard0"),  # a bias
    ((4, 6), "replicate"),
    ((4, 6), "shard1"),  # not FSDP2's layout: full_tensor()
]


def _worker(rank: int, store: str, errors) -> None:
    try:  # a file rendezvous: no port another test's server can take in between
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        _check(rank)
        dist.barrier()  # both ranks are done with every collective
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    # The result is in the queue (a synchronous pipe write). Exit without running the process
    # group's C++ teardown: under a loaded machine it aborted once ("terminate called without
    # an active exception", SIGABRT) after the checks had passed, which says nothing of the
    # gather.
    os._exit(0)


def _check(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weight_bridge.checkpoint.dtensor import ShardGather

    mesh = init_device_mesh("cpu", (2,))
    placements = {"shard0": [Shard(0)], "replicate": [Replicate()], "shard1": [Shard(1)]}
    for i, (shape, layout) in enumerate(CASES):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        d = distribute_tensor(full, mesh, placements[layout])
        for writers in ([0], [0, 1]):
            gather = ShardGather(d, writers).prepare()
            assert gather.direct == (layout != "shard1"), (shape, layout)
            got = gather.run()
            if rank in writers:
                assert got is not None and torch.equal(got, full), (shape, layout, writers)
            else:
                assert got is None, (shape, layout, writers)


def test_shard_gather_matches_the_sharded_tensor(tmp_path) -> None:
    errors = mp.get_context("spawn").SimpleQueue()
    store = str(tmp_path / "rendezvous")
    mp.start_processes(_worker, args=(store, errors), nprocs=2, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)
