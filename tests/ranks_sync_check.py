"""The engine inside the trainer's ranks: Lightning on two ranks, vLLM tensor-parallel over them.

    python -m torch.distributed.run --nproc_per_node=2 tests/ranks_sync_check.py MODEL OUT \
        [--strategy ddp|fsdp] [--lora] [--files]

Each rank runs a real ``Trainer`` (DDP, or FSDP2 through ``ModelParallelStrategy``) with
``VLLMWeightSync(engine=EngineSpec(model, mode="ranks"))``: one ``vllm.LLM`` per rank, started
with vLLM's external launcher on the trainer's own process group (TP=2), pushed every step from
the live tensors (the embeddings are frozen, or with ``--lora`` the whole base: the syncs after
the first are partial; LoRA merged by the callback). After each
sync each rank records its engine's greedy tokens and logprobs; rank 0 saves the trainer's full
weights as a model directory. At the end of training, two faults on the same engine:

* ``refused``: rank 1 pushes a tensor holding NaN where it writes, rank 0 good tensors: both
  refuse, nothing written, the label unchanged; the same for a tensor of the wrong shape on
  rank 1 (``wrong_shape``) and a partial push on a stale base on rank 1 (``stale_base``);
* ``wrong_produced``: rank 1 publishes a tensor that produces a row where it declares a
  matrix: refused by name mid-write, both rolled back, the weights bit for bit as before;
* ``after_commit``: rank 1's refresh of derived state raises (FAULT INJECTION:
  ``tests/faults.py``, a fault no real push can be made to hit on demand) after
  rank 0 committed: both roll back (rank 1 from its writer's pre-images, rank 0 from its undo
  log), the label unchanged; the same for a partial push (``partial_after_commit``), and for
  rank 1's loader raising mid-write (``fault_raise``), writing a wrong value that its read-back
  finds (``fault_clobber``) and its engine core's prefix-cache reset raising (``fault_cache``),
  each for a complete and a partial push (``fault_raise_partial``, ...), all FAULT INJECTION
  (:func:`helpers.arm_fault`, :func:`helpers.arm_cache_fault`).

Under FSDP2 those pushes send the trainer's DTensors themselves (``fully_shard`` on the
data-parallel mesh: each rank holds half the rows), streamed: validated from each rank's local
shard, each tensor gathered only when the engine's loader asks for it; so the fault matrix also
proves that a rank stopping mid-stream stops the other at the same tensor, none waiting in a
gather.

Then, with the trainer's engine closed, a cold TP=2 engine (the same external launcher) on each
saved directory generates the reference. Each rank writes ``OUT/rank{r}.json``. ``--files``:
the run also asks for files (``CheckpointFiles(dirpath=OUT/checkpoints, keep_last_k=2)``):
each sync saves a complete checkpoint there, besides its push from memory.

Two "nodes" of one process each (``torchrun --nnodes=2 --nproc_per_node=1 --node_rank=K`` on
the loopback): one engine per node (TP=1, vLLM's data parallel across the nodes), the same
checks.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
from functools import partial
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the external launcher's condition


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA on q_proj and v_proj")
    parser.add_argument("--files", action="store_true", help="files asked for: OUT/checkpoints")
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    fault = out / f"fault-rank{rank}"
    import faults

    os.environ[faults.FAULT_FILE_ENV] = str(fault)
    faults.register()  # this process is the engine's: its refresh raises while the file exists

    import lightning.pytorch as pl
    import torch
    from helpers import (
        ENGINE_KWARGS,
        FAULT_PARAM,
        PROMPTS,
        arm_cache_fault,
        arm_fault,
        greedy,
        model_dir_with,
        weights_digest,
    )
    from transformers import AutoModelForCausalLM

    from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync
    from weight_bridge import EngineUndefinedError  # noqa: F401 (an error a rank may raise)
    from weight_bridge.checkpoint.live import LiveCheckpoint, LiveTensor
    from weight_bridge.testing.parity import collect
    from weight_bridge.vllm.clients.ranks import RanksEngine

    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    # TP over a node's ranks, one core each; one engine per "node" (one process each) otherwise
    bind = "|".join(str(r) for r in range(per_node)) if per_node > 1 else str(rank)
    options = {"cpu_threads_bind": bind, "engine_args": dict(ENGINE_KWARGS, max_num_seqs=4)}
    engine_args = dict(options["engine_args"], cpu_threads_bind=bind)  # RanksEngine's keywords

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            self.model.get_input_embeddings().weight.requires_grad_(False)
            if args.lora:  # the base frozen: every sync after the first carries the merged targets
                import peft

                config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
                self.model = peft.get_peft_model(self.model, config)

        def configure_model(self) -> None:
            if args.strategy == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            ids = batch[0]
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

        def train_dataloader(self):
            data = torch.randint(4, 500, (64, 16), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)

    report: dict = {"rank": rank, "pushes": []}

    def full_state(pl_module) -> dict:
        if args.lora:  # PEFT's own merge, on a copy
            merged = copy.deepcopy(pl_module.model).merge_and_unload()
            return {n: t.detach().clone() for n, t in merged.state_dict().items()}
        state = pl_module.model.state_dict()
        if args.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)  # every rank: the full tensors
            state = get_model_state_dict(pl_module.model, options=opts)
        return {n: t.detach().clone() for n, t in state.items()}

    def pushed_state(pl_module, full: dict) -> dict:
        """What the fault pushes send: the full tensors, or under FSDP2 the trainer's own
        DTensors (streamed: each gathered only when the engine's loader asks for it)."""
        if args.strategy != "fsdp" or args.lora:
            return full
        return {n: t.detach() for n, t in pl_module.model.state_dict().items()}

    class Probe(pl.Callback):
        def _record(self, trainer, pl_module) -> None:
            engine = pl_module.vllm_engine
            step = trainer.global_step
            if report["pushes"] and report["pushes"][-1]["step"] == step:
                return
            state = full_state(pl_module)
            if rank == 0:
                model_dir_with(Path(args.model), state, out / f"ref-{step}")
            last = sync.history[-1]
            report["pushes"].append(
                {
                    "step": step,
                    "version": engine.version,
                    "partial": last["partial"],
                    "checkpoint": last["checkpoint"],
                    "greedy": greedy(engine),
                }
            )

        def on_train_start(self, trainer, pl_module):
            self._record(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, *unused):
            self._record(trainer, pl_module)

        def on_train_end(self, trainer, pl_module):
            self._record(trainer, pl_module)
            engine = pl_module.vllm_engine
            before = (engine.version, greedy(engine))
            full = full_state(pl_module)
            good = pushed_state(pl_module, full)  # FSDP2: its DTensors, gathered as written
            bad = dict(good)
            name = "model.layers.0.mlp.down_proj.weight"
            if rank == 1:  # in what this rank writes (its last column: TP=2 splits down_proj's
                bad[name] = bad[name].clone()  # columns) and holds (its local rows under FSDP2)
                local = bad[name].to_local() if hasattr(bad[name], "to_local") else bad[name]
                local.view(-1)[-1] = float("nan")
            report["refused"] = _attempt(lambda: engine.push_tensors(bad, version="bad"))
            report["after_refusal"] = (engine.version, greedy(engine)) == before
            # the other refusals a rank may meet alone: a tensor of a shape the engine does not
            # hold, a partial push on top of a version the engine does not serve
            wrong = dict(good)
            if rank == 1:
                wrong[name] = full[name][:, :-1]
            report["wrong_shape"] = _attempt(lambda: engine.push_tensors(wrong, version="bad"))
            part = {n: t for n, t in good.items() if ".mlp." in n}
            base = engine.version if rank == 0 else "1"
            push = lambda: engine.push_tensors(part, version="bad", base_version=base)  # noqa: E731
            report["stale_base"] = _attempt(push)
            report["after_other_refusals"] = (engine.version, greedy(engine)) == before
            # rank 1 alone: a live tensor that produces a row where it declares the matrix (the
            # write broadcast it into every row): refused by name mid-write, rolled back on both
            digest = engine.llm.collective_rpc(weights_digest)[0]
            produced = [LiveTensor.of(n, t) for n, t in good.items()]
            if rank == 1:
                t = good[FAULT_PARAM]
                row = LiveTensor(FAULT_PARAM, tuple(t.shape), t.dtype, [t], lambda s: s[0][:1])
                produced[list(good).index(FAULT_PARAM)] = row
            report["wrong_produced"] = _attempt(lambda: engine.push_tensors(produced, "bad"))
            same = engine.llm.collective_rpc(weights_digest)[0] == digest
            report["after_wrong_produced"] = same and (engine.version, greedy(engine)) == before
            if rank == 1:
                fault.touch()
            changed = {n: t + 0.01 for n, t in good.items()}
            report["after_commit"] = _attempt(lambda: engine.push_tensors(changed, version="x"))
            report["after_rollback"] = (engine.version, greedy(engine)) == before
            part = {n: t for n, t in changed.items() if ".mlp." in n}  # a partial push, too
            push = lambda: engine.push_tensors(part, version="y", base_version=engine.version)  # noqa: E731
            report["partial_after_commit"] = _attempt(push)
            fault.unlink(missing_ok=True)
            report["after_partial_rollback"] = (engine.version, greedy(engine)) == before
            # rank 1 alone: its loader raises mid-write, its read-back finds a wrong value, its
            # core's prefix-cache reset raises; a complete push and a partial one
            for kind, sent in itertools.product(("raise", "clobber", "cache"), (changed, part)):
                if rank == 1 and kind == "cache":
                    arm_cache_fault(engine)
                elif rank == 1:
                    engine.llm.collective_rpc(arm_fault, args=(FAULT_PARAM, kind))
                base = engine.version if sent is part else None
                key = f"{kind}_partial" if sent is part else kind
                report[f"fault_{key}"] = _attempt(partial(engine.push_tensors, sent, "x", base))
                report[f"after_fault_{key}"] = (engine.version, greedy(engine)) == before
            # the same source object pushed again: twice failing mid-write on rank 1 alone (its
            # loader raises), then landing. Each push's stream state is its own: under FSDP2 a
            # stale one from the first failure would leave rank 0 waiting in a gather.
            again = LiveCheckpoint.of(changed, {"version": "again"})
            for attempt in (1, 2):
                if rank == 1:
                    engine.llm.collective_rpc(arm_fault, args=(FAULT_PARAM, "raise"))
                report[f"reused_fault_{attempt}"] = _attempt(lambda: engine.push(again))
            report["reused_lands"] = _attempt(lambda: engine.push(again))
            report["after_reused"] = engine.version == "again"
            engine.push_tensors(good, version=before[0])  # back to what the checks below expect
            report["after_reused_back"] = (engine.version, greedy(engine)) == before
            # a tensor never materialised (on the meta device) on rank 1 alone: refused on both
            meta = dict(good)
            if rank == 1:
                meta[name] = torch.empty_like(full[name], device="meta")
            report["meta"] = _attempt(lambda: engine.push_tensors(meta, version="bad"))
            report["after_meta"] = (engine.version, greedy(engine)) == before
            report["matrix"] = _matrix(engine, rank, fault, good, changed, before[0])
            report["store_after_layerwise"] = _store_after_layerwise(engine, rank, out, good)
            # submit generates on the rank's own thread (another thread fails in vLLM's CPU
            # attention: the OpenMP thread count cpu_threads_bind set is that thread's)
            greedy_params = {"max_tokens": 12, "temperature": 0.0, "logprobs": 3}
            report["submitted"] = collect(engine.submit(PROMPTS, greedy_params).result())
            report["generated"] = greedy(engine)
            report["undefined"] = engine.undefined

    files = CheckpointFiles(dirpath=str(out / "checkpoints"), keep_last_k=2) if args.files else None
    sync = VLLMWeightSync(
        engine=EngineSpec(model=args.model, mode="ranks", options=options),
        schedule=Schedule(every_n_train_steps=1),
        files=files or CheckpointFiles(),
    )
    if args.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: object = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sync, Probe()],
    )
    trainer.fit(Policy())
    report["last_checkpoint"] = sync.last_checkpoint
    if args.files and rank == 0:  # the files asked for: complete, the newest kept, the weights
        from weight_bridge.checkpoint import CheckpointReader

        report["files"] = sorted(p.name for p in (out / "checkpoints").glob("*.safetensors"))
        last = report["pushes"][-1]["step"]
        with (
            CheckpointReader(sync.last_checkpoint) as saved,
            CheckpointReader(out / f"ref-{last}" / "model.safetensors") as ref,
        ):
            want = dict(ref.tensors())
            got = dict(saved.tensors())
            report["last_file_equal"] = got.keys() == want.keys() and all(
                torch.equal(got[n], want[n]) for n in want
            )
    # the reference: a cold TP=2 engine in the same ranks on each saved directory
    torch.distributed.barrier()
    report["cold"] = {}
    for push in report["pushes"]:
        cold = RanksEngine(out / f"ref-{push['step']}", **engine_args)
        report["cold"][str(push["step"])] = greedy(cold)
        cold.close()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def _matrix(engine, rank: int, fault: Path, good: dict, changed: dict, label: str) -> dict:
    """The fault matrix on one rank at a time (FAULT INJECTION, ``tests/faults.py``): every
    point the code has (the gather of a sharded tensor and the host store's copy in the
    background among them), every kind, a complete push from memory each; the
    kinds of a point strike rank 0 and rank 1 in turn, so every point strikes both. Each case
    ends on both ranks with the old weights under the old label, the new under the new, or
    undefined (nothing generated); never a rank waiting (the job's own deadline). A struck
    copy into the store is followed by a push whose write fails: it must restore the bits the
    engine holds, not the store's. Rank 0 repairs each."""
    import torch.distributed as dist
    from fault_matrix import after_failure
    from faults import KINDS, arm_file, fault_points
    from helpers import weights_digest

    from weight_bridge import EngineUndefinedError

    def state() -> tuple:
        try:
            got = engine.generate([[1, 20]], {"max_tokens": 1})[0].policy_version
        except EngineUndefinedError:
            got = None
        return got, engine.llm.collective_rpc(weights_digest)[0]

    def arm(*faults: tuple) -> bool:
        mine = [f for f in faults if f[2] == rank]  # each rank's process reads its own file
        if mine:
            arm_file(fault, *mine)
        dist.barrier()  # armed before either rank reaches a point
        return bool(mine)

    engine.push_tensors(changed, version="m")
    landed = state()
    engine.push_tensors(good, version=label)
    was = state()
    bad: list[str] = []
    fired: set[str] = set()  # the points that struck this rank (one never reached proves nothing)
    cases = 0
    for (i, point), (j, kind) in itertools.product(enumerate(fault_points()), enumerate(KINDS)):
        struck = (i + j) % 2
        first = [("prefix_reset", "refusal", struck)] if after_failure(point) else []
        armed = arm(*first, (point, kind, struck))
        result = _attempt(lambda: engine.push_tensors(changed, version="m"))
        if armed and point == "store_refresh":  # the copy runs in the background once it landed
            _gone(fault, timeout_s=10.0)
        if armed and not fault.exists():
            fired.add(point)
        fault.unlink(missing_ok=True)
        now = state()
        cases += 1
        failed = result["error"] is not None
        ok = (now == was and failed) or (now == landed and not failed)
        if not (ok or (now[0] is None and failed)):
            bad.append(f"{point} {kind} on rank {struck}: {result} -> {now[0]}")
        if point == "store_refresh" and now == landed:  # the next write fails on the other rank
            arm(("loader", kind, 1 - struck))
            result = _attempt(lambda: engine.push_tensors(good, version=label))
            fault.unlink(missing_ok=True)
            if result["error"] is None or state() != landed:
                bad.append(f"{point} {kind} on rank {struck}, then a failed write: {result}")
        engine.push_tensors(good, version=label)  # on every rank alike: back on the old weights
    return {"cases": cases, "bad": bad, "points": len(fault_points()), "fired": sorted(fired)}


