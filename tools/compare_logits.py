"""Check a converted Megatron checkpoint against Hugging Face ``transformers`` on the same tokens.

    torchrun --nproc_per_node 4 tools/compare_logits.py --hf DIR --ckpt DIR --tp 2 --pp 2
    torchrun --nproc_per_node 4 tools/compare_logits.py --hf DIR --ckpt DIR --tp 2 --ep 2   # MoE
    torchrun --nproc_per_node 4 tools/compare_logits.py --hf DIR --ckpt DIR --tp 2 --cp 2   # context parallelism

Loads the checkpoint at TP=T, PP=P, EP=E, CP=C (any layout, whatever it was written at), runs a forward on fixed random
token ids, runs ``transformers`` on the same ids in fp32 and prints ``max_abs_logit_diff=<float>`` as its last
line. For reward/critic checkpoints the per-token scalar head outputs are compared.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model folder")
    p.add_argument("--ckpt", required=True, help="megatron checkpoint folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", "--expert_model_parallel_size", type=int, default=1, help="expert parallelism (MoE)")
    p.add_argument("--cp", "--context_parallel_size", type=int, default=1,
                   help="context parallelism: each sequence split over this many ranks")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    from rlhf.distributed import DistEnv
    from rlhf.models.checkpoint_io import read_manifest, spec_from_manifest
    from rlhf.models.spec import check_parallel_fit, load_hf_config
    from rlhf.distributed.mesh import validate_layout

    env = DistEnv.from_environ()
    try:  # every check before the process group and the models
        manifest = read_manifest(args.ckpt)
        spec = spec_from_manifest(manifest)
        load_hf_config(args.hf)
        check_parallel_fit(spec, args.tp, args.pp, manifest["padded_vocab_size"], args.ep)
        validate_layout(env.world_size, args.tp, args.pp, args.ep, args.cp)
        from rlhf.models.context_parallel import check_cp_flags

        check_cp_flags(args.cp, spec, "--ckpt")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    diff = compare(args, manifest, spec)
    return 0 if diff == diff else 1  # nan -> failure


def compare(args, manifest, spec) -> float:
    import torch
    import torch.distributed as dist

    from rlhf.distributed import initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.checkpoint_io import load_model
    from rlhf.models.gpt import build_model
    from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mesh = initialize_mesh(args.tp, args.pp, ep=args.ep, cp=args.cp)
    model = build_model(spec, tp=args.tp, pp=args.pp, pp_rank=mesh.pp_rank, params_dtype=torch.float32,
                        padded_vocab=manifest["padded_vocab_size"], ep=args.ep)
    load_model(model, os.path.join(args.ckpt, "model"))
    model.to(mesh.device).eval()
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, spec.vocab_size, (args.batch_size, args.seq_len), generator=g)
    with torch.no_grad():
        out = run_microbatches(model, [{"input_ids": ids}], forward_only=True)
    diff = torch.zeros(2, dtype=torch.float64)  # [max |ours - ref|, max |ref|]
    if mesh.is_last_stage:
        ours = out[0]["output"]
        if not spec.is_seq_cls:
            ours = gather_vocab_parallel(ours)[..., : spec.vocab_size]
        if mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0:
            ref = hf_reference(args.hf, spec, ids)  # on the CPU
            diff[0] = (ours.double().cpu() - ref.double()).abs().max()
            diff[1] = ref.double().abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.barrier()
    destroy_mesh()
    if mesh.is_rank0:
        print(f"layout tp={args.tp} pp={args.pp} ep={args.ep} cp={args.cp} dp={mesh.dp}")
        print(f"max_abs_ref_logit={diff[1].item():.3e} relative_diff={diff[0].item() / diff[1].item():.3e}")
        sys.stdout.flush()
        print(f"max_abs_logit_diff={diff[0].item():.3e}", flush=True)
    return diff[0].item()


def hf_reference(hf_dir: str, spec, ids):
    import torch
    import transformers

    if spec.is_seq_cls:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state
            return model.score(hidden).squeeze(-1)  # (B, S): the head at every position
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


if __name__ == "__main__":
    sys.exit(main())
