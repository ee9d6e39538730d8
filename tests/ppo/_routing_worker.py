"""launch/ppo.py's body under torchrun, with every MoE router of the actor watched in the forwards that replay a
routing (megatron's ``RouterReplay`` actions REPLAY_FORWARD and REPLAY_BACKWARD: the experience and update forwards
and their recomputes): per rank, ``$RLHF_TEST_ROUTING_DUMP/rank<r>.json`` counts the tokens whose experts as used (the
``routing_map`` the router returns) differ from the replayed ones (``replayed_flips``: replay's whole promise is 0),
and the tokens whose experts the router would have chosen itself (top-k of its own logits) differ from the replayed
ones (``unreplayed_flips``, over tokens whose replayed experts are not the 0..K-1 filler of pads and unknown
positions), with the number of tokens seen. For tests/ppo/test_routing_replay_ppo.py."""
import atexit
import json
import os
import sys

import torch

import rlhf.runtime.role

COUNTS = {"replayed_flips": 0, "unreplayed_flips": 0, "tokens": 0, "replay_forward": 0, "replay_backward": 0,
          "ref_replay_routers": 0}
"""``replay_forward`` / ``replay_backward``: router calls under each action (the second: recomputes in backwards)"""
_init = rlhf.runtime.role.ModelRole.__init__


def _sets(idx: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(idx.shape[0], experts, dtype=torch.bool).scatter(1, idx.long().cpu(), True)


def _watch(router) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

    rr, seen = router.router_replay, {}

    def pre(module, args):
        action = rr.router_replay_action
        seen["target"] = (rr.target_topk_idx if action == A.REPLAY_FORWARD else
                          rr.replay_backward_list[0] if action == A.REPLAY_BACKWARD else None)
        seen["action"] = "replay_forward" if action == A.REPLAY_FORWARD else "replay_backward"

    def post(module, args, output):
        target = seen.pop("target", None)
        if target is None:
            return
        E = module.config.num_moe_experts
        with torch.no_grad():
            own = module.gating(args[0]).view(-1, E).topk(module.topk, dim=-1).indices
        want, used, mine = _sets(target, E), output[1].detach().cpu().bool(), _sets(own, E)
        filler = (target.sort(-1).values.cpu() == torch.arange(target.shape[1])).all(-1)
        COUNTS["replayed_flips"] += int((used != want).any(-1).sum())
        COUNTS["unreplayed_flips"] += int(((mine != want).any(-1) & ~filler).sum())
        COUNTS["tokens"] += int((~filler).sum())
        COUNTS[seen["action"]] += 1

    router.register_forward_pre_hook(pre)
    router.register_forward_hook(post)


def _watched_init(self, *args, **kw):
    _init(self, *args, **kw)
    if kw.get("name") == "ref":  # the reference routes itself: its routers carry no RouterReplay
        from rlhf.models.routing_replay import replay_routers

        COUNTS["ref_replay_routers"] += len(replay_routers(self.module))
    if kw.get("name") == "actor":
        from megatron.core.transformer.moe.router import TopKRouter

        for m in self.module.modules():
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None:
                _watch(m)


def _dump() -> None:
    path = os.path.join(os.environ["RLHF_TEST_ROUTING_DUMP"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as f:
        json.dump(COUNTS, f)


rlhf.runtime.role.ModelRole.__init__ = _watched_init

if __name__ == "__main__":
    from rlhf.distributed.failures import exit_process
    from rlhf.ppo import main

    atexit.register(_dump)
    exit_process(main(sys.argv[1:]))