def _store_after_layerwise(engine, rank: int, out: Path, good: dict) -> bool:
    """A push from memory, a file pushed by vLLM's layerwise reload (a writer that never uses
    the host store), then a push from memory whose write fails on rank 1 (FAULT INJECTION):
    both ranks end on the file's bits under its label, never the store's older ones."""
    import shutil

    import torch.distributed as dist
    from helpers import FAULT_PARAM, arm_fault, weights_digest

    engine.push_tensors(good, version="s1")
    engine.reload_mode = "layerwise"
    file = Path(engine.checkpoint_root) / f"layerwise-rank{rank}.safetensors"
    shutil.copyfile(out / "ref-0" / "model.safetensors", file)  # where the engine may read
    engine.push(file, version="s2")
    engine.reload_mode = "direct"
    landed = engine.version, engine.llm.collective_rpc(weights_digest)[0]
    if rank == 1:
        engine.llm.collective_rpc(arm_fault, args=(FAULT_PARAM, "raise"))
    dist.barrier()
    failed = _attempt(lambda: engine.push_tensors({n: t * 1.5 for n, t in good.items()}, "s3"))
    now = engine.version, engine.llm.collective_rpc(weights_digest)[0]
    engine.push_tensors(good, version=landed[0])  # as the other checks leave it: good's bits
    file.unlink()  # served no more; the files a sync saves are counted after this
    return failed["error"] is not None and now == landed and landed[0] == "s2"


def _gone(path: Path, timeout_s: float) -> None:
    """Until ``path`` is gone (a fault fired), at most ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _attempt(push) -> dict:
    try:
        push()
    except Exception as exc:  # the typed error each rank raises
        return {
            "error": type(exc).__name__,
            "message": str(exc)[:2000],
            "problems": dict(getattr(exc, "problems", {}) or {}),
        }
    return {"error": None}


if __name__ == "__main__":
    main()
