"""One vLLM engine in this process (one gloo rank): partial rollouts against vLLM's own ``generate``.

``python _partial_worker.py HF_DIR``: prints one JSON line ``RESULT {...}`` with
- ``full``: every sample of 4 prompts x 3 from ``generate_partial`` with nothing to stop early (groups_needed = 4),
- ``ref``: the same prompts through ``LLM.generate`` seeded as ``VLLMRollout.generate`` seeds them (a parent
  request per prompt with ``n`` = 3: vLLM seeds its child k with seed + k),
- ``stopped``: the same round stopped once 1 group is whole (vLLM's abort), then ``resumed``: the carried samples
  continued at version 1 (the same weights), and the engine's unfinished requests after the abort,
- ``shifted``: the negative control, the full round with every group seeded one prompt later."""
import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch.distributed as dist  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from rlhf.rollout.partial import generate_partial, new_group  # noqa: E402
from rlhf.rollout.types import RolloutConfig  # noqa: E402
from rlhf.rollout.vllm_generator import vllm_memory_kwargs  # noqa: E402

hf = sys.argv[1]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ.get("PORT", "29611"), rank=0,
                        world_size=1)
MAX_LEN, N, T, SEED = 128, 3, 24, 5
llm = LLM(model=hf, dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, seed=0,
          **vllm_memory_kwargs(RolloutConfig(max_model_len=MAX_LEN, kv_cache_bytes=32 << 20), on_cuda=False))
rollout = SimpleNamespace(llm=llm, num_engines=1, engine_index=0, is_leader=True, lora_request=None,
                          mesh=SimpleNamespace(world_size=1))
prompts = [[3 + (11 * i + j) % 40 for j in range(5 + 3 * i)] for i in range(4)]


def groups(shift=0):
    return [new_group(g, 100 + g, p, n=N, step_seed=SEED, position=g + shift) for g, p in enumerate(prompts)]


def dump(gs):
    return [[{"ids": s.response_ids, "lps": s.logprobs, "v": s.versions, "done": s.done, "eos": s.finished}
             for s in g] for g in gs]


# 24 stop tokens of the tiny model's vocabulary: the random model ends a sample after about 10 tokens on average,
# at very different lengths, so one group is whole long before the longest sample ends.
STOP = list(range(100, 124))
kw = dict(temperature=1.0, top_p=1.0, max_tokens=T, stop_token_ids=STOP)
full, c_full = generate_partial(rollout, groups(), groups_needed=4, version=0, **kw)
params = [SamplingParams(n=N, temperature=1.0, top_p=1.0, max_tokens=T, logprobs=0, detokenize=False,
                         seed=SEED * 1_000_003 + i * N, stop_token_ids=STOP) for i in range(4)]
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
ref = [[{"ids": list(c.token_ids), "lps": [float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids)],
         "eos": c.finish_reason == "stop"} for c in o.outputs] for o in outs]
shifted, _ = generate_partial(rollout, groups(shift=1), groups_needed=4, version=0, **kw)
stopped, c_stop = generate_partial(rollout, groups(), groups_needed=1, version=0, **kw)
unfinished_after_abort = llm.llm_engine.get_num_unfinished_requests()
resumed, c_res = generate_partial(rollout, stopped, groups_needed=4, version=1, **kw)
print("RESULT " + json.dumps({"full": dump(full), "ref": ref, "stopped": dump(stopped), "resumed": dump(resumed),
                              "shifted": dump(shifted), "prompts": prompts,
                              "counts": [c_full, c_stop, c_res], "unfinished_after_abort": unfinished_after_abort}),
      flush=True)
del llm
dist.destroy_process_group()
