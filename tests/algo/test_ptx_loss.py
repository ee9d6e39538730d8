"""make_ptx_combined_loss against a hand computation in fp64: over a step's micro-batches, summed losses over summed
token counts (megatron's per-token contract) equal policy_mean + ptx_coef * ptx_mean."""
import torch

from rlhf.algo.ptx_loss import make_ptx_combined_loss


def test_step_loss_is_policy_mean_plus_coef_ptx_mean():
    g = torch.Generator().manual_seed(0)
    pol = [{"action_mask": torch.rand(2, 5, generator=g) > 0.3, "x": torch.randn(2, 5, generator=g, dtype=torch.float64)}
           for _ in range(3)]
    ptx = [{"loss_mask": torch.rand(2, 7, generator=g) > 0.2, "lp": -torch.rand(2, 6, generator=g, dtype=torch.float64)}
           for _ in range(2)]

    def actor_loss(batch, output):  # a per-token loss: sum of x over the mask, its count, a metric pair
        m = batch["action_mask"]
        s = torch.where(m, batch["x"], 0).sum()
        return s, m.sum().to(torch.int), {"policy_loss": [s.detach(), m.sum()]}

    n_pol = float(sum(b["action_mask"].sum() for b in pol))
    n_ptx = float(sum(b["loss_mask"][:, 1:].sum() for b in ptx))
    fn = make_ptx_combined_loss(actor_loss, lambda b, out: b["lp"], ptx_coef=0.3, n_policy=n_pol, n_ptx=n_ptx,
                                metric_keys=("policy_loss",))
    outs = [fn(b, None) for b in pol + ptx]
    step = sum(o[0] for o in outs) / sum(float(o[1]) for o in outs)
    want_pol = sum(torch.where(b["action_mask"], b["x"], 0).sum() for b in pol) / n_pol
    want_ptx = -sum(torch.where(b["loss_mask"][:, 1:], b["lp"], 0).sum() for b in ptx) / n_ptx
    assert torch.allclose(step, want_pol + 0.3 * want_ptx, atol=1e-12, rtol=0)
    ptx_metric = sum(float(o[2]["ptx_loss"][0]) for o in outs) / sum(float(o[2]["ptx_loss"][1]) for o in outs)
    assert abs(ptx_metric - float(want_ptx)) < 1e-12
    pol_metric = sum(float(o[2]["policy_loss"][0]) for o in outs) / sum(float(o[2]["policy_loss"][1]) for o in outs)
    assert abs(pol_metric - float(want_pol)) < 1e-12
