"""FSDP2 under Lightning's ``ModelParallelStrategy`` (2 processes, gloo, CPU), one engine per rank.

    python tests/fsdp_sync_check.py MODEL_DIR OUT_DIR --mode frozen|lora
        [--fault gather|disk --fault-step N] [--steps S]

``fully_shard`` (each decoder layer, then the whole model) in ``configure_model``, on a mesh of
``data_parallel_size=2, tensor_parallel_size=1`` (the strategy's default would make a
tensor-parallel mesh of 2 and a data-parallel one of 1: nothing sharded). ``--mode frozen``:
the embeddings and the first layer are frozen; ``--mode lora``: PEFT LoRA on q_proj, v_proj and
gate_proj (a tied Qwen2 keeps its tied embedding frozen). The callback syncs every 2 steps and
builds each rank's engine from ``MODEL_DIR``.

At every push each rank records its engine's outputs, and rank 0 saves the trainer's full weights
(gathered by torch's own ``get_model_state_dict`` into an unsharded copy, LoRA merged by PEFT's
``merge_and_unload``) with Hugging Face's ``save_pretrained`` into ``OUT_DIR/ref-<step>``, a
model directory with ``MODEL_DIR``'s config: what a cold start must equal (built without the
callback's code). ``--fault`` breaks the sync of ``--fault-step``:

* ``gather`` (a mock: a rank failing between two gathers cannot be caused for real from a test):
  on rank 1, preparing the third gathered tensor raises;
* ``disk`` (real): rank 0, the writer, gets ``RLIMIT_FSIZE`` below the checkpoint's size, so the
  kernel refuses the write past it (EFBIG) in the middle of the stream.

Each rank writes ``OUT_DIR/rank<r>.json``: its pushes, and for a fault what it raised, when, and
what its engine serves afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import signal
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # each rank's engine core in its own process

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from helpers import ENGINE_KWARGS, PushWatcher, greedy, model_dir_saved_by_hf  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync  # noqa: E402

LORA_TARGETS = ["q_proj", "v_proj", "gate_proj"]


class ShardedPolicy(pl.LightningModule):
    def __init__(self, model_dir: str, mode: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if mode == "frozen":
            for name, p in self.model.named_parameters():
                p.requires_grad_(not name.startswith(("model.embed_tokens.", "model.layers.0.")))
        else:
            import peft

            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
            self.model = peft.get_peft_model(self.model, config)
        self.plain = [copy.deepcopy(self.model)]  # unsharded, out of the module's tree

    def decoder_layers(self) -> list[torch.nn.Module]:
        inner = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
        return list(inner.model.layers)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.decoder_layers():
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    def train_dataloader(self):
        data = torch.randint(4, 500, (64, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def full_model(module: ShardedPolicy) -> torch.nn.Module | None:
    """Every rank calls (a collective); rank 0 gets the unsharded Hugging Face model holding the
    trainer's full weights (LoRA merged), the others None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module.model, options=options)
    if not state:
        return None
    plain = module.plain[0]
    plain.load_state_dict(state)
    if hasattr(plain, "peft_config"):
        plain = copy.deepcopy(plain).merge_and_unload()
    return plain


class Recorder(PushWatcher):
    """After the sync callback: each push, seen by every rank."""

    def __init__(self, sync: VLLMWeightSync, model_dir: Path, out: Path) -> None:
        super().__init__(sync)
        self.model_dir, self.out = model_dir, out

    def seen(self, trainer, pl_module, record: dict) -> dict:
        model = full_model(pl_module)
        if model is not None:
            model_dir_saved_by_hf(self.model_dir, model, self.out / f"ref-{record['step']}")
        engine = pl_module.vllm_engine
        return {
            "step": record["step"],
            "partial": record["partial"],
            "checkpoint": record["checkpoint"],
            "version": engine.version,
            "greedy": greedy(engine),
        }


class Fault(pl.Callback):
    """Before the sync callback: breaks the sync of ``step``; records how every rank ends."""

    def __init__(self, kind: str, step: int) -> None:
        self.kind, self.step = kind, step
        self.report: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.kind == "gather" and trainer.global_rank == 1:
            self._break_third_gather()
        if self.kind == "disk" and trainer.global_rank == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death
            limit = 256 * 1024  # the tiny checkpoints are megabytes
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            self.report["fault_at"] = time.time()

    def _break_third_gather(self) -> None:
        # MOCK: a rank failing between two gathers of one sync; raising in the gatherer's local
        # preparation step is the only way to cause it from a test.
        from weight_bridge.sync import gather

        real = gather.Gatherer._prepare
        calls = []

        def failing(t, writers):
            calls.append(1)
            if len(calls) == 3:
                self.report["fault_at"] = time.time()
                raise RuntimeError("injected fault on rank 1 mid-gather")
            return real(t, writers)

        gather.Gatherer._prepare = staticmethod(failing)  # type: ignore[method-assign]

    def on_exception(self, trainer, pl_module, exception):
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        engine = pl_module.vllm_engine  # still alive: this runs before the sync's own hook
        sync_dir = Path(engine.served_checkpoints[0]).parent
        self.report.update(
            raised_at=time.time(),
            error=f"{type(exception).__name__}: {exception}",
            version=engine.version,
            greedy=greedy(engine),
            files=sorted(p.name for p in sync_dir.iterdir()),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=["frozen", "lora"], required=True)
    parser.add_argument("--fault", choices=["gather", "disk"], default=None)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    sync = VLLMWeightSync(
        engine=EngineSpec(
            model=args.model, options={"engine_args": {**ENGINE_KWARGS, "max_num_seqs": 4}}
        ),
        source="model",
        schedule=Schedule(every_n_train_steps=2),
        files=CheckpointFiles(dirpath=str(args.out / "sync"), keep_last_k=10),
    )
    recorder = Recorder(sync, Path(args.model), args.out)
    fault = Fault(args.fault or "", args.fault_step)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[fault, sync, recorder],
    )
    try:
        trainer.fit(ShardedPolicy(args.model, args.mode))
    except Exception:
        traceback.print_exc()
    result = {"rank": trainer.global_rank, "pushes": recorder.pushes, "fault": fault.report}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()  # both ranks' files are written when rank 0 exits
    print(f"rank {trainer.global_rank} done", flush=True)


if __name__ == "__main__":
    main()
