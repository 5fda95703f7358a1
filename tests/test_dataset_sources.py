"""Where rows come from: a list, a Hugging Face `datasets.Dataset`, or a `.jsonl`, `.json` or `.parquet` file."""

import json
import sys

import pytest

from test_recipes_shared import shim_like_factory
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig
from training.utils.errors import ConfigError
from training.utils.rl.dataset import write_jsonl
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.rl.startup import read_rows
from training.utils.run_files.logging import read_ledger

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
    with pytest.raises(ConfigError, match=r"rows.json: element 1 of its array is a number; every row must be a JSON "
                                          r"object"):
        rows_of(tmp_path / "rows.json")


def dataset_file(tmp_path, name, lines):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD_LINE = json.dumps(ROWS[0]).encode()


@pytest.mark.parametrize("bad_line, problem", [
    (b'{"id": "r1", "prompt": "caf\xe9"}', r"is not UTF-8 text \(byte 28 of the line is 0xe9\)"),
    (b'{"id": "r1"} {"id": "r2"}', r"is not one JSON value: Extra data \(column 14\)"),
    (b'["r1", [1, 2]]', r"holds an array, not an object; each line must be one row object"),
    (b'"r1"', r"holds a string, not an object"),
], ids=["latin-1", "two values", "array", "string"])
def test_a_malformed_line_in_a_jsonl_dataset_is_named_by_file_and_line(tmp_path, bad_line, problem):
    # The blank line counts: the bad one is line 4 of the file, though only the 3rd row.
    path = dataset_file(tmp_path, "rows.jsonl", [GOOD_LINE, b"", GOOD_LINE, bad_line, GOOD_LINE])
    with pytest.raises(ConfigError, match=rf"{path} line 4 {problem}"):
        rows_of(path)


def test_a_malformed_json_array_names_the_line(tmp_path):
    path = dataset_file(tmp_path, "rows.json", [b"[", GOOD_LINE + b",", b'{"id": "r1",}', b"]"])
    with pytest.raises(ConfigError, match=rf"dataset file {path} line 3 column 13 is not JSON: Expecting property "
                                          "name"):
        rows_of(path)
    path = dataset_file(tmp_path, "latin.json", [b"[", GOOD_LINE + b",", b'{"id": "caf\xe9"}', b"]"])
    with pytest.raises(ConfigError, match=rf"dataset file {path} line 3 is not UTF-8 text"):
        rows_of(path)


def completion_factory(setup):
    async def rollout_fn(row, sample_index):
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                      reward=float(sample_index))

    return rollout_fn


def test_duplicate_row_ids_are_named_once_at_start_up(tmp_path, caplog):
    """Rows 0 and 2 share "a", rows 1, 3 and 4 share "b"; an id-less row whose place is "7" meets a row whose id
    is 7. The run trains all of them, and says so once."""
    rows = [{"id": "a", "prompt_token_ids": [1, 40, 50]}, {"id": "b", "prompt_token_ids": [1, 41, 50]},
            {"id": "a", "prompt_token_ids": [1, 42, 50]}, {"id": "b", "prompt_token_ids": [1, 43, 50]},
            {"id": "b", "prompt_token_ids": [1, 44, 50]}, {"id": "c", "prompt_token_ids": [1, 45, 50]},
            {"id": 7, "prompt_token_ids": [1, 46, 50]}, {"prompt_token_ids": [1, 47, 50]}]
    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=4, max_steps=2,
                         log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False)
    with caplog.at_level("WARNING", logger="training"):
        summary = rl_loop.main(cfg, rollout_fn_factory=completion_factory, rows=rows)
    warnings = [r.getMessage() for r in caplog.records if "row ids are shared" in r.getMessage()]
    assert warnings == ["3 row ids are shared by several rows: 'a' (2 rows), 'b' (3 rows), '7' (2 rows). Each row "
                        "still trains on its own, but the ledger (batch/row_ids) cannot tell them apart; give every "
                        "row a unique `id`"]
    trained = [i for r in read_ledger(summary["ledger"]) if "train/loss" in r for i in r["batch/row_ids"]]
    assert sorted(trained) == ["7", "7", "a", "a", "b", "b", "b", "c"]


def test_a_dataset_with_splits_asks_for_one_split():
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(ConfigError, match=r"rows is a DatasetDict; pass a sequence of dict rows .* one split: "
                                          r"rows=dataset\['train'\]"):
        read_rows(rl_loop.Config(), splits)
