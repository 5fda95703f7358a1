"""The engine's start-up self-check of static-shape decode steps (`graphs.checked_decode_mode`), on CPU.

`decode_steps="static"` runs the step CUDA graphs capture, without capture, so the check and its
fallback to eager steps run here as they would on a GPU; `test_gpu.py` runs the captured check.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

from engine_support import greedy_and_sampled
from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import Engine
from training.utils.deploy.graphs import DecodeSteps, fallback_warning, measure_step_mismatch, relative_tolerance
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100], [42, 43, 44]]
MAX_TOKENS = [12, 7, 20, 5]
PERTURBED_TOKEN, PERTURBATION = 7, 3.0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = tiny_config(260)
    config.initializer_range = 0.3  # peaked logits: clear argmax gaps, as in test_deploy.py
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model.eval(), tokenizer


def serve(model, tokenizer, decode_steps: str):
    """Greedy and seeded sampled completions of PROMPTS through one engine; returns (greedy, sampled, stats)."""
    cfg = DeploymentConfig(max_batch_requests=4, decode_steps=decode_steps)
    return greedy_and_sampled(model, tokenizer, cfg, PROMPTS, MAX_TOKENS, sampled_rows=2, sampled_tokens=10)


@pytest.fixture(scope="module")
def eager_outputs(tiny):
    greedy, sampled, stats = serve(*tiny, "eager")
    assert "graph_replays" not in stats  # no DecodeSteps
    return [c.output_ids for (c,) in greedy], [c.output_ids for (c,) in sampled]


def engine_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("training")]


def perturbed_step(original):
    """`DecodeSteps.step` with PERTURBATION added to one token's logit."""

    def step(self, batch, tokens_B):
        logits = original(self, batch, tokens_B).clone()
        logits[:, PERTURBED_TOKEN] += PERTURBATION
        return logits

    return step


def test_static_step_passes_the_check_and_the_engine_keeps_it(tiny, eager_outputs, caplog):
    model, tok = tiny
    diff, scale = measure_step_mismatch(model, capture=False)
    # float32: the same logits up to reduction order (the static step attends over 64 columns).
    assert diff < 1e-5 * scale and diff <= relative_tolerance(torch.float32) * scale
    with caplog.at_level(logging.INFO, logger="training"):
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(max_batch_requests=4, decode_steps="static"))
        try:
            assert isinstance(engine._steps, DecodeSteps)
            # The check used a batch and steps of its own: the engine starts as if it had not run.
            assert engine._batch is None and engine._rows == []
            assert engine.stats == dict.fromkeys(
                ["requests", "output_tokens", "decode_steps", "prefills", "weight_updates", "graph_captures",
                 "graph_replays", "prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens", "prefill_time_s",
                 "decode_time_s"], 0)
        finally:
            engine.close()
    assert engine_warnings(caplog) == []
    assert any("static decode steps passed the start-up self-check" in r.getMessage() for r in caplog.records)

    greedy, sampled, stats = serve(model, tok, "static")
    assert "graph_replays" in stats and stats["decode_steps"] > 0  # served by the static steps
    assert [c.output_ids for (c,) in greedy] == eager_outputs[0]
    assert [c.output_ids for (c,) in sampled] == eager_outputs[1]


def test_a_bfloat16_static_step_passes_the_check_within_bf16_rounding(tiny, caplog):
    """bf16 rounding differs between the two steps (~4e-3 of the logit scale here), well within 3.1e-2."""
    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    diff, scale = measure_step_mismatch(bf16, capture=False)
    assert 0 < diff <= relative_tolerance(torch.bfloat16) * scale / 2
    with caplog.at_level(logging.WARNING, logger="training"):
        engine = Engine(bf16, tok, DeploymentConfig(decode_steps="static"))
        engine.close()
    assert isinstance(engine._steps, DecodeSteps) and engine_warnings(caplog) == []


