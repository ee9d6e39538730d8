"""On-policy distillation in the PPO job (``--teacher_pretrain``): its part (``DistillConfig``), the check that
the teacher shares the student's tokenizer (before any model is loaded), and the step's advantage term.

The teacher is one more frozen model of the colocated job, built like the reference model (``rlhf.ppo.roles``),
run in make_experience after it (``rlhf.ppo.stages.frozen_forwards``: its log-probs of the sampled tokens at the
sampling temperature) and offloaded between its forwards (``--teacher_offload``). The signal and its formulation:
``rlhf.algo.distill``; docs/distillation.md."""
from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.part import Part, flag

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class DistillConfig(Part):
    """The teacher and the weights of the two advantage terms (``rlhf.algo.distill``)."""

    teacher_pretrain: str | None = flag(help="on-policy distillation: the teacher (HF folder or megatron checkpoint) "
                                             "scores each sampled token; same tokenizer as --pretrain (a larger "
                                             "model is fine)", default=None)
    """(--teacher_pretrain) the teacher: HF folder or converted megatron checkpoint, with the student's tokenizer"""
    teacher_offload: bool = flag(action="store_true", help="keep the teacher's weights on host outside "
                                                           "make_experience", default=False)
    """(--teacher_offload) the teacher's weights on host outside make_experience"""
    distill_coef: float | None = flag(type=float, help="weight of the per-token advantage -(log p_student - log "
                                                       "p_teacher) (default 1.0 with --teacher_pretrain)", default=None)
    """(--distill_coef) weight of the per-token reverse-KL advantage; 1.0 when a teacher is given"""
    task_reward_coef: float = flag(type=float, help="with --teacher_pretrain: weight of the task reward's advantages "
                                                    "(0: pure distillation, which needs no reward source; a reward "
                                                    "given is still logged and evaluated)", default=1.0)
    """(--task_reward_coef) weight of the task reward's advantages beside it; 0: pure on-policy distillation (the
    reward is still computed, logged and used by the held-out evaluation when there is one; none is needed)"""
    distill_kl_discount: float = flag(type=float, help="with --teacher_pretrain: each token's distillation advantage "
                                                       "is the discounted sum of the reverse KL at and after it, "
                                                       "with this factor in [0, 1) (tinker's kl_discount_factor; 0: "
                                                       "the token's own)", default=0.0)
    """(--distill_kl_discount) the per-token term as the discounted sum of the signal at and after each token
    (tinker's kl_discount_factor); 0: each token's own signal"""


    def check(self) -> None:
        if self.teacher_pretrain is None:
            for flag, value, default in (("--distill_coef", self.distill_coef, None),
                                         ("--task_reward_coef", self.task_reward_coef, 1.0),
                                         ("--teacher_offload", self.teacher_offload, False),
                                         ("--distill_kl_discount", self.distill_kl_discount, 0.0)):
                if value != default:
                    raise ValueError(f"{flag} {value} needs --teacher_pretrain (there is no teacher to distill from)")
            return
        if self.distill_coef is None:
            self.distill_coef = 1.0
        if not self.distill_coef > 0:
            raise ValueError(f"--distill_coef must be > 0 with --teacher_pretrain, got {self.distill_coef} (0 would "
                             "load the teacher for nothing: drop --teacher_pretrain instead)")
        if not self.task_reward_coef >= 0:
            raise ValueError(f"--task_reward_coef must be >= 0, got {self.task_reward_coef}")
        if not 0 <= self.distill_kl_discount < 1:
            raise ValueError(f"--distill_kl_discount must be in [0, 1), got {self.distill_kl_discount}")


