"""One vLLM engine in this process, seeded sampling over prompts that exceed one scheduler step's token budget.

``python _chunked_prefill_worker.py HF_DIR ours|chunked``: ``ours`` takes the CPU kwargs the trainer gives vLLM
(``vllm_memory_kwargs``: whole prompts, no chunked prefill); ``chunked`` turns vLLM's chunked prefill on with a
64-token budget, the configuration that crashed the SmolLM2 calculator-agent run (vLLM 0.32.0 rewinds a partially
prefilled request's seeded generator with ``Generator.set_offset``, which CPU generators refuse). Prints
``OK <tokens>`` or ``FAILED <exception>``."""
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402

from rlhf.rollout.types import RolloutConfig  # noqa: E402
from rlhf.rollout.vllm_generator import vllm_memory_kwargs  # noqa: E402

hf, mode = sys.argv[1], sys.argv[2]
MAX_LEN = 256
if mode == "ours":
    kw = vllm_memory_kwargs(RolloutConfig(max_model_len=MAX_LEN, kv_cache_bytes=32 << 20), on_cuda=False)
else:
    kw = {"kv_cache_memory_bytes": 32 << 20, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
llm = LLM(model=hf, dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, seed=0, **kw)
# 6 prompts of 120 tokens: 720 prompt tokens against a 64-token step in the chunked engine, so every prompt is
# prefilled in pieces; each request has its own seed (as the trainer's rollouts do).
prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 50 for j in range(120)]} for i in range(6)]
params = [SamplingParams(n=1, temperature=1.0, max_tokens=4, seed=1000 + i, detokenize=False) for i in range(6)]
try:
    outs = llm.generate(prompts, params, use_tqdm=False)
    print("OK", [list(o.outputs[0].token_ids) for o in outs], flush=True)
except Exception as e:  # noqa: BLE001 (the control expects vLLM's own error)
    print("FAILED", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
