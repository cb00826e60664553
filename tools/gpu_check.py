"""GPU check (``make gpu-check``): direct reload under CUDA graphs, on a CUDA machine.

Needs the CUDA build of vLLM (``pip install -e '.[cuda]'`` in a CUDA environment). Starts a
bridged engine with CUDA graphs on, pushes perturbed checkpoints, and checks cold-start parity
(the CPU tests' parity: the same greedy tokens and top-k ids, logprobs within 1e-4), unchanged
addresses and push time against the memcpy limit (device-to-device ``copy_`` of the same bytes,
and host page cache to device). Prints one summary table.

Exit status: 0 only when every check passed. 1 when a result is wrong, a push or an engine
raised, or (``--matrix``) ``auto`` mode refused a push. Without CUDA: 2 with ``--require-gpu``
(what ``make gpu-check`` passes), else 0 after printing that it skipped.

    python tools/gpu_check.py [--require-gpu] [--size 100m] [--arch qwen2] [--dtype bfloat16]
    python tools/gpu_check.py --matrix      # the architecture matrix, direct and auto
    python tools/gpu_check.py --delta-memory   # a delta's peak device memory, no engine
    python tools/gpu_check.py --ranks-memory   # a push from memory's peak device memory

``--matrix`` runs every family of :data:`weight_bridge.testing.models.MATRIX` (dense, tied,
MoE, MLA + MoE: the MoE kernels differ on CUDA, e.g. FlashInfer shuffles expert weights) in
``direct`` and ``auto`` mode against a cold start and prints the same table as the README's:
per family and mode, equal to the cold start, refused by name (``direct`` only: nothing
written, the engine still equal to its own start), or FAIL with the reason.

``--delta-memory`` applies a delta to one 64 MiB bf16 tensor on the GPU with the direct core
(dense, every element changed; sparse, 45 % changed) and checks the bound the CPU tests check
with resident memory: ``torch.cuda.max_memory_allocated`` over what was allocated before stays
within twice the tensor plus the undo log (:mod:`weight_bridge.testing.deltas`).

``--ranks-memory`` starts the engine inside this process's rank (``RanksEngine``, one rank, the
external launcher) on a ``--size`` model and pushes the trainer's tensors from device memory:
``torch.cuda.max_memory_allocated`` during the push over what was allocated before stays within
twice the largest tensor plus :data:`RANKS_BUFFER` (the rollback's pre-images live in host
memory, none on the device), and the push equals a cold start on the pushed weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

LOGPROB_TOL = 1e-4  # the CPU tests' parity (tests/helpers.py: assert_parity)
NO_GPU_EXIT = 2
RANKS_BUFFER = 64 * 2**20  # a push from memory's fixed allowance on the device, besides 2 tensors


def parity_failures(got: list, want: list) -> list[str]:
    """What differs between two outputs of ``weight_bridge.testing.parity.greedy``: any token
    or top-k id, or a logprob off by more than 1e-4. Empty when they match."""
    from weight_bridge.testing.parity import parity_problems

    return parity_problems(got, want, tol=LOGPROB_TOL)


def cell_verdict(
    mode: str,
    *,
    error: BaseException | None = None,
    refused: dict | None = None,
    problems: list[str] | None = None,
    addresses_same: bool = True,
) -> tuple[str, bool]:
    """One matrix cell: its text and whether it passes.

    Passes: the push served the cold start (``problems`` empty) at unchanged addresses; or, in
    ``direct`` mode only, a refusal naming the weights it cannot prove (``refused``: name ->
    why) after which the engine still serves what it served (``problems`` empty, compared with
    its own earlier output). Fails: any exception, a refusal in ``auto`` mode (it must hand
    what it cannot prove to vLLM, never refuse), a refusal naming nothing, a wrong output, a
    moved address.
    """
    if error is not None:
        return f"FAIL: raised {type(error).__name__}: {str(error)[:80]}", False
    what = "push"
    if refused is not None:
        if mode != "direct":
            return f"FAIL: refused in {mode} mode ({len(refused)} weights named)", False
        if not refused:
            return "FAIL: refused without naming a weight", False
        what = f"refused ({len(refused)} weights named), then"
    if problems:
        return f"FAIL: {what} outputs differ: {problems[0][:80]}", False
    if not addresses_same:
        return f"FAIL: {what} addresses moved", False
    if refused is not None:
        return f"refused ({len(refused)} weights named), nothing written", True
    return "= cold start", True


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="100m")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--matrix", action="store_true", help="run the architecture matrix")
    parser.add_argument(
        "--delta-memory", action="store_true", help="a delta's peak device memory, its bound"
    )
    parser.add_argument(
        "--ranks-memory", action="store_true", help="a push from memory's peak device memory"
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help=f"without a CUDA device, fail (exit {NO_GPU_EXIT}) instead of skipping",
    )
    args = parser.parse_args(argv)

    if not cuda_available():
        if args.require_gpu:
            print(
                f"gpu-check: FAILED: no CUDA device here and --require-gpu was given "
                f"(exit {NO_GPU_EXIT}); run it on a machine with a GPU and the CUDA build of vLLM",
                file=sys.stderr,
            )
            return NO_GPU_EXIT
        print("gpu-check: SKIPPED: no CUDA device here, nothing was checked (exit 0)")
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        if args.delta_memory:
            return delta_memory("cuda")
        if args.ranks_memory:
            return ranks_memory(args)
        return matrix(args.dtype) if args.matrix else single(args)
    except Exception:
        traceback.print_exc()
        print("gpu-check: FAILED: an exception (above) ended the check", file=sys.stderr)
        return 1


def delta_memory(device: str) -> int:
    """A dense and a sparse delta applied on ``device``: peak memory against its bound."""
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.delta.format import read_delta
    from weight_bridge.testing.deltas import applied_memory, delta_checkpoint, wide_pair

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-check-delta-"))
    failed = []
    for label, fraction in (("dense, every element changed", 1.0), ("sparse, 45 % changed", 0.45)):
        a, b = wide_pair(fraction)
        path = delta_checkpoint(a, b, "A", "B", root / f"{fraction}.safetensors")
        with CheckpointReader(path) as reader:
            delta = read_delta(str(path), reader.metadata, dict(reader.tensors()))
            cost = applied_memory(a, delta, device)
        ok = cost.peak <= cost.bound
        failed += [] if ok else [label]
        print(
            f"  delta, 64 MiB bf16 tensor, {label}: peak {cost.peak / 2**20:.0f} MiB, bound "
            f"{cost.bound / 2**20:.0f} MiB (2x tensor + undo log {cost.undo / 2**20:.0f} MiB): "
            f"{'ok' if ok else 'FAIL'}"
        )
    for label in failed:
        print(f"gpu-check: FAILED: a delta ({label}) exceeded its memory bound", file=sys.stderr)
    return 1 if failed else 0


def ranks_memory(args: argparse.Namespace) -> int:
    """A push from device memory into an engine in this rank: peak device memory, its bound."""
    import torch
    import torch.distributed as dist

    from weight_bridge import ColocatedEngine
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
    from weight_bridge.testing.parity import PROMPTS, greedy
    from weight_bridge.vllm.clients.ranks import RanksEngine
    from weight_bridge.vllm.clients.served import free_port

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-check-ranks-"))
    a = build_tiny_model(root / "A", arch=args.arch, size=args.size, seed=0)
    b = perturb_checkpoint(a, root / "B", scale=0.3, seed=1)
    kwargs = dict(dtype=args.dtype, max_model_len=256, seed=0, gpu_memory_utilization=0.3)
    with ColocatedEngine(b, **kwargs) as cold_b:
        want = greedy(cold_b, PROMPTS[:3], max_tokens=16, logprobs=3)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    engine = RanksEngine(a, **kwargs)
    try:
        dtype = getattr(torch, args.dtype)
        with CheckpointReader(b) as reader:
            tensors = {n: t.to("cuda", dtype) for n, t in reader.tensors()}
        largest = max(t.numel() * t.element_size() for t in tensors.values())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        engine.push_tensors(tensors, version="B")
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        problems = parity_failures(greedy(engine, PROMPTS[:3], max_tokens=16, logprobs=3), want)
    finally:
        engine.close()
        dist.destroy_process_group()
    bound = 2 * largest + RANKS_BUFFER
    print(
        f"  push from memory, {args.arch} {args.size} {args.dtype}: peak {peak / 2**20:.0f} MiB "
        f"on the device, bound {bound / 2**20:.0f} MiB (2x largest tensor "
        f"{largest / 2**20:.0f} MiB + {RANKS_BUFFER / 2**20:.0f} MiB): "
        f"{'ok' if peak <= bound else 'FAIL'}; equal to a cold start: "
        f"{'ok' if not problems else 'FAIL'}"
    )
    for p in problems[:5]:
        print(f"gpu-check: FAILED: the push from memory differs from a cold start: {p}")
    if peak > bound:
        print("gpu-check: FAILED: a push from memory exceeded its device-memory bound")
    return 1 if problems or peak > bound else 0


def single(args: argparse.Namespace) -> int:
    """One model: pushes under CUDA graphs, parity, addresses, push time vs memcpy."""
    import torch

    from weight_bridge import ColocatedEngine
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
    from weight_bridge.testing.parity import PROMPTS, greedy

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-check-"))
    a = build_tiny_model(root / "A", arch=args.arch, size=args.size, seed=0)
    b = perturb_checkpoint(a, root / "B", scale=0.3, seed=1)
    kwargs = dict(dtype=args.dtype, max_model_len=256, seed=0, gpu_memory_utilization=0.3)

    def outputs(engine: ColocatedEngine) -> list:
        return greedy(engine, PROMPTS[:3], max_tokens=16, logprobs=3)

    checks: list[tuple[str, list[str]]] = []  # (what, problems): passes when empty
    info: list[tuple[str, str]] = []
    with ColocatedEngine(b, enforce_eager=False, **kwargs) as cold_b:
        want_b = outputs(cold_b)
    with ColocatedEngine(a, enforce_eager=False, **kwargs) as engine:
        want_a = outputs(engine)
        before = engine.addresses()
        times = []
        after_b: list[str] = []
        after_a: list[str] = []
        for i in range(args.reps):
            times.append(engine.push(b, version=2 * i + 1).elapsed_s)
            after_b += [f"push {i + 1}: {p}" for p in parity_failures(outputs(engine), want_b)]
            engine.push(a, version=2 * i + 2)
            after_a += [f"push {i + 1}: {p}" for p in parity_failures(outputs(engine), want_a)]
        checks.append(("after each push of B == cold B (tokens, logprobs 1e-4)", after_b))
        checks.append(("after each push back to A == A's start", after_a))
        moved = engine.addresses() != before
        checks.append(("addresses unchanged (CUDA graphs valid)", ["moved"] if moved else []))
        with CheckpointReader(b) as reader:
            host = [t for _, t in reader.tensors()]
            dev = [
                torch.empty(
                    t.shape,
                    dtype=torch.bfloat16 if args.dtype == "bfloat16" else t.dtype,
                    device="cuda",
                )
                for t in host
            ]
            src = [d.clone() for d in dev]

            def timed(fn) -> float:
                samples = []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    samples.append(time.perf_counter() - t0)
                return statistics.median(samples)

            d2d = timed(lambda: [d.copy_(s) for d, s in zip(dev, src, strict=True)])
            h2d = timed(lambda: [d.copy_(h) for d, h in zip(dev, host, strict=True)])
        push = statistics.median(times)
        info.append(("push median (s)", f"{push:.4f}"))
        info.append(("device copy_ of same bytes (s)", f"{d2d:.4f}"))
        info.append(("page cache -> device copy_ (s)", f"{h2d:.4f}"))
        info.append(("push / (page cache -> device)", f"{push / h2d:.2f}x"))
    rows = [(what, "ok" if not problems else "FAIL") for what, problems in checks] + info
    width = max(len(r[0]) for r in rows)
    print(f"gpu-check: {args.arch} {args.size} {args.dtype} on {torch.cuda.get_device_name()}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    failed = [(what, problems) for what, problems in checks if problems]
    for what, problems in failed:
        print(f"gpu-check: FAILED: {what}:", *problems[:5], sep="\n    ", file=sys.stderr)
    return 1 if failed else 0


def matrix(dtype: str) -> int:
    """Every family of the matrix, ``direct`` then ``auto``, against a cold start."""
    from weight_bridge import ColocatedEngine
    from weight_bridge.direct import DirectReloadError
    from weight_bridge.testing.models import MATRIX, build_matrix_model, perturb_checkpoint
    from weight_bridge.testing.parity import greedy

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-matrix-"))
    kwargs = dict(dtype=dtype, max_model_len=256, seed=0, gpu_memory_utilization=0.3)
    rows = []
    failed = 0
    for family in MATRIX:
        cells: dict[str, tuple[str, bool]] = {}
        try:
            a = build_matrix_model(root / f"{family}_A", family)
            b = perturb_checkpoint(a, root / f"{family}_B", scale=0.3, seed=1)
            with ColocatedEngine(b, enforce_eager=False, **kwargs) as cold:
                want = greedy(cold)
            with ColocatedEngine(a, enforce_eager=False, **kwargs) as engine:
                start = greedy(engine)
                before = engine.addresses()
                for mode in ("direct", "auto"):
                    engine.reload_mode = mode
                    try:
                        report = engine.push(b, version=mode)
                    except DirectReloadError as exc:
                        problems = parity_failures(greedy(engine), start)
                        same = engine.addresses() == before
                        cells[mode] = cell_verdict(
                            mode, refused=exc.problems, problems=problems, addresses_same=same
                        )
                        continue
                    problems = parity_failures(greedy(engine), want)
                    same = engine.addresses() == before
                    text, ok = cell_verdict(mode, problems=problems, addresses_same=same)
                    cells[mode] = (f"{text} ({report.mode})", ok)
                    engine.push(a, version="A")
        except Exception as exc:  # a family that does not start or push here fails the check
            for mode in ("direct", "auto"):
                if mode not in cells:
                    cells[mode] = cell_verdict(mode, error=exc)
        failed += sum(not ok for _, ok in cells.values())
        rows.append((family, cells["direct"][0], cells["auto"][0]))
    print(f"gpu-check matrix ({dtype}): family | direct | auto")
    for family, direct, auto in rows:
        print(f"| {family} | {direct} | {auto} |")
    if failed:
        print(f"gpu-check: FAILED: {failed} matrix cells", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
