"""W&B without an API key: offline run files in the run directory, holding the logged metrics."""

import struct

import pytest

from training.utils.run_files.logging import RunLogger

# An offline `.wandb` file: a 7-byte header (":W&B", magic, version), then the LevelDB log format: 32 KiB blocks of
# chunks, each a 7-byte header (crc32, little-endian u16 length, type) and its bytes; a record is one FULL chunk or
# FIRST, MIDDLE…, LAST; a block's last < 7 bytes are padding. Each record is a `wandb.proto` `Record`.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4


def wandb_records(path):
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", 7
    while offset + CHUNK_HEADER <= len(data):
        if BLOCK - offset % BLOCK < CHUNK_HEADER:
            offset += BLOCK - offset % BLOCK
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        pending += data[offset + CHUNK_HEADER:offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_without_a_key_metrics_land_in_offline_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # a second guard: never the network, whatever the library decides
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = RunLogger(tmp_path / "run", wandb_project="tests", progress=False, config={"seed": 7})
    logger.log(1, {"train/loss": 0.5, "rollout/raw_reward": 0.25})
    logger.log(2, {"train/loss": 0.75, "rollout/raw_reward": 0.5, "note": "text stays out of W&B"})
    logger.close()

    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    history = [{item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
               for record in wandb_records(log_file) if record.HasField("history")]
    by_step = {int(row["_step"]): row for row in history}
    assert by_step[2]["train/loss"] == "0.75" and by_step[2]["rollout/raw_reward"] == "0.5"
    assert by_step[1]["train/loss"] == "0.5" and "note" not in by_step[2]
