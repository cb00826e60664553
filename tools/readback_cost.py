"""What the read-back costs next to the write itself, on 100 MiB of weights (docs/design.md,
"Read-back"): 25 float32 checkpoint tensors of 1024 x 1024 copied into an engine's tensors of
``--dtype`` on ``--device``, then what ``readback="full"`` adds (the digest of each source as
sealed, cast as the copy casts it; the digest of the engine's bytes after the last write) and
what ``"sampled"`` adds (8 rows kept and compared). Best of ``--reps``, in milliseconds.

    python tools/readback_cost.py [--dtype float32|bfloat16|float16] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from weight_bridge.direct.readback import _as_written, _digest, _kept, _rows_of, _same


def _best(f, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(1024, 1024, generator=g).to(device) for _ in range(25)]
    dst = [torch.empty(1024, 1024, dtype=getattr(torch, args.dtype), device=device) for _ in src]
    pairs = list(zip(dst, src, strict=True))
    rows = {
        "the write: copy_ of every tensor": lambda: [d.copy_(s) for d, s in pairs],
        '"full" at sealing: digest of each source, cast': lambda: [
            _digest(_as_written(d, s)) for d, s in pairs
        ],
        '"full" after the last write: digest of each destination': lambda: [
            _digest(d) for d in dst
        ],
        '"sampled": 8 rows kept, then compared': lambda: [
            _same(_rows_of(d), _kept(d, s), False) for d, s in pairs
        ],
    }
    print(f"100 MiB float32 -> {args.dtype} on {device} ({torch.get_num_threads()} threads)")
    for what, f in rows.items():
        print(f"  {what:58s} {_best(f, args.reps, device):8.1f} ms")


if __name__ == "__main__":
    main()