def _raise(self, batch, tokens_B):
    raise RuntimeError("injected failure of the static step")


def _nan(self, batch, tokens_B):
    return torch.full((batch.rows, self.model.config.vocab_size), float("nan"))


@pytest.mark.parametrize(
    "fault, cause",
    [
        ("raise", "the static decode step raised RuntimeError('injected failure of the static step')"),
        ("perturb", "the static decode step's logits differ from the eager step's on the same inputs"),
        ("nan", "max |log-softmax difference| nan > tolerance"),
    ],
)
def test_a_failing_static_step_falls_back_to_eager_with_one_warning(tiny, eager_outputs, monkeypatch, caplog,
                                                                    fault, cause):
    model, tok = tiny
    step = {"raise": _raise, "nan": _nan, "perturb": perturbed_step(DecodeSteps.step)}[fault]
    monkeypatch.setattr(DecodeSteps, "step", step)
    with caplog.at_level(logging.WARNING, logger="training"):
        greedy, sampled, stats = serve(model, tok, "static")
    (warning,) = engine_warnings(caplog)
    assert cause in warning
    assert warning.startswith("deployment.decode_steps='static' could not be honoured: ")
    assert "The engine runs eager decode steps instead" in warning and "deployment.decode_steps='eager'" in warning
    assert "graph_replays" not in stats  # eager steps: the engine holds no DecodeSteps
    assert [c.output_ids for (c,) in greedy] == eager_outputs[0]
    assert [c.output_ids for (c,) in sampled] == eager_outputs[1]


def test_the_warning_for_a_perturbed_step_reports_the_measured_difference(tiny, monkeypatch, caplog):
    model, tok = tiny
    monkeypatch.setattr(DecodeSteps, "step", perturbed_step(DecodeSteps.step))
    diff, scale = measure_step_mismatch(model, capture=False)
    with caplog.at_level(logging.WARNING, logger="training"):
        Engine(copy.deepcopy(model), tok, DeploymentConfig(decode_steps="static")).close()
    (warning,) = engine_warnings(caplog)
    reported = re.search(r"max \|log-softmax difference\| (\S+) > tolerance (\S+) \((\S+) x", warning)
    assert reported is not None, warning
    reported_diff, reported_tolerance, relative = (float(x) for x in reported.groups())
    # Adding c to one logit moves that token's log-softmax by c - d and every other by -d, where
    # d = log(1 + p (e^c - 1)) is in (0, c): the largest move is between c/2 and c.
    assert PERTURBATION / 2 <= reported_diff <= PERTURBATION + 1e-4
    assert reported_diff == pytest.approx(diff, rel=1e-2)
    assert relative == 1e-4  # float32
    assert reported_tolerance == pytest.approx(1e-4 * scale, rel=1e-2) and reported_tolerance < 1e-2


def test_the_warning_says_whether_the_mode_was_chosen_or_asked_for():
    auto = fallback_warning("graphs", "auto", "the graphs decode step raised X")
    assert auto.startswith("deployment.decode_steps='auto' chose 'graphs' decode steps, but the graphs decode step")
    explicit = fallback_warning("graphs", "graphs", "the graphs decode step raised X")
    assert explicit.startswith("deployment.decode_steps='graphs' could not be honoured: the graphs decode step")
    for warning in (auto, explicit):
        assert "deployment.decode_steps='eager'" in warning and "'static'" in warning


def test_eager_and_auto_on_cpu_run_no_check(tiny, monkeypatch, caplog):
    model, tok = tiny
    monkeypatch.setattr(DecodeSteps, "step", _raise)  # a check would fail, and warn
    with caplog.at_level(logging.INFO, logger="training"):
        for mode in ("eager", "auto"):  # auto is eager on CPU
            engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(decode_steps=mode))
            engine.close()
            assert engine._steps is None
    assert not [r for r in caplog.records if "self-check" in r.getMessage()]
