"""MoE routing replay (rlhf.models.routing_replay) on a tiny Mixtral and a tiny Qwen3-MoE, one in-process rank: the megatron fallback
generator records the experts of every token it feeds; with that routing in the batch, the trainer's routers use
exactly those experts (read from what megatron's router returns), in padded and packed micro-batches, after the
router was perturbed so that its own top-k differs (negative control: without replay it does); log-probs with replay
equal a forward given the same routing by hand through megatron's RouterReplay; a recorded unreplayed forward reads
back what the router chose (R2's source)."""
import os

import pytest
import torch


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe(tmp_path_factory, request):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole
    from rlhf.models.tiny import make_tiny_hf
    from rlhf.rollout.megatron_generator import MegatronRollout
    from rlhf.rollout.types import RolloutConfig

    work = tmp_path_factory.mktemp("routing_replay")
    dims = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)
    tok = str(tmp_path_factory.getbasetemp() / "routing_replay_tokenizer")
    if not os.path.exists(tok):
        from rlhf.models.tiny import make_tokenizer

        make_tokenizer(tok, texts=["one two three four five six seven eight nine ten"] * 50)
    if request.param == "mixtral":  # top-2 renormalised: megatron's pre_softmax=False routing
        path = make_tiny_hf(str(work / "mixtral"), "mixtral", seed=8, tokenizer_dir=tok, intermediate_size=64,
                            num_local_experts=4, **dims)
    else:  # the plain softmax's top 2 (norm_topk_prob=False): pre_softmax=True, the replay gathers probabilities
        path = make_tiny_hf(str(work / "qwen3_moe"), "qwen3_moe", seed=9, tokenizer_dir=tok, num_experts=4,
                            moe_intermediate_size=64, norm_topk_prob=False, head_dim=32, **dims)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    actor = ModelRole(mesh, path, value_head=False, name="actor", routing_replay=True)
    gen = MegatronRollout(mesh, actor, RolloutConfig(backend="megatron"))
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62]]
    samples = gen.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=3)
    yield actor, samples, path
    destroy_mesh()


def _routers(actor):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in actor.module.modules() if isinstance(m, TopKRouter)]


def _batch(samples):
    from rlhf.models.routing_replay import collate_routing
    from rlhf.ppo.experience import collate_sequences

    batch = collate_sequences(samples, 0, 6)
    batch["routed_experts"] = collate_routing([s.routed_experts for s in samples], batch["input_ids"].shape[1], 2, 2)
    return batch


def _mbs(batch, packed: bool):
    from rlhf.ppo.experience import pack_microbatch, select_rows

    mbs = [select_rows(batch, rows, True) for rows in ([0, 1, 2], [3, 4, 5])]
    return [pack_microbatch(mb, 0) for mb in mbs] if packed else mbs


def _used_experts(actor, mbs):
    """(B, S, layers, K) expert ids + 1 the routers handed to the experts in each forward (their routing_map),
    unpacked to the padded rows; 0 where a row has no token."""
    from rlhf.models.routing_replay import unpack_routing

    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[1].detach().clone())) for r in _routers(actor)]
    parts = []
    try:
        for mb in mbs:
            seen.clear()
            actor.forward([mb], output="hidden", read=lambda b, h: h[:, :1, :1])
            B, S = mb["input_ids"].shape
            layers = [m.nonzero()[:, 1].view(S * B, 2) for m in seen]  # (S*B, K), sorted expert ids
            r = torch.stack([x.view(S, B, 2).transpose(0, 1) for x in layers], dim=2) + 1  # (B, S, layers, K)
            if "packed_seq_params" in mb:
                cu = mb["cu_seqlens"]
                r = unpack_routing(r[0], cu, int((cu[1:] - cu[:-1]).max()))
            parts.append(r)
    finally:
        for h in hooks:
            h.remove()
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, width - p.shape[1])) for p in parts])


@pytest.fixture()
def perturbed(moe):
    """The routers' weights moved (as a training step or another kernel's rounding would), restored afterwards."""
    actor, _, _ = moe
    saved = [r.weight.detach().clone() for r in _routers(actor)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in _routers(actor):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * 1.5)
    yield
    with torch.no_grad():
        for r, w in zip(_routers(actor), saved):
            r.weight.copy_(w)


def test_generator_records_every_fed_token(moe):
    _, samples, _ = moe
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2)
        assert s.routed_experts.min() >= 0 and s.routed_experts.max() < 4
        assert (s.routed_experts[..., 0] != s.routed_experts[..., 1]).all()  # top-2: two distinct experts


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_uses_the_rollout_experts(moe, perturbed, packed):
    from rlhf.models.routing_replay import routing_flips

    actor, samples, _ = moe
    batch = _batch(samples)
    S = batch["input_ids"].shape[1]
    fed = batch["routed_experts"].bool().all(-1).all(-1)  # (B, S) tokens the generator fed
    used = _used_experts(actor, _mbs(batch, packed))[:, :S]
    flips = routing_flips(used, batch["routed_experts"], fed)
    assert flips[1] == fed.sum() > 30 and flips[0] == 0 and flips[2] == 0, flips  # every token, every layer
    plain = {k: v for k, v in batch.items() if k != "routed_experts"}
    unreplayed = _used_experts(actor, _mbs(plain, packed))[:, :S]
    flips = routing_flips(unreplayed, batch["routed_experts"], fed)
    assert flips[0] / flips[1] > 0.2, flips  # negative control: the perturbed router's own choice differs


