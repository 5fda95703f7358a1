"""`rollout.py`/`train.py` pairs written with the Fireworks cookbook's names and calls run here as written, on the tiny
random model: each test writes its own pair (the cookbook's code is not copied) and runs `python train.py`."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.utils.deploy.completion import Completion
from training.utils.deploy.sampled_completion import SampledCompletion, sample_arguments
from training.utils.errors import RolloutContractError
from training.utils.rl.health import RunHealth
from training.utils.rl.rollout.invoke import run_draw
from training.utils.rl.rollout.types import RolloutSample, make_prompt_group, validate_run
from training.utils.run_files.logging import read_ledger

ROOT = Path(__file__).resolve().parents[1]

SINGLE_TURN_ROLLOUT = '''
from training import build_deployment_sampler
from training.utils.rl.rollout import RolloutRun, RolloutSample


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)

    async def rollout_fn(sample_prompt, rollout_idx):
        completions = await sampler.sample_with_prompt_tokens(sample_prompt["prompt_token_ids"], n=1,
                                                              **sample_kwargs)
        completion = completions[0]
        prompt_len = int(completion.prompt_len)
        tokens = list(completion.full_tokens)
        logprobs = list(completion.sampling_logprobs)
        if getattr(completion, "logprobs_echoed", False):
            logprobs = logprobs[prompt_len:]
        reward = float(rollout_idx) if sample_prompt["varies"] else 1.0
        sample = RolloutSample(tokens=tokens, logprobs=[0.0] * prompt_len + logprobs,
                               loss_mask=[0] * prompt_len + [1] * (len(tokens) - prompt_len), reward=reward,
                               finish_reason=completion.finish_reason, text=completion.text,
                               routing_matrices=completion.routing_matrices, prompt_model_input=None)
        return RolloutRun(segments=[sample])

    return rollout_fn
'''

SINGLE_TURN_TRAIN = '''
import json
import sys

from rollout import make_rollout_fn
from training.recipes.async_rl_loop import Config, main
from training.utils import DeployConfig, TrainerConfig, WandBConfig

evaluated = []


async def evaluation_fn(step, rollout_fn):
    run = await rollout_fn({"prompt_token_ids": [5, 6, 7], "varies": True}, rollout_idx=0)
    evaluated.append(step)
    return {"reward": run.segments[0].reward}


if __name__ == "__main__":
    log_path, export = sys.argv[1:]
    cfg = Config(
        log_path=log_path, base_model="tiny-random", learning_rate=1e-4, completions_per_prompt=2,
        prompt_groups_per_step=2, max_completion_tokens=4, temperature=1.0, lora_rank=0, grad_clip_norm=0.0,
        dcp_save_interval=2, weight_sync_interval=2, output_model_id=export, max_head_offpolicy_versions=1,
        trainer=TrainerConfig(training_shape_id="accounts/fireworks/trainingShapes/qwen3-8b-128k"),
        deployment=DeployConfig(tokenizer_model="tiny-random", sample_timeout=120),
        wandb=WandBConfig(entity="", project="single-turn"),
    )
    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 2, 3 + i], "varies": i % 2 == 0} for i in range(8)]
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows,
                   dynamic_filter_fn=lambda pg: len(set(pg.rewards)) > 1, evaluation_fn=evaluation_fn,
                   evaluation_interval=2)
    print(json.dumps({"steps": summary["steps"], "evaluated": evaluated, "ledger": summary["ledger"],
                      "checkpoint": summary["checkpoint"], "sampling_timeout": cfg.sampling.timeout_s}))
'''

MULTI_TURN_ROLLOUT = '''
import json

from training import build_deployment_sampler
from training.utils.rl.rollout import MessageTrajectoryAssembler, RolloutSample, TITOTokenizer


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)
    record = setup.extras["record"]

    async def rollout_fn(sample_prompt, sample_index):
        assembler = MessageTrajectoryAssembler(TITOTokenizer(setup.tokenizer, chat_template_kwargs={}))
        messages = list(sample_prompt["messages"])
        prompts, sampled = [], 0
        for turn in range(2):
            prompt_tokens = assembler.prepare_next_input(messages)
            kwargs = dict(sample_kwargs)
            completions = await sampler._do_one_completion(prompt_tokens, kwargs.pop("max_tokens"),
                                                           kwargs.pop("temperature"), None, True, False, False,
                                                           **kwargs)
            completion = completions[0]
            output_tokens = list(completion.full_tokens[completion.prompt_len:])
            text = completion.text or setup.tokenizer.decode(output_tokens)
            assistant = {"role": "assistant", "content": text}
            assembler.add_assistant_response(
                request_messages=messages, assistant_message=assistant, prompt_token_ids=prompt_tokens,
                completion_token_ids=output_tokens, completion_logprobs=list(completion.inference_logprobs),
                finish_reason=completion.finish_reason)
            prompts.append(prompt_tokens)
            sampled += len(output_tokens)
            messages = messages + [assistant, {"role": "user", "content": "Try once more."}]
        tokens, logprobs, loss_mask = assembler.trajectory.to_flat()
        with open(record, "a") as f:
            f.write(json.dumps({"tokens": tokens, "loss_mask": loss_mask, "prompts": prompts, "sampled": sampled,
                                "model": setup.model, "has_key": bool(setup.api_key),
                                "tokenizer_id": setup.tokenizer_id}) + "\\n")
        return RolloutSample(tokens=tokens, logprobs=logprobs, loss_mask=loss_mask, reward=float(sample_index))

    return rollout_fn
'''

MULTI_TURN_TRAIN = '''
import sys

from rollout import make_rollout_fn
from training.recipes.async_rl_loop import Config, main
from training.utils import DeployConfig, InfraConfig, WandBConfig

if __name__ == "__main__":
    log_path, record = sys.argv[1:]
    cfg = Config(log_path=log_path, base_model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2,
                 max_completion_tokens=3, kl_beta=0.01, ppo_n_minibatches=2, synchronous_training=True,
                 infra=InfraConfig(training_shape_id=None), deployment=DeployConfig(tokenizer_model="tiny-random"),
                 wandb=WandBConfig(entity="", project="mt"))
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]} for i in range(4)]
    main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows, rollout_extras={"record": record})
'''

RL_LOOP_TRAIN = '''
import json
import sys

from training.recipes import rl_loop
from training.recipes.rl_loop import Config, main
from training.utils import DeployConfig

CALLS = sys.argv[2]


def reward_fn(completion: str, row: dict) -> float:
    with open(CALLS, "a") as f:
        f.write(json.dumps({"completion": completion, "row": row["id"]}) + "\\n")
    return float(len(completion) % 2)


rl_loop.reward_fn = reward_fn

if __name__ == "__main__":
    cfg = Config(log_path=sys.argv[1], base_model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2,
                 max_completion_tokens=6, deployment=DeployConfig(tokenizer_model="tiny-random"))
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Say {i}."}]} for i in range(4)]
    summary = main(cfg, rows=rows)
    print(json.dumps({"steps": summary["steps"], "ledger": summary["ledger"]}))
'''


def run_pair(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train.py", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_a_single_turn_pair_with_the_cookbooks_names_and_the_seed_pages_settings(tmp_path):
    done = run_pair(tmp_path, {"rollout.py": SINGLE_TURN_ROLLOUT, "train.py": SINGLE_TURN_TRAIN},
                    str(tmp_path / "run"), str(tmp_path / "export"))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    records = read_ledger(result["ledger"])
    steps = [r for r in records if "train/loss" in r]
    # The seed page's filter: the rows whose two draws score alike are filtered, the other four train. How many of
    # the four alike rows settle before the run's last batch fills depends on timing (the async recipe keeps
    # sampling while it trains), so the count is bounded, not fixed.
    assert 0 < sum(r["rollout/groups_filtered"] for r in steps) <= 4
    assert sorted(row for r in steps for row in r["batch/row_ids"]) == ["r0", "r2", "r4", "r6"]
    assert "filtered" in done.stderr and "groups" in done.stderr  # the step line says so
    # evaluation_fn(step, rollout_fn) before the first step and every evaluation_interval=2 steps (the last).
    assert result["steps"] == 2 and result["evaluated"] == [0, 2]
    assert [r["eval/reward"] for r in records if "eval/reward" in r] == [0.0, 0.0]
    # dcp_save_interval=2: a checkpoint at step 2; output_model_id: the exported model; sample_timeout.
    assert result["checkpoint"].endswith("step-00000002")
    assert (tmp_path / "export" / "config.json").is_file()
    assert result["sampling_timeout"] == 120.0
    # weight_sync_interval=2: one sync, after step 2 (version 2 served at the end).
    assert [r["async/weights_version"] for r in steps] == [0.0, 2.0]
    assert "trainer.training_shape_id='accounts/fireworks/trainingShapes/qwen3-8b-128k'" in done.stderr


def test_a_multi_turn_pair_with_the_cookbooks_assembler(tmp_path):
    record = tmp_path / "draws.jsonl"
    run_pair(tmp_path, {"rollout.py": MULTI_TURN_ROLLOUT, "train.py": MULTI_TURN_TRAIN}, str(tmp_path / "run"),
             str(record))
    draws = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(draws) == 8  # 4 rows x 2 draws, synchronous
    for draw in draws:
        first, second = draw["prompts"]
        tokens, mask = draw["tokens"], draw["loss_mask"]
        # The second prompt extends the first turn's sampled ids; only sampled ids are trained.
        assert second[:len(first)] == first and tokens[:len(second)] == second
        assert sum(mask) == draw["sampled"] and mask[:len(first)] == [0] * len(first)
        assert (draw["model"], draw["has_key"], draw["tokenizer_id"]) == ("tiny-random", True, "tiny-random")


def test_rl_loop_main_with_only_a_config_and_a_module_level_reward_fn(tmp_path):
    calls = tmp_path / "calls.jsonl"
    done = run_pair(tmp_path, {"train.py": RL_LOOP_TRAIN}, str(tmp_path / "run"), str(calls))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    scored = [json.loads(line) for line in calls.read_text().splitlines()]
    assert result["steps"] == 2
    assert sorted({c["row"] for c in scored}) == ["q0", "q1", "q2", "q3"] and len(scored) == 16
    steps = [r for r in read_ledger(result["ledger"]) if "rollout/raw_reward" in r]
    rewards = [float(len(c["completion"]) % 2) for c in scored]
    assert sum(r["rollout/raw_reward"] for r in steps) == pytest.approx(sum(rewards) / 8)
    # As the cookbook's rl_loop: groups of one reward are skipped (`should_accept`).
    assert sum(r["rollout/groups_filtered"] for r in steps) == sum(
        len({float(len(c["completion"]) % 2) for c in scored if c["row"] == row}) == 1 for row in ["q0", "q1", "q2",
                                                                                                   "q3"])


def test_the_run_health_flag_says_how_many_groups_the_filter_took(caplog):
    health = RunHealth()
    assert health.check(1, {"rollout/groups_accepted": 1.0, "rollout/groups_rejected": 7.0,
                            "rollout/groups_filtered": 7.0}) == ["groups_filtered"]
    assert "7 of 8 groups filtered by dynamic_filter_fn" in caplog.text
    assert RunHealth().check(1, {"rollout/groups_accepted": 4.0, "rollout/groups_rejected": 4.0,
                                 "rollout/groups_filtered": 4.0}) == []


def test_a_rollout_reading_the_wrong_contract_gets_its_row_its_draw_and_the_name_to_use():
    async def rollout_fn(row):
        completion = Completion([5], [-0.1], "stop", [0], prompt_ids=[1, 2])  # what sampler.sample() returns
        return completion.full_tokens

    with pytest.raises(AttributeError, match=r"'full_tokens'; .*sample_with_prompt_tokens") as raised:
        asyncio.run(run_draw(rollout_fn, {}, {}, (), row_id="r7", draw_index=3, vocab_size=None, timeout_s=5))
    assert raised.value.__notes__ == ["raised by rollout_fn on row 'r7' draw 3"]
    with pytest.raises(AttributeError, match="advantages are computed where the group trains"):
        getattr(make_prompt_group("r7", []), "advantages")  # noqa: B009


def test_the_cookbooks_sampler_arguments_are_mapped_or_refused_by_name():
    assert sample_arguments({"max_tokens": 8, "http_timeout": 30, "logprobs": True, "echo": False,
                             "include_routing_matrix": True, "max_seq_len": 4096}) == {"max_tokens": 8, "timeout": 30}
    with pytest.raises(TypeError, match="unknown keyword argument 'best_of'"):
        sample_arguments({"best_of": 2})
    with pytest.raises(TypeError, match="text-only"):
        sample_arguments({"images": ["data:image/png;base64,AAAA"]})
    sampled = SampledCompletion(Completion([7, 8], [-0.5, -0.25], "length", [3, 3], text="hi"), [1, 2, 3])
    assert (sampled.full_tokens, sampled.prompt_len, sampled.inference_logprobs, sampled.logprobs_echoed) == (
        [1, 2, 3, 7, 8], 3, [-0.5, -0.25], False)


def test_routing_matrices_and_a_multimodal_prompt_are_accepted_empty_and_refused_with_a_value():
    def sample(**extra):
        return RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], reward=1.0, **extra)

    assert validate_run(sample(routing_matrices=[], prompt_model_input=None), row_id="r1", draw_index=0,
                        vocab_size=10).segments[0].routing_matrices == []
    with pytest.raises(RolloutContractError, match="row 'r1' draw 2 segment 0: routing_matrices holds 1 entries"):
        validate_run(sample(routing_matrices=["AAAA"]), row_id="r1", draw_index=2, vocab_size=10)
    with pytest.raises(RolloutContractError, match="row 'r1' draw 1 segment 0: prompt_model_input is set"):
        validate_run(sample(prompt_model_input={"chunks": []}), row_id="r1", draw_index=1, vocab_size=10)
