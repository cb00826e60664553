"""GPU check (``make gpu-check``): direct reload under CUDA graphs, on a CUDA machine.

Needs the CUDA build of vLLM (``pip install -e '.[cuda]'`` in a CUDA environment). Starts a
bridged engine with CUDA graphs on, pushes perturbed checkpoints, and checks cold-start parity
(greedy tokens, top-k logprobs), unchanged addresses and push time against the memcpy limit
(device-to-device ``copy_`` of the same bytes, and host page cache to device). Prints one
summary table. Exits 0 with a message, doing nothing, where no GPU is present: CI never needs it.

    python tools/gpu_check.py [--size 100m] [--arch qwen2] [--dtype bfloat16]
    python tools/gpu_check.py --matrix      # the architecture matrix, direct and auto

``--matrix`` runs every family of :data:`weight_bridge.testing.models.MATRIX` (dense, tied,
MoE, MLA + MoE: the MoE kernels differ on CUDA, e.g. FlashInfer shuffles expert weights) in
``direct`` and ``auto`` mode against a cold start and prints the same table as the README's:
per family and mode, equal to the cold start, refused by name (nothing written), or WRONG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="100m")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--matrix", action="store_true", help="run the architecture matrix")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; skipped (nothing to check on the CPU build)")
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.matrix:
        return matrix(args.dtype)
    from weight_bridge.checkpoint import CheckpointReader
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
    from weight_bridge.testing.parity import PROMPTS, greedy, parity_problems
    from weight_bridge.vllm import ColocatedEngine

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-check-"))
    a = build_tiny_model(root / "A", arch=args.arch, size=args.size, seed=0)
    b = perturb_checkpoint(a, root / "B", scale=0.3, seed=1)
    kwargs = dict(dtype=args.dtype, max_model_len=256, seed=0, gpu_memory_utilization=0.3)

    def outputs(engine: ColocatedEngine) -> list:
        return greedy(engine, PROMPTS[:3], max_tokens=16, logprobs=3)

    def same(got: list, want: list) -> bool:
        # greedy tokens and top-k ids; logprob values are not compared here
        return not parity_problems(got, want, tol=None)

    rows: list[tuple[str, str]] = []
    with ColocatedEngine(b, enforce_eager=False, **kwargs) as cold_b:
        want_b = outputs(cold_b)
    with ColocatedEngine(a, enforce_eager=False, **kwargs) as engine:
        want_a = outputs(engine)
        before = engine.addresses()
        times = []
        for i in range(args.reps):
            times.append(engine.push(b, version=2 * i + 1).elapsed_s)
            got_b = outputs(engine)
            engine.push(a, version=2 * i + 2)
        got_a = outputs(engine)
        same_addresses = engine.addresses() == before
        rows.append(("greedy tokens after push == cold start", str(same(got_b, want_b))))
        rows.append(("back to A == cold A", str(same(got_a, want_a))))
        rows.append(("addresses unchanged (CUDA graphs valid)", str(same_addresses)))
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
        rows.append(("push median (s)", f"{push:.4f}"))
        rows.append(("device copy_ of same bytes (s)", f"{d2d:.4f}"))
        rows.append(("page cache -> device copy_ (s)", f"{h2d:.4f}"))
        rows.append(("push / (page cache -> device)", f"{push / h2d:.2f}x"))
    width = max(len(r[0]) for r in rows)
    print(f"gpu-check: {args.arch} {args.size} {args.dtype} on {torch.cuda.get_device_name()}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    ok = rows[0][1] == rows[1][1] == rows[2][1] == "True"
    return 0 if ok else 1


def matrix(dtype: str) -> int:
    """Every family of the matrix, ``direct`` then ``auto``, against a cold start."""
    from weight_bridge.direct import DirectReloadError
    from weight_bridge.testing.models import MATRIX, build_matrix_model, perturb_checkpoint
    from weight_bridge.testing.parity import greedy, parity_problems
    from weight_bridge.vllm import ColocatedEngine

    root = Path(tempfile.mkdtemp(prefix="wb-gpu-matrix-"))
    kwargs = dict(dtype=dtype, max_model_len=256, seed=0, gpu_memory_utilization=0.3)
    rows = []
    wrong = 0
    for family in MATRIX:
        a = build_matrix_model(root / f"{family}_A", family)
        b = perturb_checkpoint(a, root / f"{family}_B", scale=0.3, seed=1)
        try:
            with ColocatedEngine(b, enforce_eager=False, **kwargs) as cold:
                want = greedy(cold)
            cells = []
            with ColocatedEngine(a, enforce_eager=False, **kwargs) as engine:
                before = engine.addresses()
                for mode in ("direct", "auto"):
                    engine.reload_mode = mode
                    try:
                        report = engine.push(b, version=mode)
                    except DirectReloadError as exc:
                        cells.append(f"refused ({len(exc.problems)} weights named)")
                        continue
                    ok = not parity_problems(greedy(engine), want, tol=1e-2)
                    ok = ok and engine.addresses() == before
                    wrong += not ok
                    cells.append(f"{'= cold start' if ok else 'WRONG'} ({report.mode})")
                    engine.push(a, version="A")
        except Exception as exc:  # a family this vLLM build does not serve
            cells = [f"not served: {type(exc).__name__}: {str(exc)[:60]}"] * 2
        rows.append((family, *cells))
    print(f"gpu-check matrix ({dtype}): family | direct | auto")
    for family, direct, auto in rows:
        print(f"| {family} | {direct} | {auto} |")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
