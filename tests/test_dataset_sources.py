"""Where rows come from: a list, a Hugging Face `datasets.Dataset`, or a `.jsonl`, `.json` or `.parquet` file."""

import json
import sys

import pytest

from test_recipes_shared import shim_like_factory
from training.recipes import async_rl_loop, rl_loop
from training.utils.config import SamplingConfig
from training.utils.errors import ConfigError
from training.utils.logging import read_ledger
from training.utils.rl.dataset import write_jsonl
from training.utils.rl.startup import read_rows

# Nested values and non-ASCII text, which every format must give back as they were.
ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60], "answer": {"text": f"é{i}", "value": i}}
        for i in range(4)]


def rows_of(path):
    return read_rows(rl_loop.Config(dataset_path=str(path)), None)


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_a_hugging_face_dataset_trains_its_rows(tmp_path, recipe):
    datasets = pytest.importorskip("datasets")
    extra = {"max_head_offpolicy_versions": 0} if recipe is async_rl_loop else {}
    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=4, max_steps=1,
                        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False, **extra)
    summary = recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=datasets.Dataset.from_list(ROWS))
    (step,) = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert sorted(step["batch/row_ids"]) == ["r0", "r1", "r2", "r3"]


def test_a_dataset_and_any_sequence_of_dicts_become_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    cfg = rl_loop.Config()
    assert read_rows(cfg, datasets.Dataset.from_list(ROWS)) == ROWS
    assert read_rows(cfg, tuple(ROWS)) == ROWS
    assert read_rows(cfg, (row for row in ROWS)) == ROWS


def test_jsonl_json_and_parquet_files_give_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=2))
    datasets.Dataset.from_list(ROWS).to_json(tmp_path / "lines.json")  # JSON lines, under a .json name
    datasets.Dataset.from_list(ROWS).to_parquet(tmp_path / "rows.parquet")
    for name in ("rows.jsonl", "array.json", "lines.json", "rows.parquet"):
        assert rows_of(tmp_path / name) == ROWS, name


def test_an_unknown_extension_names_the_path_and_the_accepted_ones(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("id,prompt\nr0,hi\n")
    with pytest.raises(ConfigError, match=rf"dataset file {path} has extension '.csv'; accepted: .jsonl, .json, "
                                          r"\.parquet"):
        rows_of(path)


def test_a_json_file_that_is_neither_an_array_nor_lines_is_named(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": ROWS}, indent=2))
    with pytest.raises(ConfigError, match=rf"{path} line 1 is not one JSON value: Expecting property name"):
        rows_of(path)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` fail
    path = tmp_path / "rows.parquet"
    with pytest.raises(ConfigError, match=rf"reading the Parquet file {path} needs pyarrow, which is not installed: "
                                          r"pip install pyarrow"):
        rows_of(path)


def test_a_row_that_is_not_a_dict_is_named_before_the_model_loads(tmp_path):
    # A model that would fail to load (offline: a path, not a Hub id), so the rows must be refused first.
    cfg = rl_loop.Config(model=str(tmp_path / "no-model"), log_path=str(tmp_path / "run"), progress=False)
    with pytest.raises(ConfigError, match=r"rows\[1\] is str; every dataset row must be a dict"):
        rl_loop.main(cfg, rollout_fn_factory=shim_like_factory, rows=[ROWS[0], "r1"])
    (tmp_path / "rows.json").write_text(json.dumps([ROWS[0], 7]))
    with pytest.raises(ConfigError, match=r"rows\[1\] is int; every dataset row must be a dict"):
        rows_of(tmp_path / "rows.json")


def test_a_dataset_with_splits_asks_for_one_split():
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(ConfigError, match=r"rows is a DatasetDict; pass a sequence of dict rows .* one split: "
                                          r"rows=dataset\['train'\]"):
        read_rows(rl_loop.Config(), splits)
