"""Worker for test_lora_sft.py (2 ranks, TP2): load a LoRA SFT checkpoint, write the trained model's logits
(adapters unmerged) and a PEFT adapter folder from it.

    torchrun --nproc_per_node 2 tests/train/_lora_export_worker.py PRETRAIN CKPT_DIR ROLE OUT_DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.runtime.checkpoint import Checkpointer  # noqa: E402
from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.distributed.mesh import destroy_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole  # noqa: E402
from rlhf.models.lora import LoraConfig, save_peft_adapter  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel  # noqa: E402


def main():
    pretrain, ckpt, role, out = sys.argv[1:5]
    torch.set_num_threads(1)
    mesh = initialize_mesh(2, 1)
    eng = ModelRole(mesh, pretrain, lora=LoraConfig(rank=8, alpha=16.0), name=role)
    Checkpointer(mesh, ckpt).load({role: eng})
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48]])
    logits = gather_vocab_parallel(eng.forward([{"input_ids": ids}])[0]["output"])[..., : eng.spec.vocab_size]
    save_peft_adapter(eng, mesh, os.path.join(out, "adapter"), base_model=pretrain)
    if mesh.is_rank0:
        torch.save({"ids": ids, "logits": logits}, os.path.join(out, "logits.pt"))
    destroy_mesh()


if __name__ == "__main__":
    main()
