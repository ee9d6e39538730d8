"""Vision-language checks on 2 ranks, run by test_vlm.py (Qwen2.5-VL) and test_vlm_qwen3_5.py (Qwen3.5):

    torchrun --nproc_per_node 2 tests/models/_vlm_worker.py WORKDIR [HF_SUBDIR]

WORKDIR/HF_SUBDIR (default hf) holds a tiny random model (rlhf.models.tiny.make_tiny_vlm, make_tiny_qwen3_5_vl),
WORKDIR/images two PNGs. One batch of three rows (an image then text; text, a second image of another size, text;
text only) is built by the data layer (rlhf.data.vision: the processor, the expanded placeholders;
rlhf.models.vlm.vision_batch: the 3-D positions).

* logits at TP1 (DP2) and TP2 (an MoE model: EP2 instead) against transformers' own ...ForConditionalGeneration,
  row by row; the controls at TP1: the pixels zeroed (the images' features matter), plain positions (the 3-D rotary
  matters), for the interleaved rotary (Qwen3.5, Qwen3-VL) the sectioned one in its place, and for Qwen3-VL the
  deepstack features left out of the first decoder layers;
* one training step's loss and every gradient (vision tower included) at both layouts against one unsharded model
  without DDP;
* the HF round trip: the second layout's model exported by the trainer's HF writer (the weight sync's gather), read
  back by transformers: the same tensor names as the source's, every tensor equal, bit for bit.

Rank 0 writes WORKDIR/result-HF_SUBDIR.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mp_equivalence import full_grads  # noqa: E402

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.convert import fill_from_hf  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.hf_llama import hf_from_megatron  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402
from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config  # noqa: E402


def batch_rows(work, hf, spec):
    """(input_ids (B, S), the rows' image dicts, the rows' ids) of the three rows, through the data layer."""
    from PIL import Image
    from transformers import AutoTokenizer

    from rlhf.data.vision import VisionPart, expand_placeholders, process, vision_data

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


def hf_class(spec):
    import transformers

    from rlhf.models.vlm import VLM_ARCHS

    return getattr(transformers, VLM_ARCHS[spec.model_type])


def hf_reference(hf, spec, rows, mms, image_token_id):
    m = hf_class(spec).from_pretrained(hf, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, mm in zip(rows, mms):
            x = torch.tensor([ids])
            kw = {"mm_token_type_ids": (x == image_token_id).int()}
            if mm is not None:
                kw.update(pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
            out.append(m(input_ids=x, **kw).logits[0])
    return out


def hf_grads(hf, spec, rows, mms, image_token_id):
    """transformers' own backward of ``lm_loss`` over the rows (each row alone: no padding), by the checkpoint's
    read names (``model.layers.*``, ``visual.*``, ``lm_head.weight``)."""
    m = hf_class(spec).from_pretrained(hf, dtype=torch.float32).train()
    total = sum(len(r) - 1 for r in rows)
    for ids, mm in zip(rows, mms):
        x = torch.tensor([ids])
        kw = {"mm_token_type_ids": (x == image_token_id).int()}
        if mm is not None:
            kw.update(pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
        logits = m(input_ids=x, **kw).logits[0].float()
        (torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="sum") / total).backward()
    out = {}
    for name, p in m.named_parameters():
        for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(new):
                name = old + name[len(new):]
        out[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach()
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


def sectioned_mrope(inv_freq, positions, section):
    """The control of the interleaved rotary: Qwen2.5-VL's sectioned split (time, height, width blocks) instead."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (3, B, S, F)
    out = torch.cat([freqs[i % 3, ..., a:a + n] for i, (a, n) in enumerate(
        zip([0, section[0], section[0] + section[1]], section))], dim=-1)
    return torch.cat((out, out), dim=-1).transpose(0, 1).unsqueeze(2).contiguous()


def controls(model, mesh, spec, batch, refs, rows, results):
    import rlhf.models.vlm as vlm

    no_pixels = {**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}
    results["control/pixels_zeroed"] = max_row_diff(full_logits(model, mesh, spec, no_pixels), refs, rows)
    plain = {k: v for k, v in batch.items() if k != "mrope_position_ids"}
    results["control/plain_positions"] = max_row_diff(full_logits(model, mesh, spec, plain), refs, rows)
    if spec.vision.get("deepstack"):  # Qwen3-VL: the tower's deepstack features left out of the decoder layers
        import contextlib

        real, vlm.deepstack = vlm.deepstack, lambda *a: contextlib.nullcontext()
        try:
            results["control/deepstack_dropped"] = max_row_diff(full_logits(model, mesh, spec, batch), refs, rows)
        finally:
            vlm.deepstack = real
    if spec.vision["mrope_interleaved"]:
        real, vlm.interleaved_mrope = vlm.interleaved_mrope, sectioned_mrope
        try:
            results["control/sectioned_rotary"] = max_row_diff(full_logits(model, mesh, spec, batch), refs, rows)
        finally:
            vlm.interleaved_mrope = real


