"""Can vLLM's logprobs be trusted on this machine? (``make test-vllm034`` asks it first.)

Starts a plain vLLM engine on a tiny Llama built here
(:func:`weight_bridge.testing.models.build_tiny_model`, seed 0, float32, ``enforce_eager``),
generates greedily from :data:`weight_bridge.testing.parity.PROMPTS` with ``logprobs`` and
``prompt_logprobs``, and compares every logprob vLLM reports (sampled, top-k and prompt) with a
Hugging Face ``transformers`` forward of the same model in float32: ``log_softmax`` of the
logits at the same position.

Plain means without the bridge: its own ``vllm.general_plugins`` entry point is kept out of
every process of the engine (:func:`keep_the_bridge_out`). The probe asks whether vLLM itself
runs on this machine, never whether the bridge does: a bridge that breaks vLLM (its plugin
raising in every process, a patch site reported missing) is not a skip, the probe passes and
the subset it gates fails.

Tolerance: :data:`TOL` nats. Both sides are float32 over the same weights, so they agree far
closer than that on every ISA path seen, with room left for other kernels (another ISA's FMA
order, oneDNN's choice); a wrong normalizer is off by more. A logprob above 0
(:data:`POSITIVE_SLACK`) is wrong whatever the reference says.

Exit status:

* 0: the engine started and every logprob matched.
* 3 (:data:`SKIP`): vLLM's engine, without the bridge's plugin, could not start (for example
  no library of the installed vLLM for this CPU) or a logprob did not match. One line says
  why: which vLLM library the engine loaded, the worst difference and where.
* 1: anything else (a bug in the probe, the model build or the reference): never a skip.

``--why FILE`` also writes that one line (or, on success, the summary) to ``FILE``.

A known cause of wrong logprobs that is not the CPU: a torch Inductor cache filled under another
vector ISA (``weight_bridge/vllm/internals/inductor_cache_isa.py``). With the plugin kept out,
:func:`keep_the_bridge_out` gives the probe's engine the same ISA cache key through torch's
``TORCH_COMPILE_CACHE_KEY_TAG``, which its spawned processes inherit. The skip line names the
cache directory; a fresh ``TORCHINDUCTOR_CACHE_DIR`` rules it out.

    .venv-vllm034/bin/python tools/logprob_probe.py [--why FILE] [--max-tokens 12]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOL = 1e-3
# A logprob above 0 is wrong whatever the tolerance; this much is float32 rounding of
# ``selected - logsumexp`` for a dominant token (an ulp at logits of ~1000 is 6e-5).
POSITIVE_SLACK = 1e-4
SKIP = 3
TOP_K = 5
BRIDGE_PACKAGE = "weight_bridge"  # whose entry points in vLLM's plugin groups are kept out


# -- the decision: pure, tested on plain data (tests/test_logprob_probe.py) ---------------------


@dataclass(frozen=True)
class Row:
    """What vLLM reported at one position, beside the reference distribution there.

    ``where``: a readable place ("prompt 1, generated token 3"); ``reported``: token id ->
    logprob as vLLM returned them; ``reference``: the Hugging Face log-softmax over the whole
    vocabulary at the same position (indexable by token id).
    """

    where: str
    reported: Mapping[int, float]
    reference: Sequence[float]


@dataclass
class Verdict:
    """How the reported logprobs compare with the reference."""

    compared: int = 0
    worst: float = 0.0  # largest |reported - reference| over finite pairs
    worst_at: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.compared > 0 and not self.problems

    def summary(self) -> str:
        if self.compared == 0:
            return "no logprob was reported"
        head = f"worst |vLLM - HF| {self.worst:.3g} nats over {self.compared} logprobs"
        if self.worst_at:
            head += f" ({self.worst_at})"
        if not self.problems:
            return head
        return head + f"; {len(self.problems)} wrong, first: {self.problems[0]}"


def compare_logprobs(rows: Sequence[Row], tol: float = TOL) -> Verdict:
    """Every reported logprob against the reference at its position, within ``tol`` nats.

    A problem: a reported logprob that is not finite (``-inf`` only where the reference is
    ``-inf`` too), one above :data:`POSITIVE_SLACK` (no logprob is positive, whatever ``tol``),
    one farther than ``tol`` from the reference, or a token id outside the vocabulary.
    """
    v = Verdict()
    for row in rows:
        for token, got in sorted(row.reported.items()):
            v.compared += 1
            if not 0 <= token < len(row.reference):
                v.problems.append(f"{row.where}: token {token} outside the vocabulary")
                continue
            want = float(row.reference[token])
            got = float(got)
            if math.isnan(got) or math.isnan(want):
                v.problems.append(f"{row.where} token {token}: vLLM {got!r}, HF {want!r}")
                continue
            if got == want:  # equal infinities included
                continue
            diff = abs(got - want)  # inf when only one is infinite
            if diff > v.worst or not v.worst_at:
                v.worst = diff
                v.worst_at = f"{row.where}, token {token}: vLLM {got:.6g}, HF {want:.6g}"
            if got > POSITIVE_SLACK:
                v.problems.append(f"{row.where} token {token}: logprob {got:.6g} > 0")
            elif not diff <= tol:
                v.problems.append(
                    f"{row.where} token {token}: vLLM {got:.6g}, HF {want:.6g} "
                    f"(off by {diff:.3g} > {tol:g})"
                )
    return v


# -- the engine and the reference ----------------------------------------------------------------


class EngineDidNotStart(Exception):
    """vLLM's engine raised while starting: the subset cannot run here."""