def test_replayed_logprobs_equal_routing_given_by_hand(moe, perturbed):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from rlhf.models.outputs import response_logprobs
    from rlhf.models.routing_replay import _layer_targets
    from rlhf.ppo.experience import forward_role

    actor, samples, _ = moe
    batch = _batch(samples)
    mbs = _mbs(batch, False)
    replayed = forward_role(actor, "actor", mbs, 1.0)
    by_hand = []
    for mb in mbs:  # megatron's own API, one RouterReplay per layer in build order, and the bare model
        for layer, router in enumerate(_routers(actor)):
            router.router_replay.set_target_indices(_layer_targets(mb["routed_experts"], layer))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            hidden = actor.module(mb["input_ids"], output="hidden")  # (B, S, H)
            by_hand.append(response_logprobs(actor, mb, hidden, 1.0))
        for router in _routers(actor):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
    mask = batch["action_mask"]
    assert torch.equal(replayed[mask], torch.cat(by_hand)[mask])
    own = forward_role(actor, "actor", [{k: v for k, v in mb.items() if k != "routed_experts"} for mb in mbs], 1.0)
    assert (own - replayed)[mask].abs().max() > 1e-3  # negative control: the router's own experts differ


def test_recorded_routing_is_what_the_router_chose(moe, perturbed):
    from rlhf.models.routing_replay import RoutingRecorder, routing_flips

    actor, samples, _ = moe
    batch = {k: v for k, v in _batch(samples).items() if k != "routed_experts"}
    S = batch["input_ids"].shape[1]
    for packed in (False, True):
        mbs = _mbs(batch, packed)
        rec = RoutingRecorder(2, model=actor.module)
        actor.forward([{**mb, "routing_recorder": rec} for mb in mbs], output="hidden", read=lambda b, h: h[:, :1, :1])
        recorded = rec.result(S)
        used = _used_experts(actor, mbs)[:, :S]
        flips = routing_flips(recorded, used, batch["attention_mask"].bool())
        assert flips[1] == batch["attention_mask"].sum() and flips[0] == 0, flips
    assert all(r.router_replay.router_replay_action is None for r in _routers(actor))  # nothing left switched on


@pytest.mark.parametrize("mode", ["off", "train"])
def test_flip_metric_and_train_mode_routing(moe, perturbed, mode):
    """rlhf.ppo.routing after the experience forwards (token-budget groups, packed): the flip metric from the actor's
    unreplayed forward against the generator's routing (the perturbed router flips a share of the response tokens); ``train`` (R2) puts the
    routing that forward chose into the batch for the update to replay."""
    import contextlib
    from types import SimpleNamespace

    from rlhf.models.routing_replay import routing_flips
    from rlhf.ppo import routing

    actor, samples, _ = moe
    roles = SimpleNamespace(actor=actor)
    from rlhf.ppo.experience import pack_microbatch, select_rows

    batch = {k: v for k, v in _batch(samples).items() if k != "routed_experts"}
    groups = [[0, 3], [1, 4, 5], [2]]  # as --use_dynamic_batch groups rows, packed (--packing_samples)
    mbs = [pack_microbatch(select_rows(batch, g, True), 0) for g in groups]
    recorder = routing.recorder_for(roles, mode, samples)
    timer = SimpleNamespace(phase=lambda *a, **k: contextlib.nullcontext())
    metrics = routing.finish(roles, mode, SimpleNamespace(local=samples, tokens=1.0), batch, mbs,
                             [i for g in groups for i in g], recorder, timer)
    assert 0.2 < metrics["moe/routing_flip_tokens"] <= 1.0, metrics
    assert 0.0 < metrics["moe/routing_flip_pairs"] <= metrics["moe/routing_flip_tokens"], metrics
    if mode == "off":
        assert "routed_experts" not in batch
        return
    S = batch["input_ids"].shape[1]
    used = _used_experts(actor, _mbs(batch, False))[:, :S]  # the perturbed router's own choice, in row order
    flips = routing_flips(batch["routed_experts"], used, batch["attention_mask"].bool())
    assert flips[1] == batch["attention_mask"].sum() and flips[0] == 0, flips