def round_trip(ddp, mesh, spec, hf, results):
    """The trainer's HF writer on this layout's shards, read back by transformers against the source."""
    from rlhf.runtime.export import _write_hf_in_process

    class _Engine:  # what WeightSync reads of an engine
        pass

    eng = _Engine()
    eng.model, eng.spec = ddp.module, spec
    out = os.path.join(os.path.dirname(hf), "exported-" + os.path.basename(hf))
    _write_hf_in_process(eng, mesh, spec, load_hf_config(hf), hf, out)
    if mesh.is_rank0:
        from safetensors import safe_open

        src = hf_class(spec).from_pretrained(hf, dtype=torch.float32).state_dict()
        back = hf_class(spec).from_pretrained(out, dtype=torch.float32).state_dict()
        saved = set().union(*(safe_open(os.path.join(d, f), "pt").keys() for d in (out,)
                              for f in os.listdir(d) if f.endswith(".safetensors")))
        source = set().union(*(safe_open(os.path.join(hf, f), "pt").keys() for f in os.listdir(hf)
                               if f.endswith(".safetensors")))
        results["round_trip/names_match"] = saved == source and sorted(back) == sorted(src)
        results["round_trip/max_abs_diff"] = max((back[k] - src[k]).abs().max().item() for k in src)
        results["round_trip/vision_tensors"] = sum(".visual." in "." + k for k in saved)
        from safetensors.torch import load_file  # tensors transformers ignores (Qwen3.5's mtp.*): written back as read

        def mtp(d):
            return {k: v for f in os.listdir(d) if f.endswith(".safetensors")
                    for k, v in load_file(os.path.join(d, f)).items() if k.startswith("mtp.")}

        src_raw, out_raw = mtp(hf), mtp(out)
        results["round_trip/mtp_tensors"] = len(src_raw)
        results["round_trip/mtp_equal"] = sorted(src_raw) == sorted(out_raw) and all(
            torch.equal(src_raw[k], out_raw[k]) for k in src_raw)


def layouts(spec):
    """(name, tp, ep): TP 1 and TP 2; an MoE model also EP 2 (its TP 2 runs sequence parallelism)."""
    return [("tp1", 1, 1), *([("ep2", 1, 2)] if spec.num_experts else []), ("tp2", 2, 1)]


def main():
    work = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "hf"
    torch.set_num_threads(1)
    hf = os.path.join(work, name)
    spec = spec_from_hf_config(load_hf_config(hf))
    padded = padded_vocab_size(spec.vocab_size)
    from rlhf.data.collate import vision_entries

    input_ids, mms, rows = batch_rows(work, hf, spec)
    attention = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        attention[b, :len(r)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention, **vision_entries(mms, input_ids)}
    refs = hf_reference(hf, spec, rows, mms, spec.vision["image_token_id"])
    results = {"image_tokens": int(batch["image_mask"].sum()), "rows": [len(r) for r in rows]}
    for layout, tp, ep in layouts(spec):
        mesh = initialize_mesh(tp, 1, ep=ep)
        model = build_model(spec, tp=tp, pp=1, pp_rank=0, padded_vocab=padded, ep=ep)
        fill_from_hf(model, hf, spec, padded, tp=tp, pp=1, tp_rank=mesh.tp_rank, pp_rank=0, ep=ep,
                     ep_rank=mesh.ep_rank)
        model.eval()
        results[f"logits/{layout}"] = max_row_diff(full_logits(model, mesh, spec, batch), refs, rows)
        if layout == "tp1":
            controls(model, mesh, spec, batch, refs, rows, results)
        # one step's gradients over the 3 rows (every rank the same batch: DP replicas must agree too)
        from rlhf.models.ddp import wrap_ddp

        model.train()
        ddp = wrap_ddp(model)
        ddp.zero_grad_buffer()
        run_microbatches(ddp, [batch], loss_fn=lm_loss)
        grads = full_grads(ddp, mesh, spec)
        if layout == "tp1":
            ref = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=padded)
            fill_from_hf(ref, hf, spec, padded, tp=1, pp=1, tp_rank=0, pp_rank=0)
            loss, _ = lm_loss(batch, ref(input_ids, None, None, **{k: batch[k] for k in (
                "pixel_values", "image_grid_thw", "mrope_position_ids", "image_mask")}))
            loss.backward()
            ref_grads = {}
            for pname, p in ref.named_parameters():
                g = torch.zeros_like(p) if p.grad is None else p.grad.detach()
                for hf_name, t in hf_from_megatron(pname, g, spec):
                    ref_grads[hf_name] = t.clone()
            results["grads/vision_tensors"] = sum(k.startswith("visual.") for k in ref_grads)
            results["grads/vision_grad_norm"] = sum(v.norm().item() ** 2 for k, v in ref_grads.items()
                                                    if k.startswith("visual.")) ** 0.5
            results["grads/deepstack_grad_norm"] = sum(v.norm().item() ** 2 for k, v in ref_grads.items()
                                                       if k.startswith("visual.deepstack_")) ** 0.5
            theirs = hf_grads(hf, spec, rows, mms, spec.vision["image_token_id"])
            common = sorted(set(theirs) & set(ref_grads))  # a fused-expert HF layout's names differ
            results["grads/vs_transformers/tensors"] = len(common)
            results["grads/tensors"] = len(ref_grads)
            results["grads/vs_transformers/max_rel_diff"] = max(
                (ref_grads[k] - theirs[k]).abs().max().item() / (theirs[k].abs().max().item() + 1e-12) for k in common)
            del ref
        rel = {k: (grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12)
               for k in ref_grads}
        results[f"grads/{layout}/max_rel_diff"] = max(rel.values())
        results[f"grads/{layout}/worst"] = sorted(rel, key=rel.get)[-3:]
        results[f"grads/{layout}/names_match"] = sorted(grads) == sorted(ref_grads)
        if layout == layouts(spec)[-1][0]:
            round_trip(ddp, mesh, spec, hf, results)
        del ddp, model
    if dist.get_rank() == 0:
        with open(os.path.join(work, f"result-{name}.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
