"""Remove each guarantee's code in turn and run its tests: every removal must fail one of them.

Each mutant is one exact string replacement in one file, applied to a fresh *copy* of the
working tree (tracked and untracked files, ``git ls-files -co --exclude-standard``), never to
the tree itself. Its tests run with this interpreter (the project's virtual environment), the
copy as the working directory and first on ``PYTHONPATH``: the copy's ``weight_bridge`` and
``callbacks`` are imported, not the editable install's (checked and logged for every copy). A
mutant's test selections run in order until one fails (``-x``); then, as a control, every test
that caught a mutant runs once more on the unmutated copy and must pass there.

An anchor that is not found exactly once stops the run: a mutant cannot silently go stale.

The result, a markdown table, goes to stdout and replaces the ``## Mutants`` section of
``docs/tests.md`` (appended at its end). ``make mutants`` runs it; it takes minutes (real
engines), so ``make test`` does not.

    python tools/mutants.py [--only NAME ...] [--check] [--no-docs] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tests.md"
HEADING = "## Mutants"
TIMEOUT_S = 2400  # one pytest run; engine tests take minutes on a loaded 2-core machine
TIMED_OUT = 124
ATTEMPTS = 3  # a pytest run killed by a signal (the kernel's OOM killer, on a shared machine)


@dataclass
class Mutant:
    name: str
    guarantee: str
    file: str
    anchor: str  # exact text, found exactly once in ``file``
    replacement: str
    removed: str  # what the table says is removed
    selections: list[list[str]]  # pytest arguments, tried in order until one fails
    caught_by: list[str] = field(default_factory=list)
    outcome: str = ""
    ran: list[str] = field(default_factory=list)


# One row per mutant: its name, the guarantee, the file (under ``weight_bridge/``), the anchor
# (exact text, found exactly once in the file), its replacement, what the table says is removed,
# then the pytest selections (``FILE -k EXPR``, under ``tests/``), tried in order until one fails.
# fmt: off
_ROWS = [
    ("prefix", "prefix-cache reset after a push", "vllm/core/updates.py",
     "        forget_prefixes(core, salt)", "        pass",
     "the `forget_prefixes(...)` call in `_forget_prefixes_on_every_rank`",
     "test_engine.py -k test_prefix_cache_is_reset_by_a_push", "test_serve.py -k prefix"),
    ("nan", "the NaN/Inf guard", "direct/validate.py",
     "problems.update(find_nonfinite(items, targets, written))", "pass",
     "the `find_nonfinite(...)` call in `validate_checkpoint`", "test_direct.py -k nan",
     "test_reliability.py -k nan"),
    ("readback", "read-back after the write", "direct/readback.py",
     "if not _same(_rows_of(dst), kept, False):", "if False:",
     "the comparison in `ReadBack.verify` (always passes)", "test_proof.py -k read_back"),
    ("readback-full", "the full read-back catches a later write anywhere (issue 62)",
     "direct/readback.py", "if _digest(dst) != kept:", "if False:",
     "the full read-back's final comparison in `ReadBack.verify` (always passes)",
     "test_proof.py -k sealed"),
    ("rollback", "rollback of a failed push", "vllm/worker/transaction.py",
     "self._rewrite(self.served)", "pass",
     "the re-write of the served chain in `roll_back` (the model stays marked undefined)",
     "test_transactions.py -k in_process", "test_transactions.py -k deleted_meanwhile"),
    ("fake-rollback", "rollback of a failed push", "vllm/worker/transaction.py",
     "self._rewrite(self.served)",
     '__import__("weight_bridge.direct.state", fromlist=["_"]).clear_undefined(self.model)',
     "the re-write in `roll_back`, the model marked defined as if it had run",
     "test_transactions.py -k in_process"),
    ("root", "the checkpoint root: paths outside it", "checkpoint/trust.py",
     "if resolved != base and not resolved.is_relative_to(base):", "if False:",
     "the outside-the-root check in `trusted_checkpoint`", "test_trust.py -k leading_out"),
    ("owner", "the checkpoint root: owner and mode", "checkpoint/trust.py",
     "    info = path.stat()\n", "    return\n    info = path.stat()\n",
     "the owner/mode checks (`_check_owned` returns at once)", "test_trust.py -k writable"),
    ("trust-call", "the checkpoint root: every update", "vllm/worker/transaction.py",
     "path = trusted_checkpoint(checkpoint, self.options.checkpoint_root)", "path = checkpoint",
     "the `trusted_checkpoint(...)` call in `PushTransaction._open`",
     "test_serve.py -k must_not_read"),
    ("base", "a partial's or a delta's base version", "vllm/worker/transaction.py",
     "self._check_base(path, base, request.served_version)", "pass",
     "the `_check_base(...)` call in `PushTransaction.prepare`", "test_partial.py -k before_any",
     "test_serve.py -k partial", "test_delta_engine.py -k wrong_base"),
    ("held-reread", "a rollback re-reads the bytes served (issue 37)",
     "vllm/worker/served_chain.py", "return CheckpointReader(self.path, held=self.files)",
     "return CheckpointReader(self.path)",
     "re-reads through the held descriptors (`ServedCheckpoint.reader` reads by name)",
     "test_transport_integrity.py -k reusing_dirpath"),
    ("identity", "a changed served file is refused by name (issue 37)", "checkpoint/held.py",
     "changed = self.identity.differences(self._identity(stamp))", "changed: list[str] = []",
     "the identity check of `HeldFile.check`", "test_transport_integrity.py -k changed_in_place"),
    ("engine-lock", "no writer recycles a file an engine holds (issue 37)", "checkpoint/held.py",
     "            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n", "",
     "the engine's shared lock on each file it holds",
     "test_transport_integrity.py -k another_engine_holds"),
    ("no-rewrite", "nothing written, nothing rewritten (issue 37)", "vllm/outcome.py",
     "return self.written and (", "return (",
     "`PushResult.wrote`'s `written` (a rank that only prepared counts as written)",
     "test_transport_integrity.py -k one_rank"),
    ("compact", "the served chain stays bounded (issue 37)", "vllm/worker/transaction.py",
     "served, _ = compact(chain)", "served = chain", "`compact(...)` in `PushTransaction._serve`",
     "test_transport_integrity.py -k two_hundred and frozen"),
    ("orphans", "a killed run's RAM is removed by the next start (issue 37)",
     "sync/retention.py", "        remove_orphans(ram)\n", "",
     "the `remove_orphans(...)` call of `place` (RAM asked for)",
     "test_transport_integrity.py -k sigkilled"),
    ("trainer-names", "a restarted trainer never reuses a served name (issue 37)",
     "vllm/clients/trainer_api.py",
     "self.rounds = max(self.rounds + 1, unused_step(Path(self.info.directory)))",
     "self.rounds += 1", "`unused_step(...)` in `WeightBridgeTrainer.send_weights`",
     "test_serve.py -k restarted_trainer"),
    ("label", "per-token label/weights agreement", "vllm/core/updates.py",
     "core.set_weight_version(report.version)", "pass",
     "`core.set_weight_version(...)` in `_answered` (the label set with the weights)",
     "test_serve.py -k every_label and None", "test_native_api.py -k labels"),
    ("delta-order", "a delta's indices sorted and without duplicates", "delta/format.py",
     "if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):", "if False:",
     "the strictly-increasing check in `read_delta`", "test_delta.py -k unsorted or duplicate"),
    ("delta-range", "a delta's indices in range", "delta/format.py",
     "if indices.numel() and int(indices[-1]) >= numel:", "if False:",
     "the range check in `read_delta`", "test_delta.py -k out-of-range"),
    ("delta-truncated", "a truncated delta refused", "delta/format.py",
     "if values.numel() != offsets.numel():", "if False:", "the value-count check in `read_delta`",
     "test_delta.py -k values-truncated"),
    ("delta-fingerprint", "a delta's full-tensor fingerprint", "direct/delta.py",
     "if (base + change) % (1 << 64) != want:", "if False:",
     "the fingerprint comparison in `PreparedDelta._fingerprint`", "test_delta.py -k other_bits",
     "test_delta_engine.py -k wrong_base"),
    ("delta-dense-fingerprint", "a dense tensor of a delta is the trainer's tensor",
     "direct/delta.py", "if exact_fingerprint(patch.values) != want:", "if False:",
     "the fingerprint comparison in `PreparedDelta._dense_fingerprint`",
     "test_delta.py -k dense_values"),
    ("delta-shard-sum", "a sharded delta's fingerprint, summed over the ranks", "vllm/outcome.py",
     "if (change - expected) % (1 << 64):", "if False:",
     "the comparison in `shard_fingerprint_problems`", "test_delta_engine.py -k tensor_parallel"),
    ("delta-readback", "every changed element read back", "direct/delta.py",
     "if not all(scatter.landed() for scatter in patch.scatters):", "if False:",
     "the comparison in `PreparedDelta._check`", "test_delta.py -k read_back"),
    ("delta-undo", "a failed delta undone from its pre-images", "direct/delta.py",
     "            undo.undo(self.model)\n        except Exception as failed:",
     "            pass\n        except Exception as failed:",
     "the undo in `PreparedDelta._restore`", "test_delta.py -k fault",
     "test_delta_engine.py -k wrong_base"),
    ("delta-undo-every-writer",
     "a rolled-back delta undoes every writer that ran, its loader's writes too", "direct/undo.py",
     "        if not logs or any(log is None for log in logs):\n            return None",
     "        logs = [log for log in logs if log is not None]\n        if not logs:\n            "
     "return None",
     "the joined undo log of a push's writers None as soon as one writer has none, in "
     "`UndoLog.joined` (the mutant joins the others': a loader's writes are never undone)",
     "test_delta_engine.py -k multiprocess_tensor_parallel"),
    ("undo-every-writer",
     "a write of several writers undoes every writer that ran when a later one fails",
     "direct/writer.py", "        if not ran or state.undefined is not None:", "        if True:",
     "the undo of the writers that ran in `Writers._undo` (the mutant undoes none)",
     "test_delta.py -k loader_write"),
    ("delta-tied-refresh", "a delta refreshes every module that uses a tied weight",
     "direct/delta.py", "for param in sorted({a for p in params for a in aliases.get(p, [p])}):",
     "for param in sorted(params):", "the alias expansion in `_refresh_of`",
     "test_delta_engine.py -k wrong_base"),
    ("delta-dtype", "a delta's values in the dtype the engine holds", "direct/delta.py",
     "elif sp.values.dtype != held:", "elif False:", "the dtype check in `prepare_delta`",
     "test_delta.py -k refusals"),
    ("undefined-fails-fast",
     "an undefined engine ends every request at once on vLLM's own entry points",
     "vllm/core/undefined.py",
     "undefined = core_state(self).undefined  # only ever set on a bridged core",
     "undefined = None",
     "the core's step finishing every request while undefined (`failing_while_undefined`)",
     "test_transactions.py -k roll_back_in_process"),
    ("full-readback-shards", 'readback="full" reads a tensor-parallel shard back whole',
     "vllm/outcome.py", "problems.update(_full_readback_problem(name, int(want, 16), got))", "pass",
     "the engine core summing the shards' read-back fingerprints",
     "test_delta_engine.py -k multiprocess_tensor_parallel"),
    ("base-lineage", "a delta applies only on the weights it was diffed against, not a label",
     "vllm/worker/served_chain.py", "if serving == wanted:", "if True:",
     "the lineage check before any write (`check_lineage`)",
     "test_delta_trainer.py -k two_trainers"),
    ("failed-sync-forgets-dtypes",
     "after a failed sync no file is written in the dtypes an engine reported before",
     "delta/state.py",
     "        self.reference.invalidate()\n        self.engine.forget()",
     "        self.reference.invalidate()", "`DeltaState.failed` forgetting the engine's dtypes",
     "test_delta_trainer.py -k failed_sync_no_file"),
    ("ranks-agree",
     "an engine in the trainer's ranks: every rank's core decides on every rank's answers",
     "vllm/internals/engine_core.py", "    if group is None:\n        return answers",
     "    if True:\n        return answers",
     "the exchange of the cores' answers in `across_engine_ranks` (each rank decides alone)",
     "test_ranks.py -k two_jobs"),
    ("ranks-pre-images", "a push from live tensors rolls back without a file",
     "vllm/worker/transaction.py",
     "store = self.store if self.options.rollback and from_memory else None", "store = None",
     "the pre-images a live push's writer keeps (`pre_images` in `PushTransaction._job`)",
     "test_ranks.py -k two_jobs"),
    ("store-dated", "the host store serves a copy only where the engine holds it (issue 62)",
     "direct/undo.py", "elif self.dated.get(key) != state.writes:", "elif key not in self.dated:",
     "the date check in `HostStore.undo_log` (any copy taken for current)",
     "test_store_currency.py -k layerwise"),
    ("store-every-writer", "every writer dates the host store out (issue 62)",
     "vllm/worker/transaction.py",
     "            if writes and self.result.written:", "            if False:",
     "the write count moved at the end of every writing phase in `PushTransaction.run`",
     "test_store_currency.py"),
    ("ranks-shm-names", "two jobs with an engine in their ranks run on one machine at once",
     "vllm/worker/external_launcher.py",
     '        if os.environ.get("VLLM_DIST_IDENT") == _ENV_IDENT and '
     'os.environ.get("MASTER_PORT"):', "        if False:",
     "the job's name for the CPU worker's shared memory in `naming_shm_by_job`",
     "test_ranks.py -k two_jobs"),
    ("ranks-keep-group",
     "closing an engine in the trainer's ranks keeps the trainer's process group",
     "vllm/internals/engine_client.py",
     "        with _keeping_default_group():\n            stop()", "        stop()",
     "`_keeping_default_group` around the engine core's shutdown", "test_ranks.py -k two_jobs"),
    ("catch-all", "any exception, one outcome: every phase of a worker answers whatever it raised",
     "vllm/worker/transaction.py",
     "        try:\n            return step(*args)\n        except Exception as exc:\n            "
     "return self._failed(phase, exc)", "        return step(*args)",
     "the catch-all of `PushTransaction.run` (a phase's exception propagates)",
     "test_fault_matrix.py -k in_process"),
    ("header", "every header field parsed before the first write", "delta/format.py",
     "            parsed[name] = int(value, 16)",
     "            parsed[name] = int(value, 16) if all(c in '0123456789abcdef' for c in value) "
     "else 0",
     "the check of each recorded fingerprint in `header_fingerprints` (a malformed one passes "
     "prepare)", "test_fault_matrix.py -k in_process"),
    ("route-key",
     "every route the bridge adds checks the API key itself, whatever the middleware order "
     "(issue 56)", "vllm/server/middleware.py",
     "    refused = _refusal(request)\n    if refused is not None:\n        return refused\n", "",
     "the key check in `update_results_route` (left to `require_api_key`, as before)",
     "test_serve_keys.py -k whatever_the_middleware_order",
     "test_serve_keys.py -k answers_nobody_without_the_key"),
    ("route-pause-served",
     "the bridge's pause is served only where vLLM serves /resume, or with a key (issue 56)",
     "vllm/server/middleware.py", "return bool(_keys(request)) or any(", "return True or any(",
     "the dev-mode-or-key condition in `_pause_served`",
     "test_serve_keys.py -k only_where_vllm_serves_resume"),
    ("route-pause-release",
     "a pause no update follows is released after update_timeout_s (issue 56)",
     "vllm/server/middleware.py",
     "released = await release_pause(engine, lambda: pauses.calls == mark)", "released = False",
     "the release in `_release` (the pause holds until someone resumes)",
     "test_serve_keys.py -k nothing_follows", "test_serve_keys.py -k no_update_follows"),
    ("pause-authenticated-follow",
     "only an authenticated call keeps a pause from its release: never OPTIONS nor a refused "
     "call (issue 62)", "vllm/server/middleware.py",
     "    if path in _FOLLOW_A_PAUSE and _checked(request):", "    if path in _FOLLOW_A_PAUSE:",
     "the key-check condition on the calls that follow a pause in `update_results_route`",
     "test_serve_keys.py -k authenticated_call"),
    ("probe-plugin-isolation",
     "the 0.34 gate's probe runs vLLM without the bridge's plugin: a broken bridge is no skip "
     "(issue 62)", "../tools/logprob_probe.py",
     "{name for name in allowed if name not in bridge}", "{name for name in allowed}",
     "the bridge's plugin left out of `VLLM_PLUGINS` in `keep_the_bridge_out`",
     "test_logprob_probe.py -k breaks_every_engine", "test_logprob_probe.py -k every_plugin_but"),
    ("per-rank-fingerprints",
     "weight_mismatches compares every worker's copy and names the rank that differs (issue 56)",
     "vllm/clients/checks.py",
     "held = {rank: worker[name] for rank, worker in enumerate(workers) if name in worker}",
     "held = {0: worker[name] for worker in workers if name in worker}",
     "the per-rank comparison (the mutant keeps the last worker's copy, as the old merge did)",
     "test_scaling.py -k weight_mismatches"),
    ("adapter-cast-then-scale", "an adapter's B cast, then scaled, bit for bit as vLLM loads it "
     "(issue 64)", "direct/adapter_slots.py",
     '    b = b.detach().to(device="cpu", dtype=dtype, copy=True)\n    if scaling != 1:\n'
     "        b *= scaling\n",
     '    b = (b.detach().to(device="cpu", dtype=torch.float32) * scaling).to(dtype)\n',
     "the order in `slot_tensors` (the mutant scales in fp32, then casts)",
     "test_adapter_contract.py"),
    ("adapter-keep", "an update that writes no base weight keeps every adapter resident "
     "(issue 64)", "vllm/worker/transaction.py", "            lora.keep_adapters_once(manager)",
     "            pass", "the keep set when an update is prepared (vLLM's reset then drops them)",
     "test_adapter_engine.py -k refusals"),
    ("adapter-token-labels", "a token an adapter version sampled is labelled with it (issue 64)",
     "vllm/internals/lora.py",
     'original(self, adapter_version(getattr(self, "lora_name", None)) or weight_version)',
     "original(self, weight_version)", "the adapter's version in `labelling_adapter_tokens`",
     "test_adapter_engine.py -k cold_start_reference and float32"),
    ("adapter-base-label", "the engine's label names the base weights, never an adapter "
     "(issue 64)", "vllm/core/adapters.py",
     "        if weight_version in core_state(self).adapters:\n            return\n", "",
     "the guard in `labelling_the_base` (a finish with the adapter's version relabels the base)",
     "test_adapter_engine.py -k cold_start_reference and float32"),
    ("adapter-in-use", "no version leaves its slot while a request computes with it (issue 64)",
     "vllm/core/adapters.py", "    using = requests_with_lora(core, int(retiring))",
     "    using = 0", "the count of requests on the leaving version in `retiring_in_use`",
     "test_adapter_engine.py -k every_entry"),
]
# fmt: on


def _selection(test: str) -> list[str]:
    file, _, expr = test.partition(" -k ")
    return [f"tests/{file}", "-k", expr]


MUTANTS = [
    Mutant(
        name,
        guarantee,
        f"weight_bridge/{file}",
        anchor,
        replacement,
        removed,
        [_selection(t) for t in tests],
    )
    for name, guarantee, file, anchor, replacement, removed, *tests in _ROWS
]


def log(msg: str) -> None:
    print(f"[mutants {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def snapshot(dst: Path) -> Path:
    """Copy the working tree's tracked and untracked (not ignored) files into ``dst``."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in sorted({p for p in listed.split("\0") if p}):
        src = ROOT / rel
        if not src.is_file() and not src.is_symlink():
            continue  # deleted in the working tree, still in the index
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    return dst


