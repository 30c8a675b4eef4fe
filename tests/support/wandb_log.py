"""Read back an offline wandb run (``run-<id>.wandb``): its history rows, for tests.

wandb 0.31 writes the run's records, protobuf ``wandb_internal_pb2.Record``s, into a LevelDB-format log (the W&B
"transaction log"): a 7-byte header (``:W&B``, the magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each
``crc32c (4) | length (2, little endian) | type (1)`` followed by its bytes; types FULL = 1, FIRST = 2,
MIDDLE = 3, LAST = 4 assemble one record (LevelDB's ``doc/log_format.md``). The SDK no longer ships a Python
reader, so this is one, without the CRC check.
"""

import json
import struct
from pathlib import Path

HEADER = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list:
    """Every record of a ``.wandb`` file, parsed as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    records, pending, offset = [], b"", HEADER
    while offset + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's tail is padding
            offset += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + CHUNK_HEADER])
        chunk = data[offset + CHUNK_HEADER : offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            offset += BLOCK - offset % BLOCK if offset % BLOCK else 0
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_rows(path: str | Path) -> list[dict]:
    """The run's ``run.log`` rows as ``{key: value}`` (values decoded from their JSON)."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
