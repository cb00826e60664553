"""Lightning DDP (2 processes, gloo, CPU), each rank with its own colocated engine.

    python tests/ddp_sync_check.py MODEL_DIR CHECKPOINT_DIR [--fail-rank R]
    NODE_RANK=k MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/ddp_sync_check.py ... --nodes 2

Global rank zero writes one checkpoint per sync, every rank waits for it and pushes its own
engine (as in data-parallel rollouts). Each rank prints ``RESULT {json}``: its engine's version,
the checkpoint it serves and its greedy outputs. ``--fail-rank`` kills that rank's engine-core
process after the first push, to show the other rank is not left hanging. ``--nodes 2`` (one
process per simulated node) uses the multi-node layout: each node writes and reads its own copy.
``--weights PATH``: global rank zero saves the weights it trained there at the end (with deltas,
the default, the last sync's file holds only what changed).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Each rank's engine runs its own engine-core process, so vLLM's distributed setup never meets
# the trainer's process group.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # even under pytest, which sets 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("dirpath")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--nodes", type=int, default=1, help="simulated nodes, one process each (NODE_RANK set)"
    )
    parser.add_argument("--weights", help="global rank 0 saves its trained weights here")
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch
    from helpers import ENGINE_KWARGS, greedy
    from transformers import AutoModelForCausalLM

    from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync
    from weight_bridge.checkpoint import save_checkpoint

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

        def training_step(self, batch, batch_idx):
            ids = batch[0]
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            data = torch.randint(4, 500, (64, 16), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)

    sync = VLLMWeightSync(
        engine=EngineSpec(
            model=args.model, options={"engine_args": {**ENGINE_KWARGS, "max_num_seqs": 4}}
        ),
        schedule=Schedule(every_n_train_steps=2, delta="on"),  # deltas on a disk: pinned
        files=CheckpointFiles(dirpath=args.dirpath, keep_last_k=10, node_local=args.nodes > 1),
    )
    result: dict = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank == args.fail_rank:
                # A real fault: this rank's engine-core process dies after the first push.
                import signal

                import psutil

                killed = []
                for child in psutil.Process().children(recursive=True):
                    if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
                        os.kill(child.pid, signal.SIGKILL)
                        killed.append(child.pid)
                print(f"rank {trainer.global_rank} killed engine core {killed}", flush=True)

        def on_train_end(self, trainer, pl_module):
            if args.weights and trainer.global_rank == 0:
                state = pl_module.model.state_dict()
                save_checkpoint({n: t.detach().clone() for n, t in state.items()}, args.weights)
            engine = pl_module.vllm_engine
            result.update(
                rank=trainer.global_rank,
                version=engine.version,
                checkpoint=engine.checkpoint,
                greedy=greedy(engine),
            )

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if args.nodes == 1 else 1,
        num_nodes=args.nodes,
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[sync, Probe()],
    )
    trainer.fit(Policy())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
