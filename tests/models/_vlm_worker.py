"""Qwen2.5-VL checks on 2 ranks, run by test_vlm.py:

    torchrun --nproc_per_node 2 tests/models/_vlm_worker.py WORKDIR

WORKDIR/hf holds a tiny random Qwen2.5-VL (rlhf.models.tiny.make_tiny_vlm), WORKDIR/images two PNGs. One batch of
three rows (an image then text; text, a second image of another size, text; text only) is built by the data layer
(rlhf.data.vision: the processor, the expanded placeholders; rlhf.models.vlm.vision_batch: the 3-D positions).

* logits at TP1 (DP2) and TP2 against transformers' Qwen2_5_VLForConditionalGeneration, row by row; the controls
  at TP1: the pixels zeroed (the images' features matter) and plain positions (the 3-D rotary matters);
* one training step's loss and every gradient (vision tower included) at DP2 and TP2 against one unsharded model
  without DDP;
* the HF round trip: the TP2 model's full tensors (the weight sync's gather) written as an HF folder, read back by
  transformers: every tensor equal to the source's, bit for bit.

Rank 0 writes WORKDIR/result.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.convert import fill_from_hf  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.hf_llama import full_from_tp_shards, hf_from_megatron, tp_partition_dim  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402
from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config  # noqa: E402


def batch_rows(work, spec):
    """(input_ids (B, S), the rows' image dicts, the rows' ids) of the three rows, through the data layer."""
    from PIL import Image
    from transformers import AutoTokenizer

    from rlhf.data.vision import VisionPart, expand_placeholders, process, vision_data

    hf = os.path.join(work, "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    vd = vision_data(spec, hf, VisionPart())
    imgs = [Image.open(os.path.join(work, "images", n)).convert("RGB") for n in ("a.png", "b.png")]
    vs, ve, pad = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    texts = [([vs, pad, ve] + tok("the quick brown fox")["input_ids"], [imgs[0]]),
             (tok("lazy dog")["input_ids"] + [vs, pad, ve] + tok("one two three")["input_ids"], [imgs[1]]),
             (tok("apple banana cherry delta echo")["input_ids"], [])]
    rows, mms = [], []
    for ids, images in texts:
        mm = process(images, vd)
        rows.append(expand_placeholders(ids, mm, vd, "worker"))
        mms.append(mm)
    S = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), S, dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, :len(r)] = torch.tensor(r)
    return input_ids, mms, rows


def hf_reference(work, rows, mms, image_token_id):
    import transformers

    m = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(work, "hf"),
                                                                        dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, mm in zip(rows, mms):
            x = torch.tensor([ids])
            kw = {"mm_token_type_ids": (x == image_token_id).int()}
            if mm is not None:
                kw.update(pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
            out.append(m(input_ids=x, **kw).logits[0])
    return out


def full_logits(model, mesh, spec, batch):
    with torch.no_grad():
        out = run_microbatches(model, [batch], forward_only=True)
    return gather_vocab_parallel(out[0]["output"])[..., :spec.vocab_size]


def max_row_diff(logits, refs, rows):
    return max((logits[b, :len(r)].double() - refs[b].double()).abs().max().item() for b, r in enumerate(rows))


def lm_loss(batch, logits):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    labels = batch["input_ids"][:, 1:]
    mask = batch["attention_mask"][:, 1:].float()
    loss = vocab_parallel_cross_entropy(logits[:, :-1].float().transpose(0, 1).contiguous(),
                                        labels.transpose(0, 1).contiguous()).transpose(0, 1)
    return (loss * mask).sum() / mask.sum(), {}


def grads_of(model, mesh, spec, named=None):
    out = {}
    for name, p in (named or model.named_parameters()):
        g = p.main_grad if hasattr(p, "main_grad") else p.grad
        g = torch.zeros_like(p) if g is None else g.detach().clone()  # an unused parameter: no gradient
        shards = [torch.empty_like(g) for _ in range(mesh.tp)]
        dist.all_gather(shards, g.contiguous(), group=mesh.tp_group)
        for hf_name, t in hf_from_megatron(name, full_from_tp_shards(name, shards, tp_partition_dim(p)), spec):
            out[hf_name] = t.clone()
    return out


def main():
    work = sys.argv[1]
    torch.set_num_threads(1)
    hf = os.path.join(work, "hf")
    spec = spec_from_hf_config(load_hf_config(hf))
    padded = padded_vocab_size(spec.vocab_size)
    from rlhf.data.collate import vision_entries

    input_ids, mms, rows = batch_rows(work, spec)
    attention = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        attention[b, :len(r)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention, **vision_entries(mms, input_ids)}
    refs = hf_reference(work, rows, mms, spec.vision["image_token_id"])
    results = {"image_tokens": int(batch["image_mask"].sum()), "rows": [len(r) for r in rows]}
    for tp in (1, 2):
        mesh = initialize_mesh(tp, 1)
        model = build_model(spec, tp=tp, pp=1, pp_rank=0, padded_vocab=padded)
        fill_from_hf(model, hf, spec, padded, tp=tp, pp=1, tp_rank=mesh.tp_rank, pp_rank=0)
        model.eval()
        results[f"logits/tp{tp}"] = max_row_diff(full_logits(model, mesh, spec, batch), refs, rows)
        if tp == 1:  # the controls
            no_pixels = {**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}
            results["control/pixels_zeroed"] = max_row_diff(full_logits(model, mesh, spec, no_pixels), refs, rows)
            plain = {k: v for k, v in batch.items() if k != "mrope_position_ids"}
            results["control/plain_positions"] = max_row_diff(full_logits(model, mesh, spec, plain), refs, rows)
        # one step's gradients over the 3 rows (every rank the same batch: DP replicas must agree too)
        from rlhf.models.ddp import wrap_ddp

        model.train()
        ddp = wrap_ddp(model)
        ddp.zero_grad_buffer()
        run_microbatches(ddp, [batch], loss_fn=lm_loss)
        grads = grads_of(ddp.module, mesh, spec)
        if tp == 1:
            ref = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=padded)
            fill_from_hf(ref, hf, spec, padded, tp=1, pp=1, tp_rank=0, pp_rank=0)
            loss, _ = lm_loss(batch, ref(input_ids, None, None, **{k: batch[k] for k in (
                "pixel_values", "image_grid_thw", "mrope_position_ids", "image_mask")}))
            loss.backward()
            ref_grads = {}
            for name, p in ref.named_parameters():
                g = torch.zeros_like(p) if p.grad is None else p.grad.detach()
                for hf_name, t in hf_from_megatron(name, g, spec):
                    ref_grads[hf_name] = t.clone()
            results["grads/vision_tensors"] = sum(k.startswith("visual.") for k in ref_grads)
            results["grads/vision_grad_norm"] = sum(v.norm().item() ** 2 for k, v in ref_grads.items()
                                                    if k.startswith("visual.")) ** 0.5
        rel = {k: (grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12)
               for k in ref_grads}
        results[f"grads/tp{tp}/max_rel_diff"] = max(rel.values())
        results[f"grads/tp{tp}/names_match"] = sorted(grads) == sorted(ref_grads)
        if tp == 2:  # the HF round trip from the TP2 shards
            from rlhf.rollout.weight_sync import WeightSync

            class _Engine:  # what WeightSync reads of an engine
                pass

            eng = _Engine()
            eng.model, eng.spec = ddp.module, spec
            full = dict(WeightSync(eng, mesh).iter_hf_tensors())
            if mesh.is_rank0:
                from safetensors.torch import load_file

                src = load_file(os.path.join(hf, "model.safetensors"))
                results["round_trip/names_match"] = sorted(full) == sorted(src)
                results["round_trip/max_abs_diff"] = max((full[k] - src[k]).abs().max().item() for k in src)
                results["round_trip/vision_tensors"] = sum(k.startswith("visual.") for k in full)
        del ddp, model
    if dist.get_rank() == 0:
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
