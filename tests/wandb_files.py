"""W&B's run files read back with their own record format (LevelDB log blocks of wandb's protobuf records), not
through this project's code: for the tests of --use_wandb and of the trackers that must log what W&B logs."""
from __future__ import annotations

import json
import struct


def wandb_records(path: str):
    """Every protobuf record of a .wandb file: a 7-byte header, then 32 KiB blocks of (crc32, length, type) framed
    chunks (type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_history_and_config(path: str) -> tuple[dict[int, dict], dict]:
    """({step: {key: value}}, {config key: value}) of one .wandb file (W&B's own "_" keys left out)."""
    history: dict[int, dict] = {}
    config: dict = {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(rec.history.step.num, {}).update({k: v for k, v in items.items()
                                                                 if not k.startswith("_")})
        elif kind in ("config", "run"):  # the run record carries the config given to wandb.init
            for i in (rec.config if kind == "config" else rec.run.config).update:
                if not (i.key or i.nested_key[0]).startswith("_"):  # W&B's own "_wandb"
                    config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return history, config
