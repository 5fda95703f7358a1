"""reasoning-gym's procedural datasets as a training task: `main(cfg, **from_reasoning_gym(...))`.

    pip install -e ".[reasoning-gym]"

One dataset by name, several, or a weighted mix (reasoning-gym's own `CompositeDataset`, which picks each item's
dataset by weight). Each question is rendered with the policy's chat template under a system prompt asking for
the answer in `<answer>` tags (reasoning-gym's own default prompt), sampled token-in/token-out, and scored by
the dataset's own `score_answer` on the tagged answer, as reasoning-gym's evaluations do. Each run's reward is
also recorded under `reward/<dataset>`, so the step metrics hold `rollout/reward/<dataset>` and the evaluation
`eval/reward/<dataset>`: the accuracy of each dataset of a mix.

The held-out rows come from the same generators under another seed, with every question that also appears among
the training rows removed from the training rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from training.environments.episodes import call_in_worker, checked_reward, empty_episode
from training.utils.errors import ConfigError
from training.utils.rl.evaluation import rollout_evaluation
from training.utils.rl.rollout.types import RolloutRun, RolloutSetup, sample_from_completion

ENV = "reasoning-gym"
EVAL_SEED_OFFSET = 1_000_003
"""The held-out rows' seed is the training seed plus this: another stream of the same generators."""


def _import_reasoning_gym():
    try:
        import reasoning_gym
        import reasoning_gym.composite
        import reasoning_gym.utils
    except ImportError as e:
        raise ConfigError('from_reasoning_gym needs the reasoning-gym package: pip install -e ".[reasoning-gym]" '
                          f"({e})") from None
    return reasoning_gym


def _weights(datasets: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    if isinstance(datasets, str):
        datasets = [datasets]
    weights = dict(datasets) if isinstance(datasets, Mapping) else dict.fromkeys(datasets, 1.0)
    if not weights:
        raise ConfigError("from_reasoning_gym needs at least one dataset name")
    for name, weight in weights.items():
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"from_reasoning_gym: the weight of dataset {name!r} is {weight!r}; it must be > 0")
    return weights


def build_dataset(datasets: str | Sequence[str] | Mapping[str, float], *, size: int, seed: int,
                  configs: Mapping[str, dict] | None = None):
    """reasoning-gym's dataset of `size` items: the one named, or its `CompositeDataset` over several."""
    rg = _import_reasoning_gym()
    weights, configs = _weights(datasets), dict(configs or {})
    unknown = sorted(set(weights) - set(rg.factory.DATASETS)) + sorted(set(configs) - set(weights))
    if unknown:
        raise ConfigError(f"from_reasoning_gym: unknown dataset(s) {unknown}; reasoning-gym has "
                          f"{len(rg.factory.DATASETS)} (reasoning_gym.factory.DATASETS), configs name only "
                          "datasets that are used")
    try:
        if len(weights) == 1:
            (name,) = weights
            return rg.create_dataset(name, size=size, seed=seed, **configs.get(name, {}))
        composite = rg.composite
        specs = [composite.DatasetSpec(name=name, weight=float(w), config=dict(configs.get(name, {})))
                 for name, w in weights.items()]
        return composite.CompositeDataset(composite.CompositeConfig(size=size, seed=seed, datasets=specs))
    except (AssertionError, TypeError, ValueError) as e:  # reasoning-gym validates its configs with asserts
        raise ConfigError(f"from_reasoning_gym: reasoning-gym refused the configs {configs}: "
                          f"{type(e).__name__}: {e}") from None


