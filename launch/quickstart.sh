#!/usr/bin/env bash
# The embedded default job (README command 1), until the PPO pipeline lands: generate the bundled tiny Llama,
# convert it to a megatron checkpoint at TP2 x PP2, check its logits against transformers on 4 gloo ranks,
# and convert it back to HF bit-exactly.
#   bash launch/quickstart.sh            (after: bash tools/setup_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-outputs/quickstart}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
rm -rf "$OUT" && mkdir -p "$OUT"
$PY tools/make_tiny_model.py --out "$OUT/hf" --seed 0
$PY tools/convert_hf_to_megatron.py --hf "$OUT/hf" --out "$OUT/megatron" --tp 2 --pp 2
$PY -m torch.distributed.run --nproc_per_node 4 tools/compare_logits.py --hf "$OUT/hf" --ckpt "$OUT/megatron" \
  --tp 2 --pp 2 2>&1 | grep -E "^(max_abs|error)"
$PY tools/convert_megatron_to_hf.py --ckpt "$OUT/megatron" --out "$OUT/hf_roundtrip"
$PY - "$OUT" <<'PYEOF'
import sys, torch
from safetensors.torch import load_file
out = sys.argv[1]
a, b = load_file(f"{out}/hf/model.safetensors"), load_file(f"{out}/hf_roundtrip/model.safetensors")
same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
print(f"round trip HF -> Megatron -> HF bit-exact: {same}")
sys.exit(0 if same else 1)
PYEOF
