"""Benchmark: pushes while generations are in flight, and the asynchronous recipe's throughput.

    python -m benchmarks.inflight --out bench/inflight.json         # 10m, 8 pushes per mode
    python -m benchmarks.inflight --size 1m --pushes 3 --steps 6     # smoke run

1. **The pause.** One ``AsyncColocatedEngine`` (vLLM's ``AsyncLLM`` with the bridge; its engine
   core and worker are processes of their own) on a Llama of ``size``. First ``pushes`` pushes
   into the idle engine (B, A, B, ...), then, for each in-flight mode (``recompute``, ``keep``,
   ``drain``), ``pushes`` more while a background stream of generations keeps the engine busy
   (batches of 8 prompts x 64 tokens, a new batch as soon as one finishes). Reported per mode:
   how long generation was paused (from the pause request to the resume's return; the push's
   own time included), median and p95, beside the idle push's duration. ``None`` (no pause)
   too: there generation stops only while the engine core runs the update between two steps,
   which stamps the new version in the same call (no step runs new weights under the old
   label); its row is the push's own time under load.
2. **The recipe.** ``examples/grpo/train.py`` for ``steps`` steps, synchronous
   (``config.yaml``) then asynchronous (``config.yaml`` + ``async.yaml``: rollouts for step k+1
   generated while step k trains, pushes in flight), one after the other on the same machine;
   steps per second (training steps only, engine start-up excluded), the last rewards and the
   staleness distribution from each run's ``summary.json``.

Reported, never asserted. ``bench_inflight(workdir, size, pushes, steps, log)`` is the section a
suite can call; ``main`` the command; ``render`` the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["bench_inflight", "main", "render"]

MODES = ("recompute", "keep", "drain")
NO_PAUSE = "none"  # the key of inflight=None's row
ROOT = Path(__file__).resolve().parents[1]


def _stats(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {
        "median_s": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2,
        "p95_s": s[min(len(s) - 1, round(0.95 * (len(s) - 1)))],
        "n": len(s),
    }


class _Busy:
    """Keeps the engine generating until stopped: a new batch as soon as one finishes."""

    def __init__(self, engine: Any) -> None:
        from vllm import SamplingParams

        self.engine = engine
        self.sampling = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
        self.prompts = [{"prompt_token_ids": [1, 20 + i, 30 + i, 40 + i]} for i in range(8)]
        self.stop = threading.Event()
        self.batches = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.submit(self.prompts, self.sampling).result()
            self.batches += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(300)


def _pauses(workdir: Path, size: str, pushes: int, log: Callable[[str], None]) -> dict:
    from weight_bridge.testing.models import build_tiny_model, perturb_checkpoint
    from weight_bridge.vllm.clients.async_colocated import AsyncColocatedEngine

    a = build_tiny_model(workdir / f"{size}_A", arch="llama", size=size, seed=0)
    b = perturb_checkpoint(a, workdir / f"{size}_B", scale=0.3, seed=1)
    kwargs = dict(dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=16)
    out: dict[str, Any] = {"size": size}
    with AsyncColocatedEngine(a, inflight=None, checkpoint_root=workdir, **kwargs) as engine:
        idle = [engine.push(b if i % 2 == 0 else a, version=i).elapsed_s for i in range(pushes)]
        out["idle"] = _stats(idle)
        log(f"idle push: {out['idle']}")
        for mode in (None, *MODES):
            busy = _Busy(engine)
            paused = []
            for i in range(pushes):
                while busy.batches == 0 and not busy.stop.is_set():
                    busy.stop.wait(0.01)  # generating for real before the first push
                report = engine.push(b if i % 2 == 0 else a, version=f"{mode}{i}", inflight=mode)
                paused.append(report.elapsed_s if mode is None else report.paused_s)
            busy.close()
            key = mode or NO_PAUSE
            out[key] = _stats(paused)
            log(f"{key}: paused {out[key]} ({busy.batches} batches generated meanwhile)")
    return out


def _recipe(workdir: Path, steps: int, overlay: str | None, log: Callable[[str], None]) -> dict:
    """One run of the recipe from ``workdir`` (its relative ``runs/`` paths land there)."""
    name = "async" if overlay else "sync"
    args = [sys.executable, str(ROOT / "examples/grpo/train.py"), "fit"]
    args += ["--config", str(ROOT / "examples/grpo/config.yaml")]
    if overlay:
        args += ["--config", str(ROOT / "examples/grpo" / overlay)]
    args += ["--trainer.max_steps", str(steps)]
    done = subprocess.run(args, cwd=workdir, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {name} recipe failed:\n{done.stderr[-3000:]}")
    run = workdir / "runs" / ("grpo-async" if overlay else "grpo")
    summary = json.loads((run / "summary.json").read_text())
    keep = ("steps", "steps_per_s", "reward_first", "reward_last", "staleness_tokens")
    out = {k: summary.get(k) for k in keep}
    log(f"{name} recipe: {out}")
    return out


def bench_inflight(
    workdir: Path, size: str, pushes: int, steps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """The section's results (see the module docstring)."""
    result: dict[str, Any] = {"pauses": _pauses(workdir, size, pushes, log)}
    if steps < 1:
        return result  # pauses only (the quick run)
    sync = _recipe(workdir, steps, None, log)
    asynchronous = _recipe(workdir, steps, "async.yaml", log)
    result["recipe"] = {
        "sync": sync,
        "async": asynchronous,
        "speedup": asynchronous["steps_per_s"] / sync["steps_per_s"],
    }
    return result


