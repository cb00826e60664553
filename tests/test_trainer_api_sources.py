"""vLLM's trainer API (``WeightBridgeTrainer``) on each tested vLLM's own ``WeightSource``.

vLLM 0.32's source has a ``metadata()`` method and is iterated; 0.33+'s has a ``metadata``
property, ``iter_full()`` / ``iter_local()`` and ``ParamMeta.owners``. The trainer reads both
through one path (``weight_bridge.vllm.internals.sources``). Here, in a real in-process engine:

* vLLM's own ``ModuleSource`` (whichever the installed vLLM ships) over a Hugging Face model of
  B is sent, and the engine then equals a cold start on B (every tested vLLM);
* 0.33+: a source whose ``ParamMeta.owners`` leave tensors off rank 0 (a two-stage pipeline,
  as a real pipeline-parallel trainer declares it: the whole model in metadata, rank 0's half
  from ``iter_full``) is refused before anything is written, naming those tensors; the engine
  keeps its version and its outputs, and the same tensors left out on purpose
  (``names=``) are sent as a partial checkpoint.

No mocks: the sources are vLLM's own class, or a subclass of vLLM's ``WeightSource`` written
to its documented contract.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_parity, greedy

from weight_bridge.checkpoint import BASE_VERSION_KEY, CheckpointReader


def _installed_vllm() -> tuple[int, int]:
    import vllm

    major, minor = str(vllm.__version__).split(".")[:2]
    return int(major), int(minor)


needs_owners = pytest.mark.skipif(
    _installed_vllm() < (0, 33), reason="ParamMeta.owners and iter_full() came with vLLM 0.33"
)


def _sender(engine, directory: Path, source):
    """vLLM's trainer side as a user writes it: the factory, the bridge's init info, rank 0."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weight_bridge.vllm.clients.trainer_api import WeightBridgeTrainerInitInfo

    info = WeightBridgeTrainerInitInfo(directory=str(directory), rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=engine, source=source)


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.every_vllm
def test_vllms_own_module_source_sends_and_the_engine_equals_a_cold_start(
    models, cold, shared_engine, tmp_path
) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    a, b = models["qwen2_A"], models["qwen2_B"]
    engine = shared_engine("qwen2_A")
    engine.push(a / "model.safetensors", version="a")
    model = _hf_model(b)
    sender = _sender(engine, tmp_path / "ckpt", ModuleSource(model))
    sent = sender.send_weights(version="b")
    assert sent == tmp_path / "ckpt" / "step-00000001.safetensors"
    assert engine.version == "b" and sender.last_version == "b"
    assert_parity(greedy(engine), cold(b))
    # complete tensors, every one of the module's (the tied lm_head once, as Hugging Face)
    params = dict(model.named_parameters())
    with CheckpointReader(sent) as reader:
        written = {name: t.clone() for name, t in reader.tensors()}
    assert list(written) == list(params)
    assert all(torch.equal(written[n], p.detach()) for n, p in params.items())