def test_recompute_replays_in_the_backward(moe, perturbed):
    """--gradient_checkpointing: megatron recomputes each layer's forward in the backward; the replayed routing
    reaches that recompute through RouterReplay's backward list, so the update's loss and gradient equal those
    without recompute (negative control: with the indices dropped after the forward, the recompute routes by itself
    and the gradient differs)."""
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.models.outputs import response_logprobs

    actor, samples, path = moe
    mbs = _mbs(_batch(samples), False)
    results = []
    for recompute, backward_replay in ((False, True), (True, True), (True, False)):
        eng = ModelRole(actor.mesh, path, optim=OptimConfig(lr=1e-6, total_steps=1, warmup_ratio=0.0),
                          value_head=False, name="actor", recompute=recompute, routing_replay=True)
        with torch.no_grad():  # the same perturbed routers as the fixture's actor
            for mine, theirs in zip(_routers(eng), _routers(actor)):
                mine.weight.copy_(theirs.weight)
        eng.module._rlhf_replay_routers = None
        from rlhf.models.routing_replay import replay_routers

        replay_routers(eng.module)
        eng.module._rlhf_replay_recompute &= backward_replay

        def loss_fn(batch, hidden, eng=eng):
            mask = batch["action_mask"]
            loss = -(response_logprobs(eng, batch, hidden, 1.0) * mask).sum()
            return loss, mask.sum(), {"loss": [loss.detach(), mask.sum()]}

        m = eng.train_step(mbs, loss_fn, ["loss"], output="hidden")
        grads = {n: (getattr(q, "main_grad", None) if getattr(q, "main_grad", None) is not None else q.grad).clone()
                 for n, q in eng.module.named_parameters()}  # the step's gradients (kept until the next step)
        results.append((m, grads))
    (plain, g0), (recomputed, g1), (dropped, g2) = results
    assert recomputed["loss"] == plain["loss"] and dropped["loss"] == plain["loss"]  # every forward replayed
    assert all(torch.equal(g0[n], g1[n]) for n in g0)  # the recompute routed as the forward did
    worst = max(((g2[n] - g0[n]).abs().max() / g0[n].abs().max().clamp(min=1e-12)).item() for n in g0)
    assert worst > 0.05, worst  # negative control: the recompute's own routing changes the gradient


def test_partial_round_records_a_continued_samples_prompt_and_prefix(moe):
    """``MegatronRollout.partial_round`` (partial rollouts' fallback generator): a carried sample continued in a new
    round finishes with the routing of every position it fed, prompt and prefix included (re-fed at this round's
    weights, as vLLM's prefill of a continued request), equal to the trainer's own unreplayed routing of the whole
    sequence at the same weights. Control (what R3 + partial rollouts replayed wrongly until the prompt rows were
    recorded): the same routing without the prompt positions is told apart."""
    from rlhf.models.routing_replay import collate_routing, routing_flips
    from rlhf.ppo.experience import collate_sequences
    from rlhf.rollout.megatron_generator import MegatronRollout
    from rlhf.rollout.partial import PartialSample
    from rlhf.rollout.types import RolloutConfig

    actor, samples, _ = moe
    gen = MegatronRollout(actor.mesh, actor, RolloutConfig(backend="megatron"))
    group = [PartialSample(0, k, k, list(s.prompt_ids), 5 + k, list(s.response_ids[:2]), list(s.logprobs[:2]), [0, 0])
             for k, s in enumerate(samples[:2])]  # carried: two tokens generated a version earlier
    gen.partial_round([group], 1, temperature=1.0, top_p=1.0, max_tokens=6, version=1, ignore_eos=True)
    done = [s.to_sample() for s in group]
    assert all(s.done and len(s.response_ids) == 6 for s in group)
    for s in done:
        assert s.routed_experts.shape == (len(s.prompt_ids) + 5, 2, 2)  # every fed position: P + R - 1
    batch = collate_sequences(done, 0, 6)
    S = batch["input_ids"].shape[1]
    recorded = collate_routing([s.routed_experts for s in done], S, 2, 2)
    fed = recorded.bool().all(-1).all(-1)
    trainer = _used_experts(actor, [batch])[:, :S]
    flips = routing_flips(trainer, recorded, fed)
    assert flips[1] == fed.sum() == sum(len(s.prompt_ids) + 5 for s in done) and flips[0] == 0, flips
    shifted = collate_routing([s.routed_experts[len(s.prompt_ids):] for s in done], S, 2, 2)
    flips = routing_flips(trainer, shifted, shifted.bool().all(-1).all(-1))
    assert flips[0] / flips[1] > 0.2, flips  # control: without the prompt rows the routing no longer lines up


def test_flip_metric_costs_a_forward_only_when_asked(moe):
    """``rlhf.ppo.routing.recorder_for``: R2 always records (its routing source); off with the experience's actor
    forward records for free; where the metric needs one more actor forward (R3, or no actor forward) it runs only
    on the steps --moe_routing_flip_interval names (default 0: never)."""
    from types import SimpleNamespace

    from rlhf.ppo import routing

    actor, samples, _ = moe
    roles = SimpleNamespace(actor=actor)
    got = {(mode, fwd, due): routing.recorder_for(roles, mode, samples, actor_forward=fwd, flip_due=due) is not None
           for mode in ("off", "rollout", "train") for fwd in (True, False) for due in (True, False)}
    assert got == {("off", True, True): True, ("off", True, False): True, ("off", False, True): True,
                   ("off", False, False): False, ("rollout", True, True): True, ("rollout", True, False): False,
                   ("rollout", False, True): True, ("rollout", False, False): False,
                   ("train", True, True): True, ("train", True, False): True, ("train", False, True): True,
                   ("train", False, False): True}
