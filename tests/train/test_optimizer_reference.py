"""The training step at DP2 against a plain reference: HF transformers in float64 with torch's Adam and
``clip_grad_norm_`` over the whole global batch, one process. Ours runs torch's fused CPU Adam kernel and a
foreach gradient clip (``rlhf.compat.megatron``), and either CPU linear kernel of ``rlhf.compat.onednn`` in every
linear layer: oneDNN's GEMM, and torch's (MKL) with the weight gradients accumulated straight into megatron's
``main_grad`` (``MainGradLinear``). Both optimizer layouts: megatron DDP + Adam (``--zero_stage 0``) and megatron's
distributed optimizer (``--zero_stage 1``, the default at DP > 1: Adam's states, the gradient norm and the update
are sharded over the two ranks). Two gloo ranks, in-process engines."""

import os

import pytest
import torch

STEPS, LR = 3, 1e-2
# 4 sequences; rank r trains on sequences 2r and 2r+1, one per micro-batch (gradient accumulation included)
SEQS = [[5, 9, 3, 17, 2, 30, 8, 11], [7, 7, 21, 4, 19, 6, 2, 25], [12, 3, 3, 28, 9, 14, 1, 6],
        [22, 16, 5, 5, 10, 2, 27, 13]]
PROMPT = [2, 3, 1, 4]  # loss on the tokens after each prompt


def _batch(i: int):
    from rlhf.data import SFTSample, collate_sft

    ids = torch.tensor(SEQS[i], dtype=torch.int32)
    mask = torch.arange(len(SEQS[i])) >= PROMPT[i]
    return collate_sft([SFTSample(ids, mask, PROMPT[i], "s")], 0)


def _rank(rank: int, port: int, hf: str, out: str) -> None:
    torch.set_num_threads(1)
    from rlhf.runtime.checkpoint import uses_distributed_optimizer
    from rlhf.compat.megatron import inner_optimizers
    from rlhf.compat.onednn import _forward_impl as onednn_forward
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.supervised.sft import SFTTask

    mesh = initialize_mesh(1, 1, DistEnv(rank, 2, rank, "127.0.0.1", port, "torchrun"))
    result = {}
    for kernel, zero in (("onednn", 0), ("onednn", 1), ("torch", 0), ("torch", 1)):  # both on every CPU vendor
        os.environ["RLHF_CPU_LINEAR"] = kernel
        optim = OptimConfig(lr=LR, total_steps=STEPS, warmup_ratio=0.0, scheduler="constant",
                            adam_betas=(0.9, 0.999), clip_grad=1.0, use_distributed_optimizer=zero >= 1)
        eng = ModelRole(mesh, hf, optim=optim, name=f"sft_{kernel}_zero{zero}")
        mine = [_batch(2 * rank), _batch(2 * rank + 1)]
        norms = [eng.train_step(mine, SFTTask().loss_fn(eng), ("loss",))["grad_norm"] for _ in range(STEPS)]
        logits = [o["output"][..., :eng.spec.vocab_size].detach().double() for o in eng.forward(mine)]
        fused = [g["fused"] for o in inner_optimizers(eng.optimizer) for g in o.optimizer.param_groups]
        onednn = sum(getattr(m._forward_impl, "__func__", None) is onednn_forward for m in eng.model.modules()
                     if hasattr(m, "_forward_impl"))
        direct = sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in eng.model.parameters())
        result[kernel, zero] = {"logits": logits, "grad_norm": norms, "distributed": uses_distributed_optimizer(eng),
                                "fused": bool(fused) and all(fused), "onednn_layers": onednn, "direct": direct}
    torch.save(result, f"{out}.{rank}")
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()


def _reference(hf: str):
    """fp64 HF model, torch Adam, the global batch's token-mean NLL, clip_grad_norm_(1.0)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    ids = [torch.tensor(s).long()[None] for s in SEQS]
    init = [model(x).logits.detach() for x in ids]
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        nll, n = 0.0, 0
        for x, p in zip(ids, PROMPT):
            lp = torch.log_softmax(model(x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
            nll = nll - lp[p - 1:].sum()  # position t predicts token t + 1: tokens p.. are scored
            n += x.shape[1] - p
        (nll / n).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
    with torch.no_grad():
        return [model(x).logits for x in ids], init, norms


def test_dp2_step_matches_fp64_torch_adam(tmp_path):
    from helpers import spawn_within
    from helpers import free_port
    from rlhf.models.tiny import make_tiny_hf

    hf = make_tiny_hf(str(tmp_path / "hf"), "llama", seed=3, num_hidden_layers=2, hidden_size=64,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    out = str(tmp_path / "res")
    spawn_within(_rank, (free_port(), hf, out), nprocs=2, timeout=300)
    ref, init, ref_norms = _reference(hf)
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    runs = list(ranks[0])
    for kernel, zero in runs:
        assert ranks[0][kernel, zero]["distributed"] == (zero == 1)
        assert ranks[0][kernel, zero]["fused"]  # torch's fused CPU Adam is what is checked here
        assert ranks[0][kernel, zero]["onednn_layers"] == 2 * 4 + 1  # QKV, proj, fc1, fc2 per layer, head
        # oneDNN's layers hand their weight gradients to DDP's hook; torch's add them to main_grad themselves
        assert ranks[0][kernel, zero]["direct"] == (0 if kernel == "onednn" else 2 * 4 + 1), (kernel, zero)
    moved = max((r - i).abs().max().item() for r, i in zip(ref, init))
    assert moved > 0.05, moved  # the three steps change the logits well above the tolerance below
    for run in runs:
        assert ranks[0][run]["grad_norm"] == pytest.approx(ref_norms, rel=1e-5), run
        ours = ranks[0][run]["logits"] + ranks[1][run]["logits"]
        err = max((a - b).abs().max().item() for a, b in zip(ours, ref))
        print(f"{run}: max |logit - fp64 reference| {err:.3g} (the steps moved them {moved:.3g}); grad norms "
              f"{ranks[0][run]['grad_norm']} vs {ref_norms}")
        assert err < 1e-4 * moved, (run, err, moved)  # measured: 3.1e-6 and 3.5e-6 against 1.77 (oneDNN)
