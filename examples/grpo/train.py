"""GRPO with live weight sync: a colocated vLLM engine always samples from the freshest policy.

Run it (from the repository root; a few minutes on 2 CPU cores, nothing is downloaded)::

    python examples/grpo/train.py fit --config examples/grpo/config.yaml
    # push every 4 steps instead of every step (rollouts up to 3 steps stale):
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/sync_every_4.yaml
    # no sync at all: the engine keeps the initial policy and the logprob gap grows
    python examples/grpo/train.py fit --config examples/grpo/config.yaml \\
        --config examples/grpo/sync_off.yaml

Features:
    - Model: a tiny seeded Llama (``weight_bridge.models.build_tiny_model``) written to
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
    - Sync off: with the callback disabled (``enabled: false`` or ``WEIGHT_BRIDGE_SYNC=0``) the
      module starts its own engine once and never pushes to it, so rollouts come from the initial
      policy: the off-policy demonstration.
    - Progress: the progress bar shows reward, logprob gap, policy version and push time; at the
      end ``reward.png`` (reward and gap against step) and ``summary.json`` are written into
      ``run_dir`` and their paths, with the last pushed checkpoint's, are printed.
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

import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

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


class PromptBatches(Dataset):
    """Item ``i`` is step ``i``'s batch of prompt digits (seeded, so runs are reproducible)."""

    def __init__(self, steps: int, prompts_per_step: int, seed: int):
        self.steps, self.n, self.seed = steps, prompts_per_step, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, 10, (self.n,), generator=gen)


