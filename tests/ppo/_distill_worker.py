"""launch/ppo.py's body under torchrun with each rank's first distillation step saved (the batch the teacher read and
the advantages it gave) to ``$RLHF_TEST_DISTILL_DUMP/rank<r>.pt``, for tests/ppo/test_distill.py's TP 2 / PP 2 check."""
import os
import sys

import torch

import rlhf.ppo.distill as distill

_orig = distill.add_distill_advantages


def _spy(exp, cfg, mesh):
    m = _orig(exp, cfg, mesh)
    path = os.path.join(os.environ["RLHF_TEST_DISTILL_DUMP"], f"rank{mesh.rank}.pt")
    if not os.path.exists(path):
        torch.save({"batch": {k: v.cpu() for k, v in exp.batch.items()}, "advantages": exp.advantages.cpu(),
                    "metrics": m}, path)
    return m


distill.add_distill_advantages = _spy

if __name__ == "__main__":
    from rlhf.distributed.failures import exit_process
    from rlhf.ppo import main

    exit_process(main(sys.argv[1:]))