def _two_stage_source(model: torch.nn.Module, later: set[str]):
    """A vLLM 0.33+ ``WeightSource`` as rank 0 of a two-stage pipeline sees it: metadata for
    the whole model (the same on both ranks), ``later`` owned by rank 1; ``iter_full`` yields
    what rank 0 owns, in metadata order."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TwoStageSource(WeightSource):
        @cached_property
        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(n, p.dtype, tuple(p.shape), owners=(1,) if n in later else (0,))
                for n, p in model.named_parameters()
            ]

        def iter_full(self):
            for name, param in model.named_parameters():
                if name not in later:
                    yield name, param

    return TwoStageSource()


@needs_owners
def test_tensors_rank_0_does_not_own_are_refused_by_name_and_nothing_is_written(
    models, shared_engine, tmp_path
) -> None:
    from weight_bridge.vllm.clients.trainer_api import IncompleteSourceError

    a, b = models["qwen2_A"], models["qwen2_B"]
    engine = shared_engine("qwen2_A")
    engine.push(a / "model.safetensors", version="a")
    before = greedy(engine)
    model = _hf_model(b)
    later = {
        n for n, _ in model.named_parameters() if n.startswith(("model.layers.1.", "model.norm"))
    }
    assert len(later) > 5
    directory = tmp_path / "ckpt"
    sender = _sender(engine, directory, _two_stage_source(model, later))

    with pytest.raises(IncompleteSourceError) as refused:
        sender.send_weights(version="never")
    assert set(refused.value.problems) == later
    message = str(refused.value)
    first = next(n for n, _ in model.named_parameters() if n in later)
    assert f"{first!r}" in message and "owned by trainer ranks [1] only" in message
    assert "Nothing was written or sent" in message and "iter_full()" in message
    assert "names=" in message
    assert not directory.exists() or not list(directory.iterdir())  # not even a temporary file
    assert engine.version == "a" and engine.served_checkpoints == [str(a / "model.safetensors")]
    assert_parity(greedy(engine), before)

    # left out on purpose: rank 0's tensors, a partial checkpoint on top of the served version
    owned = [n for n, _ in model.named_parameters() if n not in later]
    sent = sender.send_weights(version="stage0", names=owned, base_version="a")
    assert sent == directory / "step-00000001.safetensors"  # the refusal used no step
    assert engine.version == "stage0"
    with CheckpointReader(sent) as reader:
        assert reader.metadata[BASE_VERSION_KEY] == "a"
        assert list(reader.specs()) == owned


def _dtensor_rank(rank: int, port: int, directory: str, results) -> None:
    """One gloo rank of the two-rank check: a module of two DTensors, ``sharded`` (rows split
    over ranks 0 and 1, as FSDP2 shards) and ``elsewhere`` (on a mesh of rank 1 alone, as a
    later pipeline stage holds it), sent through vLLM's ``ModuleSource``."""
    import os
    import traceback

    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from vllm.distributed.weight_transfer.base import ModuleSource

        from weight_bridge import HTTPClient
        from weight_bridge.vllm.clients.trainer_api import (
            IncompleteSourceError,
            WeightBridgeTrainer,
            WeightBridgeTrainerInitInfo,
        )

        both, rank1 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1])
        module = torch.nn.Module()
        module.sharded = torch.nn.Parameter(distribute_tensor(torch.ones(6, 4), both, [Shard(0)]))
        module.elsewhere = torch.nn.Parameter(
            distribute_tensor(torch.ones(3), rank1, [Replicate()])
        )
        info = WeightBridgeTrainerInitInfo(directory=directory, rank=rank)
        # a client of a server that is not there: the refusal comes before any call to it
        client = HTTPClient("http://127.0.0.1:9", inflight=None)
        sender = WeightBridgeTrainer.trainer_init(info, client=client, source=ModuleSource(module))
        try:
            sender.send_weights(version="never")
            results.put((rank, "sent", None))
        except IncompleteSourceError as exc:
            results.put((rank, "refused", exc.problems))
        dist.barrier()  # neither rank is left in a gather: both reach it
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@needs_owners
@pytest.mark.timeout(300)  # a rank left waiting in a gather would hang: fail instead
def test_a_dtensor_off_rank_0_is_refused_on_every_rank_before_any_gather(tmp_path) -> None:
    """Two real gloo ranks, vLLM's own ``ModuleSource`` over real DTensors: ``elsewhere`` is
    owned by rank 1 only (``ParamMeta.owners == (1,)``), so rank 0 would never have it; both
    ranks refuse the send alike, naming it (metadata is the same on every rank), and neither
    waits in a collective. ``sharded``, split over both ranks, is not refused: ``iter_full``
    gathers it whole onto rank 0."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    args = (port, str(tmp_path / "ckpt"), results)
    mp.start_processes(_dtensor_rank, args=args, nprocs=2, start_method="spawn")
    found = {}
    while not results.empty():
        rank, outcome, detail = results.get()
        found[rank] = (outcome, detail)
    assert set(found) == {0, 1}, found
    for rank in (0, 1):
        outcome, problems = found[rank]
        assert outcome == "refused", (rank, problems)
        assert list(problems) == ["elsewhere"] and "[1] only" in problems["elsewhere"]
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