class GRPO(pl.LightningModule):
    """GRPO on a tiny local model; rollouts from the colocated vLLM engine.

    Args:
        model_dir: the initial policy; built with the model factory if missing.
        arch, size, init_seed: what the factory builds there.
        task: ``count``, ``repeat`` or ``next`` (see :class:`DigitTask`).
        prompts_per_step: prompts (groups) per step.
        group_size: completions sampled per prompt (G).
        max_new_tokens: completion length (EOS is ignored so every completion has this length).
        lr: AdamW learning rate.
        clip_eps: PPO ratio clip.
        adv_eps: added to the group's reward std.
        kl_coef: weight of the k3 KL to the frozen initial model (0 disables it and the copy).
        entropy_coef: weight of an entropy bonus on the completion tokens' distributions.
        digit_credit: reward per non-target digit token (0: only the right digit counts).
        strict_on_policy: raise when a rollout's version is not the last pushed step.
        run_dir: where ``reward.png`` and ``summary.json`` go.
        data_seed: seed of the prompt stream.
    """

    def __init__(
        self,
        model_dir: str = "runs/grpo/policy-init",
        arch: str = "llama",
        size: str = "1m",
        init_seed: int = 0,
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
        run_dir: str = "runs/grpo",
        data_seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForCausalLM

        from weight_bridge.models import build_tiny_model

        path = Path(model_dir)
        if not (path / "config.json").exists():
            # Before fit, so the callback's setup finds it when it starts the engine.
            build_tiny_model(path, arch=arch, size=size, seed=init_seed)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.train()
        self.ref_model = None
        if kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ref.requires_grad_(False)
            object.__setattr__(self, "ref_model", ref)  # not a submodule: never saved or pushed
        self.task = DigitTask(path, task, digit_credit)
        self.vllm_engine: Any = None  # set by VLLMWeightSync.setup (None when it is disabled)
        self._own_engine: Any = None
        self.history: list[dict[str, Any]] = []
        self._started = time.perf_counter()
        self._last_step_at: float | None = None

    # -- data / optimiser ----------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        steps = self.trainer.max_steps if self.trainer.max_steps > 0 else 1000
        data = PromptBatches(steps, self.hparams.prompts_per_step, self.hparams.data_seed)
        return DataLoader(data, batch_size=None, shuffle=False, num_workers=0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=0.0)

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
            from weight_bridge.vllm import ColocatedEngine

            cb = self._sync_callback()
            kwargs = dict(getattr(cb, "engine_kwargs", None) or DEFAULT_ENGINE_KWARGS)
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

    def _token_logprobs(
        self, model: Any, ids: torch.Tensor, prompt_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of the completion tokens, and the entropies of their distributions."""
        logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1), entropy

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        from weight_bridge.vllm import token_prompts

        hp = self.hparams
        step = self.global_step
        now = time.perf_counter()
        step_s = now - self._last_step_at if self._last_step_at is not None else 0.0
        self._last_step_at = now
        digits = [int(d) for d in batch.tolist()]
        prompts = [self.task.prompt(d) for d in digits]
        params = SamplingParams(
            n=hp.group_size,
            temperature=1.0,
            top_p=1.0,
            max_tokens=hp.max_new_tokens,
            ignore_eos=True,
            logprobs=0,  # the sampled token's own log-probability
        )
        started = time.perf_counter()
        outputs = self._engine().generate(token_prompts(prompts), params)
        gen_s = time.perf_counter() - started

        # Which policy produced these rollouts, and is it the one last pushed?
        cb = self._sync_callback()
        synced = self.vllm_engine is not None
        versions = {o.policy_version for o in outputs}
        if len(versions) != 1:
            raise RuntimeError(f"rollouts of one step came from several policies: {versions}")
        version = versions.pop()
        if synced and hp.strict_on_policy and version != getattr(cb, "last_pushed_step", version):
            raise RuntimeError(
                f"step {step}: rollouts used policy version {version}, "
                f"but the last pushed step is {cb.last_pushed_step}"
            )
        version = 0 if version is None else int(version)  # never pushed: the initial policy
        staleness = step - version
        every = getattr(cb, "every_n_train_steps", None) if synced else None
        bounded = hp.strict_on_policy and every and not getattr(cb, "at_steps", None)
        if bounded and staleness > every - 1:
            raise RuntimeError(f"step {step}: staleness {staleness} > {every - 1}")

        seqs, old_lp, rewards = [], [], []
        for out, d, prompt in zip(outputs, digits, prompts, strict=True):
            for c in out.outputs:
                tokens = list(c.token_ids)
                seqs.append(prompt + tokens)
                old_lp.append([lp[t].logprob for lp, t in zip(c.logprobs, tokens, strict=True)])
                rewards.append(self.task.reward(d, tokens))
        ids = torch.tensor(seqs, device=self.device)
        old = torch.tensor(old_lp, dtype=torch.float32, device=self.device)
        r = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        groups = r.view(len(prompts), hp.group_size)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + hp.adv_eps)
        adv = adv.reshape(-1, 1)

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
        self.log_dict(metrics, prog_bar=True, on_step=True, batch_size=len(seqs))
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
            batch_size=len(seqs),
        )
        self.history.append({"step": step, **metrics, "generate_s": gen_s, "synced": synced})
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
        synced = bool(self.history[-1]["synced"])
        summary = {
            "steps": len(self.history),
            "reward_first20": sum(rewards[:k]) / k,
            "reward_last20": sum(rewards[-k:]) / k,
            "logprob_gap_mean": sum(gaps) / len(gaps),
            "logprob_gap_max": max(gaps),
            "logprob_gap_last20": sum(gaps[-k:]) / k,
            "staleness_max": max(h["staleness"] for h in self.history),
            "generate_s_mean": sum(h["generate_s"] for h in self.history) / len(self.history),
            "wall_s": time.perf_counter() - self._started,
            "sync": {
                "enabled": synced,
                "every_n_train_steps": getattr(cb, "every_n_train_steps", None) if synced else None,
                "at_steps": getattr(cb, "at_steps", None) if synced else None,
            },
            "last_checkpoint": str(getattr(cb, "last_checkpoint", None) or ""),
            "plot": str(run_dir / "reward.png"),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot(steps, rewards, gaps, run_dir / "reward.png", summary)
        print(
            f"\nGRPO: {summary['steps']} steps, reward first 20 {summary['reward_first20']:.3f}"
            f" -> last 20 {summary['reward_last20']:.3f}, mean logprob gap"
            f" {summary['logprob_gap_mean']:.2e}, max staleness {summary['staleness_max']:.0f}"
        )
        print(f"reward plot:     {run_dir / 'reward.png'}")
        print(f"summary:         {run_dir / 'summary.json'}")
        print(f"last checkpoint: {summary['last_checkpoint'] or '(none: weight sync was off)'}")


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

    # The progress bar carries push time and policy version; one push line per 50 steps is plenty.
    if not any(isinstance(f, _ThinSyncLog) for f in rank_zero.log.filters):
        rank_zero.log.addFilter(_ThinSyncLog(every=50))
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