def keep_the_bridge_out(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Make the vLLM engines started from here plain vLLM; the names of the bridge's plugins
    kept out.

    vLLM loads every entry point of its plugin groups (``vllm.general_plugins``: in every
    process it starts) unless ``VLLM_PLUGINS`` lists the names to load (``vllm/plugins``, 0.32
    and 0.34; the one list for every group). That becomes every plugin the environment installs
    (or ``VLLM_PLUGINS`` already allows) but the bridge's. The Inductor cache key by the CPU's
    vector ISA, the bridge's plugin's fix for wrong logprobs
    (:func:`weight_bridge.vllm.internals.inductor_cache_isa.apply`), is kept: applied here and
    put in ``TORCH_COMPILE_CACHE_KEY_TAG``, which torch reads into the same setting when a
    process imports it (vLLM spawns its engine processes on the CPU: they inherit it).
    """
    from importlib.metadata import distributions

    from weight_bridge.vllm.internals.inductor_cache_isa import apply

    environ = os.environ if environ is None else environ
    vllms = {ep for d in distributions() for ep in d.entry_points if ep.group.startswith("vllm.")}
    bridge = {ep.name for ep in vllms if ep.module.split(".")[0] == BRIDGE_PACKAGE}
    given = environ.get("VLLM_PLUGINS")
    allowed = given.split(",") if given is not None else [ep.name for ep in vllms]
    environ["VLLM_PLUGINS"] = ",".join(sorted({name for name in allowed if name not in bridge}))
    environ["TORCH_COMPILE_CACHE_KEY_TAG"] = apply()
    return sorted(bridge)


def loaded_vllm_libraries() -> list[str]:
    """vLLM's compiled libraries (``_C*.so``) mapped by this process or any descendant."""
    from weight_bridge.testing.procfs import descendants

    found: set[str] = set()
    for pid in [os.getpid(), *descendants(os.getpid())]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            name = line.rsplit(" ", 1)[-1]
            if "/vllm/_C" in name and name.endswith(".so"):
                found.add(Path(name).name)
    return sorted(found)


def expected_library() -> str:
    """The library ``vllm/platforms/cpu.py:import_kernels`` picks from torch's CPU flags, and
    whether the installed vLLM has it (checked without importing it)."""
    import importlib.util

    import torch

    if not torch.cpu._is_avx512_supported():
        module = "vllm._C_AVX2"
    elif torch.cpu._is_avx512_bf16_supported():
        module = "vllm._C"
    else:
        module = "vllm._C_AVX512"
    present = importlib.util.find_spec(module) is not None
    return f"{module} ({'present' if present else 'absent from the installed vLLM'})"


def inductor_cache_dir() -> str:
    """Where Inductor caches compiled code for this process and the engine's (they inherit the
    environment): a cache filled under another CPU ISA gives wrong logprobs (see the docstring)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def _logprob_map(entry: Mapping) -> dict[int, float]:
    return {int(k): float(getattr(v, "logprob", v)) for k, v in entry.items()}


def run(max_tokens: int) -> tuple[Verdict, str]:
    """The probe: the verdict and what vLLM loaded. Raises :class:`EngineDidNotStart`."""
    import torch
    from transformers import AutoModelForCausalLM

    from weight_bridge.testing.models import build_tiny_model
    from weight_bridge.testing.parity import PROMPTS

    keep_the_bridge_out()  # before vLLM loads its plugins, here and in the engine's processes
    with tempfile.TemporaryDirectory(prefix="logprob-probe-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny-llama", arch="llama", seed=0)

        from vllm import LLM, SamplingParams

        try:
            llm = LLM(
                model=str(model_dir),
                dtype="float32",
                enforce_eager=True,
                max_model_len=128,
                max_num_seqs=4,
                seed=0,
            )
        except TypeError:  # bad arguments: the probe's bug, not the machine's
            raise
        except Exception as e:
            raise EngineDidNotStart(
                f"{type(e).__name__}: {e}".splitlines()[0][:300]
                + f"; vLLM would load {expected_library()}"
            ) from e
        try:
            libraries = ", ".join(loaded_vllm_libraries()) or "no vllm/_C* library"
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                logprobs=TOP_K,
                prompt_logprobs=TOP_K,
                ignore_eos=True,
            )
            prompts: list[Any] = [{"prompt_token_ids": list(p)} for p in PROMPTS]
            outs = llm.generate(prompts, params)
        finally:
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm

        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        rows: list[Row] = []
        with torch.no_grad():
            for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
                gen = out.outputs[0]
                seq = list(prompt) + list(gen.token_ids)
                logits = hf(torch.tensor([seq])).logits[0].float()
                ref = torch.log_softmax(logits, dim=-1).tolist()
                # Row t of ``ref`` is the distribution of token t + 1.
                for t, entry in enumerate(out.prompt_logprobs or []):
                    if entry is not None:
                        where = f"prompt {i} position {t}"
                        rows.append(Row(where, _logprob_map(entry), ref[t - 1]))
                for s, step in enumerate(gen.logprobs or []):
                    assert step is not None, "vLLM reported no logprobs for a generated token"
                    where = f"prompt {i} generated token {s}"
                    rows.append(Row(where, _logprob_map(step), ref[len(prompt) + s - 1]))
        return compare_logprobs(rows), libraries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--why", type=Path, help="also write the verdict line to this file")
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    try:
        verdict, libraries = run(args.max_tokens)
    except EngineDidNotStart as e:
        code, line = SKIP, f"vLLM's engine did not start on this machine (no bridge plugin): {e}"
    except Exception:
        traceback.print_exc()
        code, line = 1, "the logprob probe itself failed (a bug, not a skip): see the traceback"
    else:
        code, match = (0, "match") if verdict.ok else (SKIP, "do not match")
        line = f"vLLM's logprobs {match} Hugging Face within {TOL:g} ({libraries}): "
        line += verdict.summary()
        if not verdict.ok:
            line += f"; torch's compile cache: {inductor_cache_dir()}"
    line += f" [{time.perf_counter() - started:.0f} s]"
    print(f"logprob_probe: {line}", flush=True)
    if args.why is not None:
        args.why.write_text(line + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
