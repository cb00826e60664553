"""An FSDP2 trainer's push into the engine in its ranks holds one tensor at a time, not the model.

    python -m torch.distributed.run --nproc_per_node=2 tests/ranks_memory_check.py MODEL OUT

Two ranks, a real Lightning ``Trainer`` (FSDP2 through ``ModelParallelStrategy``: ``fully_shard``
on each decoder layer and the model) with ``VLLMWeightSync(engine=EngineSpec(model,
mode="ranks"))``, a complete sync every step. Each sync runs between two callbacks of the same
trainer: the first starts sampling the bytes this process's allocator holds for live
allocations (glibc's ``mallinfo2``: heap in use plus mapped chunks, every 0.2 ms), the second
stops it: the sync's peak extra memory is the highest sample less the first. Not the resident
set: in a process running vLLM, glibc serves these sizes from its heap and keeps freed pages
resident, so the resident set only shows a sync's first allocations, not what it holds. The
first sync also allocates the engine's host store (the rollback source: one copy of the rank's
shard, in host memory, kept for the run); the later ones hold only the tensors in flight. Each
rank writes ``OUT/memory{rank}.json``: every sync's peak extra bytes, the store's, the largest
tensor and the model's bytes (that each push equals a cold start is ``ranks_sync_check.py``'s).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the external launcher's condition


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _held() -> int:
    """Bytes glibc's allocator holds for live allocations (heap in use, mapped chunks)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class Sampler:
    """The highest :func:`_held` from :meth:`start` to :meth:`stop`, less the first."""

    def start(self) -> None:
        self.first = self.peak = _held()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _held())
            time.sleep(0.0002)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, _held()) - self.first


def main() -> None:
    import lightning.pytorch as pl
    import torch
    from helpers import ENGINE_KWARGS
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers import AutoModelForCausalLM

    from callbacks import EngineSpec, Schedule, VLLMWeightSync

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    options = {"cpu_threads_bind": "0|1", "engine_args": dict(ENGINE_KWARGS, max_num_seqs=4)}
    peaks: list[int] = []
    stored: list[int] = []

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            data = torch.randint(4, 500, (16, 8), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)

    sampler = Sampler()

    class Before(pl.Callback):  # runs before the sync's hook (the callbacks' order)
        def on_train_start(self, trainer, pl_module):
            sampler.start()

        def on_train_batch_end(self, trainer, pl_module, *unused):
            sampler.start()

    class After(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            peaks.append(sampler.stop())

        def on_train_batch_end(self, trainer, pl_module, *unused):
            peaks.append(sampler.stop())

        def on_train_end(self, trainer, pl_module):
            stored.append(store(pl_module.vllm_engine))

    before = Before()
    sync = VLLMWeightSync(
        engine=EngineSpec(model=str(model_dir), mode="ranks", options=options),
        schedule=Schedule(every_n_train_steps=1),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[before, sync, After()],
    )
    policy = Policy()
    sizes = [p.numel() * p.element_size() for p in policy.model.parameters()]
    trainer.fit(policy)
    report = {"peaks": peaks, "largest": max(sizes), "model": sum(sizes), "store": stored[0]}
    (out / f"memory{rank}.json").write_text(json.dumps(report))


def store(engine) -> int:
    """The bytes of this rank's host store (the rollback source of a push from memory)."""
    from weight_bridge.vllm.internals.model import transfer_engine

    def nbytes(worker) -> int:
        return transfer_engine(worker).transaction.store.nbytes

    return engine.llm.collective_rpc(nbytes)[0]


if __name__ == "__main__":
    main()
