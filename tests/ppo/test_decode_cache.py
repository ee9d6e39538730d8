"""The megatron generator's decode cache (rlhf.rollout.decode_cache): a prompt fed once, then one token per forward,
megatron's KV cache for the softmax attention and the convolution window and recurrent state of each Gated DeltaNet
layer carried between steps. In process on one rank, tiny random models built by transformers' own classes: a
Llama, Qwen3-Next (three DeltaNet layers, one gated attention) and Qwen3.5's MoE text model (routing recorded).

The sampled replies' log-probs equal transformers' own forward over prompt + reply (an independent reference) and
the whole-sequence path's (the same tokens drawn); the forwards after the prefill feed one token each."""
from __future__ import annotations

import pytest
import torch

MODELS = ("llama", "qwen3_next", "qwen3_5_moe_text")


@pytest.fixture(scope="module", params=MODELS)
def generator(tmp_path_factory, request):
    from helpers import free_port

    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.tiny import make_tiny_hf, make_tiny_hybrid
    from rlhf.rollout.megatron_generator import MegatronRollout
    from rlhf.rollout.types import RolloutConfig
    from rlhf.runtime.role import ModelRole

    path = str(tmp_path_factory.mktemp("decode_cache") / request.param)
    if request.param == "llama":
        make_tiny_hf(path, "llama", seed=4)
    else:
        make_tiny_hybrid(path, request.param, seed=4)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    actor = ModelRole(mesh, path, value_head=False, name="actor", routing_replay="moe" in request.param)
    yield MegatronRollout(mesh, actor, RolloutConfig(backend="megatron"), announce=False), path
    destroy_mesh()


PROMPTS = [[5, 9, 13, 22, 7, 31, 40], [3, 4, 8, 16, 23, 42, 15, 8, 4, 2, 11]]


def _generate(gen, cache: bool | None = None):
    """``cache``: None for the generator's default (the cache)."""
    if cache is not None:
        gen.use_decode_cache = cache
    fed, forward = [], gen.actor.forward

    def watch(mbs, *a, **kw):
        fed.append(tuple(mbs[0]["input_ids"].shape))
        return forward(mbs, *a, **kw)

    gen.actor.forward = watch
    try:
        return gen.generate(PROMPTS, n=3, temperature=1.0, top_p=1.0, max_tokens=20, seed=5, ignore_eos=True), fed
    finally:
        gen.actor.forward = forward


def test_cached_decode_equals_transformers_and_whole_sequences(generator):
    """Log-probs within 1e-5 of transformers' forward (fp32; measured 4.8e-7) and of the whole-sequence path, the
    same tokens; each prompt prefilled once, then (3, 1) per step."""
    import transformers

    gen, path = generator
    cached, fed = _generate(gen)
    whole, fed_whole = _generate(gen, False)
    assert fed == [shape for p in PROMPTS for shape in [(3, len(p))] + [(3, 1)] * 19], fed
    assert fed_whole[1] == (3, len(PROMPTS[0]) + 1), fed_whole  # the control: the whole sequence again
    assert [s.response_ids for s in cached] == [s.response_ids for s in whole]
    diff = max(abs(a - b) for x, y in zip(cached, whole) for a, b in zip(x.logprobs, y.logprobs))
    assert diff <= 1e-5, diff
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for s in cached:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
            P = len(s.prompt_ids)
            ref = logp[P - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    assert worst <= 1e-5, worst
    if "moe" in path:  # the routing of every prompt and reply token, one record per token fed
        assert all(s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1 for s in cached)


def test_prompts_of_one_length_are_drawn_together_as_alone(generator):
    """``generate`` samples the replies of prompts of one length as one batch (three 7-token prompts: 9 rows, one
    prefill, then (9, 1) per step; the 11-token prompt alone), each prompt's replies drawn by its own generator: the
    same tokens as with every prompt alone (``max_batch_rows`` 1), log-probs within 1e-5, the order kept."""
    gen, _ = generator
    gen.use_decode_cache = True  # the test above leaves it off
    prompts = [PROMPTS[0], PROMPTS[1], [p + 1 for p in PROMPTS[0]], [p + 2 for p in PROMPTS[0]]]
    runs = {}
    for rows in (64, 1):
        gen.max_batch_rows, fed, forward = rows, [], gen.actor.forward

        def watch(mbs, *a, **kw):
            fed.append(tuple(mbs[0]["input_ids"].shape))
            return forward(mbs, *a, **kw)

        gen.actor.forward = watch
        try:
            runs[rows] = gen.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_tokens=12, seed=7,
                                      ignore_eos=True), fed
        finally:
            gen.actor.forward = forward
            gen.max_batch_rows = type(gen).max_batch_rows
    (together, fed), (alone, fed_alone) = runs[64], runs[1]
    assert fed == [(9, 7)] + [(9, 1)] * 11 + [(3, 11)] + [(3, 1)] * 11, fed
    assert len(fed_alone) == 4 * 12  # the control: a prompt at a time
    assert [s.prompt_index for s in together] == [s.prompt_index for s in alone] == [i for i in range(4) for _ in "abc"]
    assert [s.response_ids for s in together] == [s.response_ids for s in alone]
    diff = max(abs(a - b) for x, y in zip(together, alone) for a, b in zip(x.logprobs, y.logprobs))
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("ep,experts,want", [
    (1, 0, [[0, 2], [1], [3], [4]]), (1, 4, [[0, 2], [1], [3], [4]]), (2, 0, [[0, 2], [1], [3], [4]]),
    (2, 4, [[0], [1], [2], [3], [4]])])
def test_which_prompts_are_batched(ep, experts, want):
    """Prompts of one length together, up to ``max_batch_rows`` rows (here 2 prompts of 3 replies: 7 // 3); a prompt
    with images alone (index 3); an MoE actor at EP > 1 every prompt alone, so that its EP ranks, whose forwards
    are collectives, feed the same number of batches whatever their prompts' lengths."""
    from types import SimpleNamespace

    from rlhf.rollout.megatron_generator import MegatronRollout

    gen = MegatronRollout.__new__(MegatronRollout)
    gen.mesh, gen.actor = SimpleNamespace(ep=ep), SimpleNamespace(spec=SimpleNamespace(num_experts=experts))
    gen.max_batch_rows = 7
    image = type("ImagePrompt", (list,), {})([1, 2, 3])
    image.mm = {"pixel_values": None}
    prompts = [[1, 2, 3], [1, 2], [4, 5, 6], image, [7, 8, 9]]
    assert gen._batches(prompts, 3) == want