def copy_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("CI", None)  # mutants run as on a developer's machine
    return env


def check_imports(copy: Path) -> None:
    """Fail unless this interpreter, in ``copy``, finds the copy's packages (not the editable
    install's, which points at the working tree)."""
    code = (
        "import importlib.util as u\n"
        "for m in ('weight_bridge', 'callbacks'):\n"
        "    print(m, u.find_spec(m).origin)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=copy,
        env=copy_env(copy),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        name, origin = line.split(" ", 1)
        log(f"  {name} imported from {origin}")
        if not Path(origin).resolve().is_relative_to(copy.resolve()):
            sys.exit(f"mutants: {name} is imported from {origin}, not from the copy {copy}")


def apply(mutant: Mutant, copy: Path) -> None:
    path = copy / mutant.file
    text = path.read_text()
    count = text.count(mutant.anchor)
    if count != 1:
        sys.exit(
            f"mutants: {mutant.name}: the anchor {mutant.anchor!r} occurs {count} times in "
            f"{mutant.file} (must be exactly once): update tools/mutants.py"
        )
    path.write_text(text.replace(mutant.anchor, mutant.replacement))


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1] if out.strip() else ""


def pytest(
    copy: Path, args: list[str], basetemp: Path, stop_early: bool = True
) -> tuple[int, list[str], str]:
    """Run pytest in ``copy``; its exit code (``TIMED_OUT``; negative: killed by that signal),
    the ids of the failed and errored tests, its output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    cmd += ["-x"] if stop_early else []
    cmd += [f"--basetemp={basetemp}", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=copy_env(copy), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return TIMED_OUT, [], out.decode(errors="replace") if isinstance(out, bytes) else out
    out = proc.stdout + proc.stderr
    failed = []
    for line in out.splitlines():
        m = re.match(r"(FAILED|ERROR) (.+?::.+?)(?: - .*)?$", line)
        if m:
            failed.append(m[2] + (" (error)" if m[1] == "ERROR" else ""))
    return proc.returncode, failed, out


def shown(args: list[str]) -> str:
    return " ".join(f'"{a}"' if " " in a else a for a in args)


def pytest_retrying(copy: Path, args: list[str], basetemp: Path, **kw) -> tuple:
    """:func:`pytest`, run again (up to ``ATTEMPTS`` in all) while a signal kills it."""
    for attempt in range(1, ATTEMPTS + 1):
        started = time.monotonic()
        rc, failed, out = pytest(copy, args, basetemp.with_name(f"{basetemp.name}-{attempt}"), **kw)
        took = time.monotonic() - started
        shown_args = shown(args) if len(args) < 6 else f"{len(args)} tests"
        log(f"  pytest {shown_args}: exit {rc} in {took:.0f} s: {last_line(out)}")
        if rc >= 0:
            break
        log(f"  killed by signal {-rc} (the OOM killer?): attempt {attempt} of {ATTEMPTS}")
        time.sleep(30)
    return rc, failed, out


def run_mutant(mutant: Mutant, work: Path, clean: Path, n: int) -> None:
    copy = work / f"mutant-{n}-{mutant.name}"
    shutil.copytree(clean, copy, symlinks=True)
    apply(mutant, copy)
    check_imports(copy)
    for args in mutant.selections:
        rc, failed, out = pytest_retrying(copy, args, work / f"tmp-{n}-{len(mutant.ran)}")
        mutant.ran.append(shown(args))
        if rc == 1 and failed:
            why = [ln for ln in out.splitlines() if ln.startswith("E ")]
            why = why if len(why) <= 6 else [*why[:3], "E ...", *why[-3:]]
            for line in why or ["(no assertion line)"]:  # why it failed, as pytest says it
                log(f"    {line[:300]}")
            mutant.caught_by = failed
            mutant.outcome = "caught by " + ", ".join(f"`{f}`" for f in failed)
            return
        if rc == TIMED_OUT:
            mutant.outcome = f"TIMEOUT after {TIMEOUT_S} s (`{shown(args)}`)"
            return
        if rc < 0:
            mutant.outcome = f"UNDECIDED: killed by signal {-rc} {ATTEMPTS} times"
            return
        if rc == 5:
            sys.exit(f"mutants: {mutant.name}: `{shown(args)}` selects no test: update it")
        if rc != 0:
            sys.stderr.write(out[-6000:])
            sys.exit(f"mutants: {mutant.name}: pytest {shown(args)} exited {rc}")
    mutant.outcome = "NOT CAUGHT"


def control(mutants: list[Mutant], work: Path, clean: Path) -> str:
    """Every test that caught a mutant, once more on the unmutated copy: each must pass."""
    ids = sorted({c.removesuffix(" (error)") for m in mutants for c in m.caught_by})
    if not ids:
        return "no test caught a mutant, nothing to control"
    log(f"control: {len(ids)} tests on the unmutated copy")
    started = time.monotonic()
    rc, failed, out = pytest_retrying(clean, ids, work / "tmp-control", stop_early=False)
    took = time.monotonic() - started
    if rc == 0:
        return f"the catching tests ({len(ids)}) pass on the unmutated copy ({took:.0f} s)"
    if rc != 1 or not failed:  # killed, timed out, or no test's verdict
        for m in mutants:
            m.outcome += " (control undecided)" if m.caught_by else ""
        return f"the control run on the unmutated copy exited {rc}: {last_line(out)}"
    broken = {f.removesuffix(" (error)") for f in failed}
    for m in mutants:
        if any(c.removesuffix(" (error)") in broken for c in m.caught_by):
            m.outcome += " (INVALID: fails unmutated too)"
    return "the control run on the unmutated copy FAILED: " + ", ".join(failed)


def table(mutants: list[Mutant]) -> str:
    rows = ["| guarantee | file | what is removed | tests run | result |", "|---|---|---|---|---|"]
    for m in mutants:
        tests = "; ".join(f"`{t}`" for t in m.ran)
        rows.append(f"| {m.guarantee} | `{m.file}` | {m.removed} | {tests} | {m.outcome} |")
    return "\n".join(rows)


def write_doc(section: str) -> None:
    """Replace the ``## Mutants`` section of docs/tests.md (wherever it is) by ``section``, at
    the end; nothing else in the file changes."""
    text = DOC.read_text()
    start = text.find(f"\n{HEADING}\n")
    if start != -1:
        end = text.find("\n## ", start + 1)
        text = text[:start] + ("\n" + text[end + 1 :] if end != -1 else "\n")
    DOC.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTANTS])
    parser.add_argument("--check", action="store_true", help="apply each mutant, run nothing")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/tests.md alone")
    parser.add_argument("--keep", action="store_true", help="keep the copies (for debugging)")
    opts = parser.parse_args()
    mutants = [m for m in MUTANTS if not opts.only or m.name in opts.only]

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="weight-bridge-mutants-"))
    try:
        log(f"copying the working tree into {work}")
        clean = snapshot(work / "clean")
        check_imports(clean)
        for n, mutant in enumerate(mutants):
            log(f"{mutant.name}: {mutant.file}: {mutant.anchor!r} -> {mutant.replacement!r}")
            if opts.check:
                copy = work / f"check-{n}"
                shutil.copytree(clean, copy, symlinks=True)
                apply(mutant, copy)
                continue
            run_mutant(mutant, work, clean, n)
            log(f"{mutant.name}: {mutant.outcome}")
        if opts.check:
            log(f"all {len(mutants)} anchors found exactly once")
            return
        note = control(mutants, work, clean)
    finally:
        if opts.keep:
            log(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    minutes = (time.monotonic() - began) / 60
    intro = (
        "`make mutants` (`tools/mutants.py`, not part of `make test`) removes each guarantee's "
        "code in turn, in a copy of the tree, and runs that guarantee's tests (each selection "
        "in order until one fails); each removal must make a test fail. The tests that caught "
        "a mutant then run on the unmutated copy and must pass."
    )
    section = "\n".join(
        [
            HEADING,
            "",
            textwrap.fill(intro, 99),
            "",
            table(mutants),
            "",
            f"Last run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {minutes:.0f} min; "
            f"{note}.",
        ]
    )
    print(section)
    if not opts.no_docs and not opts.only:
        write_doc(section)
        log(f"wrote the {HEADING!r} section of {DOC.relative_to(ROOT)}")
    doubtful = ("INVALID", "undecided")
    missed = [m.name for m in mutants if not m.caught_by or any(w in m.outcome for w in doubtful)]
    if missed:
        sys.exit(f"mutants: not caught: {', '.join(missed)}")


if __name__ == "__main__":
    main()
