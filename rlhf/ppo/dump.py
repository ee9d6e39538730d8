"""``--dump_experience DIR``: each step's tensors as the trainer used them, per rank, to check a run against another
implementation's formulas (the suite's job tests do: tests/ppo/test_job_formulas.py) or to debug one.

``DIR/step<N>_rank<R>.pt`` (``torch.load``), written at the step's end, atomically:

* ``"experience"``: this DP rank's samples after ``compute_advantages``: ``prompt_index`` (B,), ``input_ids`` and
  ``attention_mask`` (B, S), ``resp_pos`` (the position predicting each response token), ``response_ids``,
  ``action_mask`` (B, T) (and ``reward_mask`` where --rollout_rs took tokens out of it), ``old_logprobs``,
  ``vllm_logprobs``, ``ref_logprobs``, ``teacher_logprobs``, ``values``, ``kl``, ``advantages``, ``returns``
  (B, T), ``rewards`` (B,) as optimized and ``raw_rewards`` (B,), ``rollout_is_weights`` (B, T) where verl's weights
  were made with the experience; with ``kl_coef``, ``step``, the rank's DP/TP/PP coordinates;
* ``"actor"`` / ``"critic"``: one record per training micro-batch, in the order the updates ran them (``microbatch``;
  ``"actor_plans"``/``"critic_plans"``: each optimizer step's micro-batches as rows of the experience): the loss's inputs from the batch (``old_logprobs``, ``advantages``,
  ``action_mask``, ...), what the model gave (``logprobs`` and ``entropy``, or ``values``), and the loss function's
  own return: ``loss`` (its sum), ``count`` and each metric's ``[sum, count]``; with --pretrain_data,
  ``"actor_step"`` records the step's combined loss (policy and ptx micro-batches) the same way.

Tensors are saved on the CPU, detached, in the dtype the trainer computed them in."""
from __future__ import annotations

import os

import torch

BATCH_KEYS = ("old_logprobs", "vllm_logprobs", "advantages", "returns", "values", "ref_logprobs", "action_mask",
              "rollout_is_weights", "response_ids")
EXPERIENCE_KEYS = ("old_logprobs", "vllm_logprobs", "ref_logprobs", "teacher_logprobs", "values", "kl",
                   "advantages", "returns", "rewards")


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, (list, tuple)):
        return [_cpu(v) for v in x]
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


class ExperienceDump:
    """One step's records, kept until ``save``."""

    def __init__(self, folder: str, mesh):
        self.folder, self.mesh = folder, mesh
        os.makedirs(folder, exist_ok=True)
        self.records: dict = {}
        self._seen: dict = {}
        self.step = 0

    def experience(self, exp, raw_rewards: torch.Tensor, kl_coef: float, step: int) -> None:
        """Starts step ``step``'s records with its experience (after ``compute_advantages``)."""
        self.step = step
        self.records = {"step": step, "rank": self.mesh.rank, "dp_rank": self.mesh.dp_rank,
                        "tp_rank": self.mesh.tp_rank, "pp_rank": self.mesh.pp_rank, "actor": [], "critic": [],
                        "actor_step": []}
        rec = {k: _cpu(getattr(exp, k)) for k in EXPERIENCE_KEYS}
        rec.update({"raw_rewards": _cpu(raw_rewards), "kl_coef": float(kl_coef),
                    "prompt_index": torch.tensor([s.prompt_index for s in exp.samples]),
                    **{k: _cpu(exp.batch[k]) for k in ("input_ids", "attention_mask", "resp_pos", "action_mask",
                                                        "response_ids")}})
        for k in ("reward_mask", "rollout_is_weights"):
            if k in exp.batch:
                rec[k] = _cpu(exp.batch[k])
        self.records["experience"] = rec

    def model(self, role: str, model_fn):
        """``model_fn`` (what a loss calls on the model's output: log-probs and entropy, or values), remembered."""
        def model(batch, output):
            out = model_fn(batch, output)
            self._seen[role] = out
            return out

        return model

    def loss(self, role: str, loss_fn):
        """``loss_fn`` recording each call's inputs, what ``model`` gave, and its return under ``role``."""
        def loss(batch, output):
            ret = loss_fn(batch, output)
            got = self._seen.pop(role, None)
            rec = {k: _cpu(batch[k]) for k in BATCH_KEYS if k in batch}
            if role == "actor" and got is not None:
                rec["logprobs"], rec["entropy"] = _cpu(got[0]), _cpu(got[1])
            elif got is not None:
                rec["new_values"] = _cpu(got)
            value, count, metrics = ret
            rec.update({"loss": _cpu(value), "count": _cpu(count), "metrics": _cpu(metrics),
                        "microbatch": len(self.records[role])})
            self.records[role].append(rec)
            return ret

        return loss

    def plans(self, role: str, plans: list) -> None:
        """The micro-batches of each optimizer step (rows of the experience), in order."""
        self.records[f"{role}_plans"] = [[list(mb) for mb in plan] for plan in plans]

    def save(self) -> None:
        path = os.path.join(self.folder, f"step{self.step:03d}_rank{self.mesh.rank}.pt")
        torch.save(self.records, path + ".tmp")
        os.replace(path + ".tmp", path)