def render(result: dict[str, Any]) -> str:
    """The section as markdown tables."""
    p = result["pauses"]
    run = result.get("pauses_run")
    lines = [
        f"In-flight pushes ({p['size']} Llama, AsyncColocatedEngine, "
        f"{p['idle']['n']} pushes each):",
        "",
        *(
            [f"Measured on their own: `{run['command']}`, {run['started']}: {run['why']}.", ""]
            if run
            else []
        ),
        "| push | generation paused, median | p95 |",
        "|---|---|---|",
        f"| into an idle engine (the push itself) | {p['idle']['median_s']:.3f} s "
        f"| {p['idle']['p95_s']:.3f} s |",
    ]
    if NO_PAUSE in p:  # runs before labels were stamped with the write did not measure it
        row = p[NO_PAUSE]
        lines.append(
            f"| in flight, `None` (no pause; the push's own time: generation stops only while "
            f"the engine core runs the update between two steps) "
            f"| {row['median_s']:.3f} s | {row['p95_s']:.3f} s |"
        )
    for mode in MODES:
        lines.append(
            f"| in flight, `{mode}` | {p[mode]['median_s']:.3f} s | {p[mode]['p95_s']:.3f} s |"
        )
    r = result.get("recipe")
    if r is None:
        return "\n".join(lines)
    lines += [
        "",
        f"GRPO recipe, {r['sync']['steps']} steps each, one after the other:",
        "",
        "| recipe | steps/s | reward first -> last | tokens by staleness |",
        "|---|---|---|---|",
    ]
    for name in ("sync", "async"):
        s = r[name]
        lines.append(
            f"| {name} | {s['steps_per_s']:.3f} | {s['reward_first']:.3f} -> "
            f"{s['reward_last']:.3f} | {s['staleness_tokens']} |"
        )
    lines.append(f"\nasync / sync steps per second: {r['speedup']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inflight", description=__doc__)
    parser.add_argument("--size", default="10m")
    parser.add_argument("--pushes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="recipe steps per run (0: skip)")
    parser.add_argument("--out", type=Path, default=Path("bench/inflight.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="wb-inflight-") as tmp:
        result = bench_inflight(Path(tmp), args.size, args.pushes, args.steps, print)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