def _rows(dataset, split: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The rows `main()` trains on (JSON values only) and each row's reasoning-gym entry, by row id."""
    rows, entries = [], {}
    for index in range(len(dataset)):
        entry = dataset[index]
        name = entry["metadata"].get("source_dataset", "")
        row_id = f"{split}/{name}/{index}"
        rows.append({"id": row_id, "dataset": name, "question": entry["question"], "answer": str(entry["answer"])})
        entries[row_id] = entry
    return rows, entries


def from_reasoning_gym(
    datasets: str | Sequence[str] | Mapping[str, float],
    *,
    configs: Mapping[str, dict] | None = None,
    size: int = 512,
    eval_size: int = 64,
    seed: int = 0,
    system_prompt: str | None = None,
    eval_samples_per_row: int = 1,
    answer_from: Literal["tags", "completion"] = "tags",
    score_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """`rollout_fn_factory`, `rows` and `evaluation_fn` for `main()`, from reasoning-gym datasets by name.

    `datasets`: a name (`"leg_counting"`), a list of names (equal weights) or `{name: weight}`; `configs`: each
    dataset's own config fields (`{"basic_arithmetic": {"max_terms": 2}}`); `size`/`eval_size`: training and
    held-out items, generated from `seed` and another seed; `system_prompt`: default reasoning-gym's own
    (`reasoning_gym.utils.SYSTEM_PROMPTS["default"]`), `""` for none; `answer_from`: what the scorer gets, the
    last `<answer>` tag's content (`"tags"`, reasoning-gym's convention; None without one) or the whole reply
    stripped (`"completion"`, for a model too small to learn the tags: the scorers' partial credit for a reply
    that contains the answer then rewards a shorter reply); a scorer call past `score_timeout_s` drops its draw.
    Sampling settings are the config's (`cfg.sampling`)."""
    rg = _import_reasoning_gym()
    if answer_from not in ("tags", "completion"):
        raise ConfigError(f"from_reasoning_gym: answer_from={answer_from!r}; it must be 'tags' or 'completion'")
    if size < 1 or eval_size < 0:
        raise ConfigError(f"from_reasoning_gym: size={size} must be >= 1 and eval_size={eval_size} >= 0")
    train_set = build_dataset(datasets, size=size, seed=seed, configs=configs)
    rows, entries = _rows(train_set, "train")
    scorers = {"train": train_set.score_answer}
    eval_rows: list[dict[str, Any]] = []
    if eval_size:
        eval_set = build_dataset(datasets, size=eval_size, seed=seed + EVAL_SEED_OFFSET, configs=configs)
        eval_rows, eval_entries = _rows(eval_set, "eval")
        entries |= eval_entries
        scorers["eval"] = eval_set.score_answer
        held_out = {row["question"] for row in eval_rows}
        rows = [row for row in rows if row["question"] not in held_out]
        if not rows:
            raise ConfigError(f"from_reasoning_gym: every training question of {datasets!r} is also held out; "
                              "the generator's space is too small for size + eval_size")
    prompt = rg.utils.SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt

    def make_rollout_fn(setup: RolloutSetup):
        sampler, sample_kwargs, tokenizer = setup.sampler, setup.sample_kwargs, setup.tokenizer

        async def rollout_fn(row: dict) -> RolloutRun:
            entry = entries[row["id"]]
            messages = [{"role": "system", "content": prompt}] if prompt else []
            text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": entry["question"]}],
                                                 tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            (completion,) = await sampler.sample(prompt_ids, **sample_kwargs)
            if not completion.output_ids:
                raise empty_episode(ENV, row["id"], "the model returned no tokens")
            answer = (rg.utils.extract_answer(completion.text) if answer_from == "tags"
                      else completion.text.strip())
            env = f"{ENV}:{row['dataset']}"
            score = await call_in_worker(scorers[row["id"].split("/", 1)[0]], answer, entry, env=env,
                                         task_id=row["id"], timeout_s=score_timeout_s)
            reward = checked_reward(score, env=env, task_id=row["id"])
            sample = sample_from_completion(prompt_ids, completion.output_ids, completion.logprobs, reward=reward,
                                            finish_reason=completion.finish_reason, text=completion.text,
                                            output_versions=completion.versions)
            return RolloutRun([sample], metadata={f"reward/{row['dataset']}": reward, "answer": answer})

        return rollout_fn

    out: dict[str, Any] = {"rollout_fn_factory": make_rollout_fn, "rows": rows}
    if eval_rows:
        out["evaluation_fn"] = rollout_evaluation(make_rollout_fn, eval_rows, samples_per_row=eval_samples_per_row)
    return out