def tokenizer_mismatch(student, teacher) -> str:
    """What differs between two tokenizers, "" when nothing that changes a token id's meaning does: the vocabulary
    size, the token -> id map, the special token ids."""
    if len(student) != len(teacher):
        return f"vocabulary size: student {len(student)} tokens, teacher {len(teacher)}"
    sv, tv = student.get_vocab(), teacher.get_vocab()
    diff = sorted(t for t in sv if tv.get(t) != sv[t])
    if diff:
        t = diff[0]
        return (f"vocabulary: {len(diff)} token(s) have other ids (e.g. {t!r}: student {sv[t]}, teacher "
                f"{tv.get(t)})")
    for name in SPECIAL_TOKENS:
        s, t = getattr(student, name, None), getattr(teacher, name, None)
        if s != t:
            return f"special token ids: {name} student {s}, teacher {t}"
    return ""


def check_teacher(cfg: DistillConfig, student_path: str, par) -> dict | None:
    """Before any model is loaded: the teacher's config (``describe_source``) fits the layout ``par`` (the job's
    ``ParallelPart``: the teacher runs on the student's mesh) and its tokenizer files give the student's
    tokenizer; ValueError naming --teacher_pretrain and what differs otherwise. Returns the teacher's source."""
    if cfg.teacher_pretrain is None:
        return None
    from rlhf.models.context_parallel import check_cp_flags
    from rlhf.models.source import describe_source, load_tokenizer
    from rlhf.models.spec import check_parallel_fit

    flag, path = "--teacher_pretrain", cfg.teacher_pretrain
    try:
        src = describe_source(path)
    except ValueError as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    student, teacher = load_tokenizer(student_path), load_tokenizer(path, flag)
    why = tokenizer_mismatch(student, teacher)
    if why:
        raise ValueError(f"{flag} {path}: its tokenizer differs from --pretrain {student_path}'s ({why}); the "
                         "teacher must score the student's token ids, so it needs the same tokenizer")
    if src["spec"].vocab_size < len(student):
        raise ValueError(f"{flag} {path}: its embedding has {src['spec'].vocab_size} rows, fewer than the "
                         f"{len(student)} tokens of the shared tokenizer")
    from rlhf.models.source import describe_source as _describe

    student_rows = _describe(student_path)["spec"].vocab_size
    if src["spec"].vocab_size < student_rows:
        raise ValueError(f"{flag} {path}: its LM head has {src['spec'].vocab_size} rows, the student's "
                         f"{student_rows}: the student can sample ids {src['spec'].vocab_size}..{student_rows - 1} "
                         "(padding rows past its tokenizer) that the teacher cannot score; use a teacher whose head "
                         "has at least the student's rows")
    src["score_vocab"] = student_rows  # the teacher's log-probs over the ids the student can sample
    if src["spec"].vocab_size > student_rows:
        import logging

        logging.getLogger("rlhf").info("%s: its LM head has %d rows, the student's %d; the teacher is scored over the "
                                       "student's %d ids (the shared tokenizer's range and the student's padding), "
                                       "its other rows left out", flag, src["spec"].vocab_size, student_rows,
                                       student_rows)
    check_parallel_fit(src["spec"], par.tp, par.pp, src["padded_vocab"])
    check_cp_flags(par.cp, src["spec"], flag)
    return src


def add_distill_advantages(exp, cfg: DistillConfig, mesh) -> dict[str, float]:
    """``exp.advantages`` (B, T) <- ``--task_reward_coef`` x the task's - ``--distill_coef`` x (the old
    log-probs - the teacher's), on this rank's rows; returns ``distill/reverse_kl``, the signal's mean over the
    global batch's response tokens."""
    from rlhf.algo.distill import distill_advantages
    from rlhf.algo.ppo_losses import masked_mean
    from rlhf.distributed.collectives import dp_all_gather

    mask = exp.batch["action_mask"]
    exp.advantages, signal = distill_advantages(exp.advantages, exp.old_logprobs, exp.teacher_logprobs, mask,
                                                cfg.distill_coef, cfg.task_reward_coef, cfg.distill_kl_discount)
    return {"distill/reverse_kl": masked_mean(dp_all_gather(signal, mesh), dp_all_gather(mask, mesh)).item()}
