"""Run health: each step's metrics checked against the RL runbook's red flags.

Every flag is warned once, with the setting to change, and listed in the run's summary
(docs/metrics.md: run health). The flags name RL settings, so this lives with the recipes' pieces,
not in the generic run telemetry of `training.utils.run_files.logging`.
"""

from __future__ import annotations

import logging
from typing import Any

from training.utils.run_files.logging import is_finite_number

log = logging.getLogger("training")


class RunHealth:
    """Checks each step's metrics against the red flags; warns once per flag with the lever to pull.

    A flag that needs a trend (`patience` consecutive steps, or a window of rewards) only fires
    once the trend holds, so one noisy step does not raise it. `summary()` lists every flag
    raised, the step it first fired and how many steps it held.
    """

    LEVERS = {
        "entropy_collapse": "policy entropy collapsed: lower trainer.learning_rate, raise sampling.temperature, "
                            "add kl_beta or set entropy_coef",
        "reward_zero_std": "most groups have identical rewards, so their advantages are 0 and they teach nothing: "
                           "make the task easier or harder, raise completions_per_prompt, or drop such groups "
                           "with dynamic_filter_fn",
        "clipfrac_high": "more than 30% of tokens hit the PPO clip: lower trainer.learning_rate or ppo_epochs, "
                         "or raise ppo_minibatches",
        "ratio_far_from_1": "the importance ratio is far from 1 (the policy moved a lot within a batch): lower "
                            "trainer.learning_rate or ppo_epochs",
        "sampler_trainer_gap": "sampler and trainer logprobs disagree on the same weights (mean |π_old − μ| > 0.1 "
                               "nats): keep sampling.top_p=1 and top_k=0, match the engine's dtype to the "
                               "trainer's, and correct what remains with tis",
        "offpolicy_gap": "samples are far off-policy (mean |π_old − μ| > 0.3 nats, the policy moved a lot since "
                         "they were drawn): lower max_head_offpolicy_versions or trainer.learning_rate, and keep tis "
                         "on (the async recipe's default when max_head_offpolicy_versions >= 1)",
        "length_capped": "most responses stop at the length cap: raise sampling.max_tokens or penalise overlong "
                         "responses in the reward",
        "reward_flat": "the reward has not moved over the last 10 steps: check the reward function and "
                       "frac_reward_zero_std, or raise trainer.learning_rate",
        "trainer_idle": "the trainer waits for rollouts more than half the time: raise "
                        "max_head_offpolicy_versions, max_concurrency_rollout_sample or pipeline_chunks_per_step, "
                        "or make rollouts faster",
        "nonfinite_steps": "optimizer steps were skipped for a non-finite gradient: lower trainer.learning_rate "
                           "and check the scale of rewards",
        "groups_filtered": "dynamic_filter_fn rejected most groups, so steps wait for rows and train few: make the "
                           "task fit the policy (rewards that differ within a group), raise completions_per_prompt, "
                           "or loosen the filter",
        "ref_kl_runaway": "the policy is running away from the reference (train/ref_kl above ref_kl_limit nats per "
                          "token): lower trainer.learning_rate, raise kl_beta, use kl_estimator='k3' (k1 in the loss "
                          "has no expected gradient toward π_ref), or set kl_target so that β adapts",
    }

    def __init__(self, *, patience: int = 3, reward_window: int = 10, ref_kl_limit: float = 1.0):
        self.patience = patience
        self.reward_window = reward_window
        self.ref_kl_limit = ref_kl_limit
        """Nats per trained token of `train/ref_kl` (the k3 KL to the reference) past which the run is running away."""
        self.first_step: dict[str, int] = {}
        self.steps_held: dict[str, int] = {}
        self._streak: dict[str, int] = {}
        self._rewards: list[float] = []
        self._first_entropy: float | None = None
        self._skipped = 0.0

    def check(self, step: int, metrics: dict[str, Any]) -> list[str]:
        """Evaluate every flag on this step's metrics; returns the flags that fired for the first time."""
        m = {k: v for k, v in metrics.items() if is_finite_number(v)}
        if "train/entropy" in m and self._first_entropy is None:
            self._first_entropy = m["train/entropy"]
        if "rollout/raw_reward" in m:
            self._rewards.append(m["rollout/raw_reward"])
        recent = self._rewards[-self.reward_window:]
        gap = m.get("rollout/sampler_trainer_logprob_diff", 0.0)
        # How many versions old the trained samples were: per token where the sampler reported versions, else
        # per group (a server that reports none, vLLM's /v1/completions, gives every token -1: unknown, never
        # "fresh"); rl_loop logs neither and is on-policy.
        offset = m.get("async/token_version_offset_mean", m.get("async/version_offset_mean", 0.0))
        fresh = offset == 0
        filtered = m.get("rollout/groups_filtered", 0.0)
        settled = m.get("rollout/groups_accepted", 0.0) + m.get("rollout/groups_rejected", 0.0)
        conditions = {
            "entropy_collapse": "train/entropy" in m and self._first_entropy is not None
            and m["train/entropy"] < 0.1 * self._first_entropy,
            "reward_zero_std": m.get("rollout/frac_reward_zero_std", 0.0) >= 0.9,
            "clipfrac_high": m.get("train/pg_clipfrac", 0.0) > 0.3,
            "ratio_far_from_1": "train/ratio_mean" in m
            and (abs(m["train/ratio_mean"] - 1.0) > 0.2 or m.get("train/ratio_max", 1.0) > 10.0),
            # Tokens drawn by older weights add the policy's own change to the gap (~0.15 nats per
            # step in the README's main job): only the gap of fresh tokens is a sampler/trainer mismatch.
            "sampler_trainer_gap": fresh and gap > 0.1,
            "offpolicy_gap": not fresh and gap > 0.3,
            "length_capped": m.get("rollout/truncated_frac", 0.0) > 0.5,
            "reward_flat": len(recent) == self.reward_window and max(recent) - min(recent) < 1e-3,
            "trainer_idle": m.get("perf/trainer_idle_frac", 0.0) > 0.5,
            "nonfinite_steps": m.get("train/skipped_steps_total", self._skipped) > self._skipped,
            "ref_kl_runaway": m.get("train/ref_kl", 0.0) > self.ref_kl_limit,
            "groups_filtered": filtered > 0.5 * settled,
        }
        self._skipped = m.get("train/skipped_steps_total", self._skipped)
        # Trends need `patience` steps in a row; the rest are decisive at once.
        needs_patience = {"reward_zero_std", "length_capped", "trainer_idle", "sampler_trainer_gap", "offpolicy_gap",
                          "ref_kl_runaway"}
        fired = []
        for name, holds in conditions.items():
            self._streak[name] = self._streak.get(name, 0) + 1 if holds else 0
            if not holds or self._streak[name] < (self.patience if name in needs_patience else 1):
                continue
            self.steps_held[name] = self.steps_held.get(name, 0) + 1
            if name not in self.first_step:
                self.first_step[name] = step
                fired.append(name)
                detail = f"{filtered:.0f} of {settled:.0f} groups filtered by dynamic_filter_fn; " \
                    if name == "groups_filtered" else ""
                log.warning("run health, step %d: %s%s", step, detail, self.LEVERS[name])
        return fired

    def summary(self) -> dict[str, Any]:
        """Flags raised in the run: first step, steps held, and the lever."""
        return {
            name: {"first_step": self.first_step[name], "steps": self.steps_held[name], "lever": self.LEVERS[name]}
            for name in self.first_step
        }

    def report(self) -> None:
        """Log `summary_text()` at the end of a run: a warning if any flag fired."""
        (log.warning if self.first_step else log.info)(self.summary_text())

    def summary_text(self) -> str:
        if not self.first_step:
            return "run health: no red flags"
        lines = [f"run health: {len(self.first_step)} red flag(s)"]
        for name, info in self.summary().items():
            lines.append(f"  {name} (from step {info['first_step']}, {info['steps']} steps): {info['lever']}")
        return "\n".join(lines)
