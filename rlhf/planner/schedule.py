"""The memory planner's schedule: what each phase of the colocated PPO step holds on one device (the residency
of ``rlhf.runtime.offload.plan_residency``), the peak, advice when a layout does not fit, and the printed tables. The
per-role byte counts are ``rlhf.planner.model_bytes``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlhf.planner.model_bytes import (SCHEDULE, GiB, PlanConfig, VLLMMemory, activation_bytes, role_state,
                                      stage_param_numels, vllm_memory)


# ------------------------------------------------------------------------------------------------- phases
@dataclass
class PhasePlan:
    phase: str
    stage: int
    rows: dict[str, dict[str, float]]
    """role -> {params, grads, optimizer, activations} bytes on the device."""
    vllm: dict[str, float]
    other: dict[str, float]
    capacity: float

    @property
    def total(self) -> float:
        return (sum(sum(r.values()) for r in self.rows.values()) + sum(self.vllm.values())
                + sum(self.other.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass
class Plan:
    cfg: PlanConfig
    phases: list[PhasePlan]
    vllm: VLLMMemory
    host_per_node: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.phases) and not self.problems

    @property
    def problems(self) -> list[str]:
        out = [f"{p.phase}: needs {p.total / GiB:.1f} GiB of {p.capacity / GiB:.0f} GiB" for p in self.phases
               if not p.fits]
        if self.vllm.kv_tokens < self.cfg.seq_len:
            out.append(f"vLLM KV cache holds {self.vllm.kv_tokens} tokens, less than one sequence "
                       f"(--prompt_max_len + --generate_max_len = {self.cfg.seq_len}): vLLM refuses to start")
        if self.host_per_node > self.cfg.host_memory_gib * GiB:
            out.append(f"host memory: offloaded states need {self.host_per_node / GiB:.0f} GiB per node, more "
                       f"than --host_memory_gib {self.cfg.host_memory_gib:g}")
        return out


def _phase(cfg: PlanConfig, phase: str, stage: int, vm: VLLMMemory) -> PhasePlan:
    from rlhf.runtime.offload import plan_residency

    roles = cfg.roles
    # The trainer builds every engine, then vLLM: at vLLM's start-up all four are fully resident.
    startup = phase == "vllm_startup"
    residency = None if startup else plan_residency(phase, roles, colocate_all=cfg.colocate_all,
                                                    ref_reward_offload=cfg.ref_reward_offload,
                                                    adam_offload=cfg.adam_offload,
                                                    teacher_offload=cfg.teacher_offload)
    rows: dict[str, dict[str, float]] = {}
    for role, (spec, value_head, trainable) in roles.items():
        st = role_state(spec, cfg, stage, value_head, trainable)
        if startup:
            master = 4 * (st.optimizer // 12) if cfg.bf16 else 0  # fp32 master params exist; Adam moments are lazy
            rows[role] = {"params": st.params, "grads": st.grads, "optimizer": master, "activations": 0.0}
            continue
        r = residency[role]
        act = 0.0
        if phase == "make_experience":
            act = activation_bytes(spec, cfg, stage, value_head, train=False)
        elif phase == f"{role}_update":
            act = activation_bytes(spec, cfg, stage, value_head, train=True)
        rows[role] = {"params": st.params * r.params, "grads": st.grads * r.grads,
                      "optimizer": st.optimizer * r.optimizer, "activations": act}
    if phase == "make_experience":  # the four forwards run one after another: only the largest working set counts
        biggest = max(rows, key=lambda k: rows[k]["activations"])
        for k in rows:
            if k != biggest:
                rows[k]["activations"] = 0.0
    vllm: dict[str, float] = {}
    other = {"reserved": cfg.reserved_gib * GiB}
    if phase == "rollout":
        vllm = {"weights": vm.weights, "activations": vm.activations, "kv_cache": vm.kv_cache}
    elif phase == "weight_sync":
        vllm = {"weights": vm.weights}
        bucket = min(cfg.weight_sync_bucket_mb << 20, sum(stage_param_numels(cfg.actor, 1, 1, 0, False))
                     * cfg.dtype_bytes)
        other["sync_buckets"] = 3 * bucket  # local flat shard, the TP-gathered bucket, the HF-layout copies
    elif startup:
        vllm = {"pool": vm.pool}
    return PhasePlan(phase, stage, rows, vllm, other, cfg.gpu_memory_gib * GiB)


def plan(cfg: PlanConfig) -> Plan:
    """Every phase of the colocated schedule (plus vLLM's start-up check), at the stage that needs most."""
    vm = vllm_memory(cfg)
    phases = []
    for phase in ("vllm_startup",) + SCHEDULE:
        phases.append(max((_phase(cfg, phase, s, vm) for s in range(cfg.pp)), key=lambda p: p.total))
    host = 0.0
    for role, (spec, value_head, trainable) in cfg.roles.items():
        st = max((role_state(spec, cfg, s, value_head, trainable) for s in range(cfg.pp)),
                 key=lambda x: x.params + x.grads + x.optimizer)
        host += st.params + st.optimizer  # OffloadManager's host buffer per storage; grads are dropped, not copied
    notes = []
    if vm.kv_tokens < vm.kv_tokens_wanted:
        notes.append(f"vLLM KV cache: {vm.kv_tokens} tokens per engine shard, {vm.kv_tokens_wanted} wanted for "
                     f"{vm.kv_tokens_wanted // cfg.seq_len} concurrent sequences: generation runs in waves "
                     "(slower, not an OOM)")
    return Plan(cfg, phases, vm, host * cfg.gpus_per_node, notes)


# ----------------------------------------------------------------------------------------------- advice
def candidate_changes(cfg: PlanConfig) -> list[list[tuple[str, dict]]]:
    """Changes worth trying, as groups of alternatives for one setting (at most one per group is applied),
    cheapest groups first: the offload flags, ZeRO-1, recompute, then sharding, smaller micro-batches, nodes."""
    specs = [cfg.actor, cfg.reward] + ([cfg.critic] if cfg.critic else []) + ([cfg.teacher] if cfg.teacher else [])

    def divides_heads(n: int) -> bool:
        return all(s.num_attention_heads % n == 0 and (s.num_kv_heads % n == 0 or n % s.num_kv_heads == 0)
                   for s in specs)

    groups: list[list[tuple[str, dict]]] = []
    for flag in ("ref_reward_offload", "adam_offload", "gradient_checkpointing") + (
            ("teacher_offload",) if cfg.teacher is not None else ()):
        if not getattr(cfg, flag):
            groups.append([(f"--{flag}", {flag: True})])
    if cfg.zero_stage < 1:
        groups.append([("--zero_stage 1", {"zero_stage": 1})])
    tps = [t for t in (2, 4, 8, 16) if cfg.tp < t <= cfg.gpus_per_node and divides_heads(t)]
    groups.append([(f"--tp {t}", {"tp": t}) for t in tps])
    pps = [p for p in (2, 4, 8) if p > cfg.pp and all(s.num_layers % p == 0 for s in specs)]
    groups.append([(f"--pp {p}", {"pp": p}) for p in pps])
    vtps = [t for t in (2, 4, 8, 16) if cfg.vllm_tensor_parallel_size < t <= cfg.gpus_per_node
            and cfg.actor.num_attention_heads % t == 0]
    groups.append([(f"--vllm_tensor_parallel_size {t}", {"vllm_tensor_parallel_size": t}) for t in vtps])
    mbs = [m for m in (cfg.micro_train_batch_size // 2, 1) if 0 < m < cfg.micro_train_batch_size]
    groups.append([(f"--micro_train_batch_size {m}", {"micro_train_batch_size": m}) for m in dict.fromkeys(mbs)])
    groups.append([(f"--nnodes {cfg.nnodes * k}", {"nnodes": cfg.nnodes * k}) for k in (2, 4)])
    return [g for g in groups if g]


def max_vllm_utilization(p: Plan) -> float:
    """The largest --vllm_gpu_memory_utilization that passes vLLM's start-up check (free memory >= its pool)."""
    start = next(ph for ph in p.phases if ph.phase == "vllm_startup")
    used = start.total - start.vllm["pool"]
    return max(0.0, math.floor((start.capacity - used) / start.capacity * 100) / 100)


def _with_feasible_utilization(cfg: PlanConfig) -> PlanConfig:
    """Lower --vllm_gpu_memory_utilization just enough to pass vLLM's start-up check (never raise it)."""
    util = max_vllm_utilization(plan(cfg))
    if 0 < util < cfg.vllm_gpu_memory_utilization:
        return replace(cfg, vllm_gpu_memory_utilization=util)
    return cfg


def advise(cfg: PlanConfig, max_changes: int = 3, max_lines: int = 3) -> list[str]:
    """What would make ``cfg`` fit (fewest changes first), and why a flag would not help. Empty when it fits.

    A layout whose only problem is vLLM's start-up check also gets the largest --vllm_gpu_memory_utilization
    that passes it (the KV cache shrinks accordingly)."""
    import itertools

    base = plan(cfg)
    if base.fits:
        return []
    lines: list[str] = []
    groups = candidate_changes(cfg)
    offload = ("--ref_reward_offload", "--adam_offload")
    if cfg.colocate_all:
        for label in (g[0][0] for g in groups if g[0][0] in offload):
            lines.append(f"{label}: no effect under --colocate_all, which already keeps ref/reward parameters and "
                         "optimizer states off the device outside their own phase")
        groups = [g for g in groups if g[0][0] not in offload]
    start = next(ph for ph in base.phases if ph.phase == "vllm_startup")
    if not start.fits:
        lines.append(f"vLLM starts after the four models are built: at most --vllm_gpu_memory_utilization "
                     f"{max_vllm_utilization(base):.2f} passes its start-up check on this layout "
                     f"(asked: {cfg.vllm_gpu_memory_utilization:g})")
    for k in range(0, max_changes + 1):
        found = []
        for chosen in itertools.combinations(groups, k):
            for combo in itertools.product(*chosen):
                changes: dict = {}
                for _, ch in combo:
                    changes.update(ch)
                try:
                    trial = _with_feasible_utilization(replace(cfg, **changes))
                except ValueError:  # e.g. a TP x PP that does not divide the GPUs
                    continue
                p = plan(trial)
                if p.fits:
                    util = (f"--vllm_gpu_memory_utilization {trial.vllm_gpu_memory_utilization:g}"
                            if trial.vllm_gpu_memory_utilization != cfg.vllm_gpu_memory_utilization else "")
                    what = " ".join([lb for lb, _ in combo] + ([util] if util else []))
                    found.append(f"fits with {what} (peak {p.peak.total / GiB:.1f} GiB in {p.peak.phase}; vLLM KV "
                                 f"cache {p.vllm.kv_tokens} tokens per engine shard)")
        if found:
            return lines + found[:max_lines]
    labels = ", ".join(lb for g in groups for lb, _ in g)
    lines.append(f"no combination of up to {max_changes} of {labels} fits: shorten sequences or use a smaller model")
    return lines


# ---------------------------------------------------------------------------------------------- printing
def _gib(x: float, width: int = 8) -> str:
    return f"{x / GiB:{width}.2f}"


def format_plan(p: Plan) -> str:
    """The per-phase tables, as printed by tools/plan_memory.py (GiB per device)."""
    c = p.cfg
    lines = [f"layout: {c.nnodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB; tp={c.tp} pp={c.pp} "
             f"dp={c.dp}; vLLM {c.world // c.vllm_tensor_parallel_size} engine(s) x TP {c.vllm_tensor_parallel_size}"
             f"; {'bf16' if c.bf16 else 'fp32'}; layers={c.layer_impl}; seq {c.seq_len} tokens "
             f"(prompt {c.prompt_max_len} + generate {c.generate_max_len})",
             f"flags: zero_stage={c.zero_stage} gradient_checkpointing={c.gradient_checkpointing} colocate_all="
             f"{c.colocate_all} ref_reward_offload={c.ref_reward_offload} adam_offload={c.adam_offload} "
             f"micro_train={c.micro_train_batch_size} micro_rollout={c.micro_rollout_batch_size} vllm_util="
             f"{c.vllm_gpu_memory_utilization:g}", ""]
    header = f"{'phase':<21}{'role':<17}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'total':>9}"
    lines += [header + "   (GiB per GPU)", "-" * len(header)]
    for ph in p.phases:
        name = ph.phase + (f" [pp{ph.stage}]" if c.pp > 1 else "")
        first = True
        for role, r in ph.rows.items():
            if not any(r.values()):
                continue
            lines.append(f"{name if first else '':<21}{role:<17}{_gib(r['params'])}{_gib(r['grads'])}"
                         f"{_gib(r['optimizer'])}{_gib(r['activations'])}{_gib(sum(r.values()), 9)}")
            first = False
        for k, v in list(ph.vllm.items()) + list(ph.other.items()):
            label = f"vLLM {k}" if k in ph.vllm else k
            lines.append(f"{name if first else '':<21}{label:<17}{'':>32}{_gib(v, 9)}")
            first = False
        verdict = "fits" if ph.fits else f"OOM by {(ph.total - ph.capacity) / GiB:.1f} GiB"
        lines.append(f"{'':<21}{'= total':<17}{'':>32}{_gib(ph.total, 9)}  of {ph.capacity / GiB:.0f}: {verdict}")
        lines.append("")
    vm = p.vllm
    lines.append(f"vLLM: weights {vm.weights / GiB:.2f} GiB, KV cache {vm.kv_cache / GiB:.2f} GiB = {vm.kv_tokens} "
                 f"tokens per engine shard ({vm.kv_bytes_per_token} B/token), {vm.kv_tokens_wanted} wanted")
    lines.append(f"host memory for offloaded states: {p.host_per_node / GiB:.0f} GiB per node")
    lines += p.notes
    lines.append(f"peak: {p.peak.total / GiB:.1f} GiB in {p.peak.phase}: "
                 + ("FITS" if p.fits else "DOES NOT FIT (" + "; ".join(p.problems) + ")"))
    return "\n".join(lines)


def format_markdown(p: Plan) -> str:
    """One row per phase (GiB per GPU at its worst pipeline stage), for documentation."""
    roles = ("actor", "critic", "ref", "reward") + (("teacher",) if p.cfg.teacher is not None else ())
    out = ["| phase | " + " | ".join(roles) + " | vLLM | other | total | fits |",
           "| --- | " + "---: | " * len(roles) + "---: | ---: | ---: | --- |"]
    for ph in p.phases:
        cells = [f"{sum(ph.rows[r].values()) / GiB:.1f}" if r in ph.rows and any(ph.rows[r].values()) else "-"
                 for r in roles]
        vllm = f"{sum(ph.vllm.values()) / GiB:.1f}" if ph.vllm else "-"
        out.append(f"| {ph.phase} | " + " | ".join(cells) + f" | {vllm} | {sum(ph.other.values()) / GiB:.1f} | "
                   f"{ph.total / GiB:.1f} | {'yes' if ph.fits else 'no'} |")
    return "\n".join(out)
