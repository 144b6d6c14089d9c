"""Read back what an offline W&B run logged (its run-<id>.wandb file), with wandb's own protobuf and no network.

The file is wandb's LevelDB-style datastore: a 7-byte header, then 32 KiB blocks of records
`crc32c(4) | length uint16 LE (2) | type (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST)`; each payload is a `Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (2, 3):
            continue
        record = pb.Record()
        record.ParseFromString(buf)
        yield record


def history(path: Path) -> list[dict]:
    """Every logged row: {metric: value}."""
    rows = []
    for r in _records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in r.history.item})
    return rows


def run_ids(path: Path) -> set[str]:
    return {r.run.run_id for r in _records(path) if r.WhichOneof("record_type") == "run"}


def summary(path: Path) -> dict:
    """The run summary as last updated: {key: value}."""
    out = {}
    for r in _records(path):
        if r.WhichOneof("record_type") == "summary":
            for it in r.summary.update:
                out[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return out
