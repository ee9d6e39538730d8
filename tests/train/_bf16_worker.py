"""--bf16 vs fp32 for SFT, RM, DPO and KTO: run by test_bf16.py in one 2-rank torchrun job.

    torchrun --nproc_per_node 2 tests/train/_bf16_worker.py MODEL SFT_JSONL RM_JSONL KTO_JSONL WORK OUT_JSON

Each run is the real trainer (``rlhf.supervised.loop.run``, the body of ``launch/*.py``) on flags parsed by the task's own
``add_args``, a few steps from the same model, data and seed, once without and once with ``--bf16``. Per-step
metrics come from the run's TensorBoard scalars (full precision; the progress line has 4 digits). The SFT bf16
run goes to the end (checkpoint + HF export); the rest stop after STEPS steps (``--stop_after_steps``). Rank 0
writes ``{run: {metric: [step 1, step 2, ...]}}`` plus the exported SFT weights' dtype facts.

The runs share one process group: torch re-initialising its default group in one process reads the previous
group's stale gloo rendezvous keys (connection refused), so between runs only megatron's groups are torn down.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import rlhf.distributed.mesh as mesh_mod  # noqa: E402
from rlhf.supervised import dpo  # noqa: E402
from rlhf.supervised import kto
from rlhf.supervised import rm
from rlhf.supervised import sft
from rlhf.supervised import loop as trainer
from rlhf.config.job import cli_main  # noqa: E402
from rlhf.observability.metrics import metric_series  # noqa: E402

STEPS = 2  # compared; each run has one more (a run stopped at its last step would still export)


def keep_default_group(mesh=None) -> None:
    """``destroy_mesh`` between runs: megatron's groups only (the next run's ``initialize_mesh`` rebuilds them)."""
    mesh = mesh or mesh_mod.ParallelMesh.active
    if mesh is not None:
        mesh.destroy_groups()


def main() -> None:
    model, sft_data, rm_data, kto_data, work, out_path = sys.argv[1:7]
    mesh_mod.destroy_mesh = keep_default_group
    common = ["--pretrain", model, "--train_batch_size", "16", "--micro_train_batch_size", "4", "--max_len", "64",
              "--lr_warmup_ratio", "0", "--seed", "7", "--max_samples", str(16 * (STEPS + 1)), "--max_epochs", "1",
              "--learning_rate", "1e-3"]
    pref = ["--prompt_key", "prompt", "--chosen_key", "chosen", "--rejected_key", "rejected", "--beta", "0.1"]
    tasks = {  # name -> (task module, its flags); TP2 for SFT and DPO, PP2 for RM (bf16 activations between the
        # stages), DP2 for KTO
        "sft": (sft, ["--dataset", sft_data, "--tp", "2"]),
        "rm": (rm, ["--dataset", rm_data, "--pp", "2", "--prompt_key", "prompt", "--chosen_key", "chosen",
                    "--rejected_key", "rejected"]),
        "dpo": (dpo, ["--dataset", rm_data, "--tp", "2"] + pref),
        "kto": (kto, ["--dataset", kto_data, "--input_key", "input", "--output_key", "output", "--label_key",
                      "label", "--beta", "0.1"]),
    }
    runs = []
    for name, (mod, flags) in tasks.items():
        runs.append((f"{name}/fp32", mod, flags + ["--stop_after_steps", str(STEPS)]))
        # The SFT bf16 run goes to the end: its checkpoint save and HF export run on bf16 parameters too.
        runs.append((f"{name}/bf16", mod, flags + ["--bf16"] + ([] if name == "sft" else
                                                                ["--stop_after_steps", str(STEPS)])))
    runs.append(("sft/bf16_packed", sft, tasks["sft"][1] + ["--bf16", "--packing_samples", "--stop_after_steps",
                                                            str(STEPS)]))
    result = {}
    for name, mod, flags in runs:
        save = os.path.join(work, name.replace("/", "_"))
        tb = os.path.join(save, "tb")
        rc = cli_main(mod.add_args, lambda args: trainer.run(args, mod.TASK()),
                      common + flags + ["--save_path", save, "--tensorboard", tb])
        assert rc == 0, (name, rc)
        dist.barrier()
        if dist.get_rank() == 0:
            result[name] = metric_series(save, name.split("/")[0])
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        def bf16_exact(w: dict) -> bool:
            return all(torch.equal(t, t.bfloat16().to(t.dtype)) for t in w.values())

        w = load_file(os.path.join(work, "sft_bf16", "model.safetensors"))
        # bf16 parameters were exported: every value is a bf16 number (the starting model's are not)
        result["sft/bf16_export"] = {
            "dtypes": sorted({str(t.dtype) for t in w.values()}),
            "bf16_exact": bf16_exact(w),
            "init_bf16_exact": bf16_exact(load_file(os.path.join(model, "model.safetensors"))),
            "final_loss": json.load(open(os.path.join(work, "sft_bf16", "train_result.json")))["train"]["loss"],
        }
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    keep_default_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
