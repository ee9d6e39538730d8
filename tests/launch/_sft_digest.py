"""launch/sft.py without its two slow endings on CPU, for test_launchers.py's launcher-equivalence test.

The final dist checkpoint and the HF export (a converter subprocess) cost more than the training itself at this
size. Instead every rank hashes its own weight shards after the last step; rank 0 writes ``digest.json``
({rank: sha256}) beside ``train_result.json`` in --save_path. Same shards on every rank is the same export."""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.runtime import checkpoint  # noqa: E402
from rlhf.supervised import sft
from rlhf.supervised import loop as trainer
from rlhf.runtime.checkpoint import Checkpointer  # noqa: E402


def digest_instead_of_export(args, engine, mesh, extra) -> None:
    h = hashlib.sha256()
    for name, p in engine.model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digests: list = [None] * mesh.world_size
    dist.all_gather_object(digests, h.hexdigest())
    if mesh.is_rank0:
        os.makedirs(args.save_path, exist_ok=True)
        with open(os.path.join(args.save_path, "digest.json"), "w") as f:
            json.dump(dict(enumerate(digests)), f, indent=1)


if __name__ == "__main__":
    checkpoint.export_hf = digest_instead_of_export
    Checkpointer.save = lambda self, *a, **k: None
    sys.exit(trainer.main(sft, sys.argv[1:]))
