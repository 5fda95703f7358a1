"""Run files an adversary rewrites with their checksums (F4 of issue #62, from outside any sandbox, without the run
key): a signed checkpoint whose files and `checksums.json` were rewritten, stripped of its signature, or moved
away from its key is refused by name; a dataset whose rows were rewritten under their ids refuses the resume; and
weights replaced between a disk sync's write and the server's load (F3) stop the run at the probe after the sync."""

import asyncio
import copy
import hashlib
import json
import logging
import stat

import numpy as np
import pytest

from engine_support import deployed
from test_checkpoint_integrity import (
    CHECKPOINT_LOG,
    checkpoint_dir,
    flip_bytes,
    fresh_trainer,
    resume,
    same_weights,
    train_one_step,
    weights,
)
from training.examples.rl.blackbox_agent import make_data
from training.utils.config.rl import RLConfig, TrainerConfig
from training.utils.errors import CheckpointError, ConfigError, DeploymentError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.rl.resume import check_resumable, run_settings
from training.utils.rl.startup import SERVED_GAP_LIMIT, check_served_weights, sync_deployment
from training.utils.run_files.checkpoint import MANIFEST_FILE, save_checkpoint, verify_checkpoint
from training.utils.run_files.run_key import KEY_FILE
from training.utils.trainer import Trainer


@pytest.fixture
def run(tmp_path):
    """A run with signed checkpoints at steps 2 and 4; the weights each one holds."""
    policy, rng, saved = fresh_trainer(), np.random.default_rng(1), {}
    for step in (2, 4):
        train_one_step(policy)
        save_checkpoint(tmp_path, step, policy=policy, progress={"step": step}, np_rng=rng)
        saved[step] = weights(policy)
    return tmp_path, saved


def rewrite_checksums(log_path, step, *, keep_signature: bool = True) -> None:
    """What an adversary with write access does after changing a file: the manifest's hashes made to match again."""
    directory = checkpoint_dir(log_path, step)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        entry |= {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if not keep_signature:
        del manifest["hmac"]
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def warnings_of(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_run_key_is_private_and_signs_every_manifest(run):
    log_path, _ = run
    key = log_path / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(bytes.fromhex(key.read_text())) == 32
    for step in (2, 4):
        assert len(json.loads((checkpoint_dir(log_path, step) / MANIFEST_FILE).read_text())["hmac"]) == 64
        assert verify_checkpoint(checkpoint_dir(log_path, step)) is None


@pytest.mark.parametrize("keep_signature", [True, False])
def test_files_rewritten_with_their_checksums_are_refused_by_name(run, caplog, keep_signature):
    log_path, saved = run
    flip_bytes(log_path, 4)
    rewrite_checksums(log_path, 4, keep_signature=keep_signature)
    manifest = checkpoint_dir(log_path, 4) / MANIFEST_FILE
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path)
    assert progress == {"step": 2} and same_weights(policy, saved[2])  # the tampered one never loads
    expected = "does not carry this run's signature" if keep_signature else "is not signed, though this run signs"
    assert f"{manifest} {expected}" in warnings_of(caplog) and "falling back" in warnings_of(caplog)
    flip_bytes(log_path, 2)
    rewrite_checksums(log_path, 2, keep_signature=keep_signature)
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be loaded: .*step-00000004.*"
                                              "step-00000002"):
        resume(log_path)


def test_a_checkpoint_away_from_its_run_key_is_refused_unless_allowed(run, caplog):
    log_path, saved = run
    (log_path / KEY_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"is signed, but its run's key {log_path / KEY_FILE} is missing"):
        resume(log_path)
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path, allow_unverified_checkpoint=True)
    assert progress == {"step": 4} and same_weights(policy, saved[4])
    assert "loading it anyway, as allow_unverified_checkpoint asks" in warnings_of(caplog)


def test_rows_rewritten_under_their_ids_refuse_the_resume():
    cfg = RLConfig(model="tiny-random")
    rows = make_data.make_rows(8, seed=0, split="train")
    model = {"model": "m", "model_architecture": "a", "model_weights": "w"}
    recorded = run_settings(cfg, rows, "async_rl_loop", model)
    tampered = [row | {"answer": "0"} for row in rows]  # every answer rewritten, ids kept
    assert [r["id"] for r in tampered] == [r["id"] for r in rows]
    with pytest.raises(ConfigError, match=r"cannot resume the checkpoint at step 3: dataset_digest was '[0-9a-f]{16}', "
                                          r"now '[0-9a-f]{16}'\. The dataset's rows changed since it was written"):
        check_resumable({"step": 3, "settings": recorded}, run_settings(cfg, tampered, "async_rl_loop", model))
    check_resumable({"step": 3, "settings": recorded}, run_settings(cfg, rows, "async_rl_loop", model))


class Inline:
    """The trainer worker's `run`, in this thread."""

    async def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def test_weights_replaced_between_a_disk_sync_and_the_load_stop_the_run():
    torch_model, tokenizer = load_model_and_tokenizer("tiny-random")
    policy = Trainer(torch_model, TrainerConfig(learning_rate=1e-3))
    planted = copy.deepcopy(policy.model)
    for parameter in planted.parameters():  # the attacker's weights: the run's, every one doubled
        parameter.data *= 2.0

    async def scenario():
        async with deployed(policy.model, tokenizer, weight_sync="disk") as deployment:
            await sync_deployment(deployment, Inline(), policy, 1)  # the pushed weights served: the probe passes
            honest = await check_served_weights(deployment, Inline(), policy, 1)
            await deployment.weight_sync.sync(planted.state_dict(), version=2)  # what the server loaded instead
            with pytest.raises(DeploymentError) as refused:
                await check_served_weights(deployment, Inline(), policy, 2)
            return honest, str(refused.value)

    honest, message = asyncio.run(scenario())
    assert honest < SERVED_GAP_LIMIT / 5
    assert "after the weight sync to version 2, the deployment's logprobs differ from the trainer's by" in message
    assert "it does not serve the weights just written to" in message
