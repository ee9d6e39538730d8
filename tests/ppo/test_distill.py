"""On-policy distillation (--teacher_pretrain; launch/ppo.py's body in this process, one rank, the megatron
generator, GRPO, pure distillation with --task_reward_coef 0): the per-token signal against transformers' own
forwards of the student and the teacher on the same tokens (at one rank, packed with LoRA and --distill_coef 0.5, and
at TP 2 and PP 2); a teacher equal to the student gives zero signal and leaves the weights as they were (control:
another teacher moves them); resume with a teacher is exact, told from a fresh start by its log line and first step;
a teacher with another tokenizer is refused by name before any model is loaded."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from ppo_common import DIMS, TINY_GRPO, ppo_args
from safetensors.torch import load_file

PURE = {**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--rollout_backend": "megatron",
        "--task_reward_coef": "0", "--init_kl_coef": "0", "--max_samples": "8", "--save_steps": "1",
        "--actor_learning_rate": "1e-3", "--temperature": "0.9", "--generate_max_len": "4"}
"""2 steps of 4 prompts x 2 replies; the task reward is logged, its advantages weigh 0."""


@pytest.fixture(scope="module")
def teachers(ppo_setup):
    """A larger teacher (4 layers, another seed) with the student's tokenizer, and two with other tokenizers."""
    from transformers import AutoTokenizer

    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    work, actor = ppo_setup["work"], ppo_setup["actor"]
    big = make_tiny_hf(os.path.join(work, "teacher"), "llama", seed=11, tokenizer_dir=actor,
                       **{**DIMS, "num_hidden_layers": 4})
    make_tokenizer(os.path.join(work, "tok300"), vocab_size=300)
    vocab = make_tiny_hf(os.path.join(work, "teacher_vocab"), "llama", seed=12,
                         tokenizer_dir=os.path.join(work, "tok300"), **DIMS)
    eos = os.path.join(work, "teacher_eos")
    shutil.copytree(actor, eos, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(actor)
    tok.eos_token = "<pad>"  # same vocabulary, another end-of-sequence id
    tok.save_pretrained(eos)
    return {"big": big, "vocab": vocab, "eos": eos}


def _run(setup, out, teacher, monkeypatch, *extra, capture=None, flags=None):
    from helpers import free_port

    import rlhf.ppo.distill as distill
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if capture is not None:  # each step's experience as the distillation term sees it
        orig = distill.add_distill_advantages

        def spy(exp, cfg, mesh):
            m = orig(exp, cfg, mesh)
            capture.append({"batch": {k: v.cpu().clone() for k, v in exp.batch.items()},
                            "advantages": exp.advantages.cpu().clone(), "metrics": m})
            return m
        monkeypatch.setattr(distill, "add_distill_advantages", spy)
    argv = ppo_args(setup, str(out), **{**PURE, "--teacher_pretrain": teacher, **(flags or {})}) + list(extra)
    assert main(argv) == 0
    from rlhf.observability.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    return [m[s] for s in sorted(m)], load_file(str(out / "model.safetensors"))


def _hf_logprobs(path: str, batch: dict, temperature: float, rows: int | None = None) -> torch.Tensor:
    """transformers' log-probs (B, T) of the response tokens at ``temperature`` (over the first ``rows`` ids of the
    LM head when given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits if rows is None else logits[..., :rows]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, S, V)
    at = lp.gather(1, batch["resp_pos"].unsqueeze(-1).expand(-1, -1, lp.shape[-1]))  # (B, T, V)
    return at.gather(2, batch["response_ids"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def straight(ppo_setup, teachers, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    out, steps = tmp_path_factory.mktemp("straight"), []
    try:
        hist, weights = _run(ppo_setup, out, teachers["big"], mp, capture=steps)
    finally:
        mp.undo()
    return out, hist, weights, steps


def test_signal_equals_transformers_and_a_teacher_moves_the_student(ppo_setup, teachers, straight):
    _, hist, weights, steps = straight
    assert len(hist) == 2 and len(steps) == 2
    first = steps[0]  # step 1: the student is still the initial actor
    b, mask = first["batch"], first["batch"]["action_mask"]
    want = (_hf_logprobs(ppo_setup["actor"], b, 0.9) - _hf_logprobs(teachers["big"], b, 0.9)) * mask
    got = -first["advantages"]  # --task_reward_coef 0, --distill_coef 1: the advantage is minus the signal
    assert mask.sum() > 4 and want[mask].abs().median() > 1e-2, want  # a signal worth comparing
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert hist[0]["distill/reverse_kl"] == pytest.approx((want.sum() / mask.sum()).item(), abs=2e-5)
    assert "reward" in hist[0]  # the task reward is still logged
    initial = load_file(f"{ppo_setup['actor']}/model.safetensors")
    assert any(not torch.equal(weights[k], initial[k]) for k in initial)  # control: another teacher moves them


def test_signal_with_packed_dynamic_micro_batches_lora_and_half_the_weight(ppo_setup, teachers, tmp_path,
                                                                            monkeypatch):
    """The teacher reads the student's packed micro-batches formed by token count, the student trains LoRA
    adapters (zero at step 1, so the student is still the initial model), ``--distill_coef 0.5`` weighs the term
    and ``--distill_kl_discount 0.5`` sums it over the later tokens (tinker's kl_discount_factor, its
    ``discounted_future_sum_vectorized`` written out below): the straight run above checks weight 1 and no discount,
    so a weight read as 1 or a discount ignored fails here."""
    steps: list = []
    hist, _ = _run(ppo_setup, tmp_path / "o", teachers["big"], monkeypatch, "--packing_samples", "--use_dynamic_batch",
                   "--prompt_max_len", "16", "--max_tokens_per_gpu", "24", "--lora_rank", "4",
                   "--distill_coef", "0.5", "--distill_kl_discount", "0.5", capture=steps)
    b, mask = steps[0]["batch"], steps[0]["batch"]["action_mask"]
    want = (_hf_logprobs(ppo_setup["actor"], b, 0.9) - _hf_logprobs(teachers["big"], b, 0.9)) * mask
    assert mask.sum() > 4 and want[mask].abs().median() > 1e-2, want

    def tinker_discounted(x, gamma):  # tinker_cookbook/rl/metrics.py discounted_future_sum_vectorized, per row
        out, running = torch.empty_like(x), torch.zeros(())
        for t in range(len(x) - 1, -1, -1):
            running = x[t] + gamma * running
            out[t] = running
        return out

    discounted = torch.stack([tinker_discounted(r, 0.5) for r in 0.5 * want]) * mask  # rows right-padded
    torch.testing.assert_close(-steps[0]["advantages"], discounted, atol=5e-5, rtol=0)
    assert (discounted - 0.5 * want)[mask].abs().max() > 1e-2  # the discount changes the term here
    assert hist[1]["distill/reverse_kl"] != hist[0]["distill/reverse_kl"]  # the adapters moved the student


def test_teacher_equal_to_the_student_gives_zero_and_moves_nothing(ppo_setup, tmp_path, monkeypatch):
    """Pure distillation with no reward source at all (no --reward_fn: tinker and slime need none): a teacher
    equal to the student gives zero signal and moves nothing; the reward logged is 0."""
    steps: list = []
    hist, weights = _run(ppo_setup, tmp_path / "o", ppo_setup["actor"], monkeypatch, capture=steps,
                         flags={"--reward_fn": None})
    assert all(h["distill/reverse_kl"] == 0.0 and h["reward"] == 0.0 for h in hist), hist
    assert all(torch.count_nonzero(s["advantages"]) == 0 for s in steps)
    initial = load_file(f"{ppo_setup['actor']}/model.safetensors")
    assert weights.keys() == initial.keys() and all(torch.equal(weights[k], initial[k]) for k in initial)


@pytest.mark.parametrize("split", ["--tp", "--pp"])
def test_teacher_at_tp2_or_pp2_gives_the_one_rank_signal(ppo_setup, teachers, tmp_path, split):
    """Student and a teacher unlike it (4 layers, another seed) split over TP 2 or PP 2 (2 ranks, launch/ppo.py
    through tests/ppo/_distill_worker.py, which saves each rank's first step): every rank's advantages equal
    -(student - teacher) log-probs from transformers' one-process forwards on the same tokens, as at one rank;
    a teacher loaded or sharded unlike the student, or ignored, fails it."""
    from helpers import REPO, run_torchrun, tail

    out, dump = tmp_path / "split", tmp_path / "dump"
    dump.mkdir()
    argv = ppo_args(ppo_setup, str(out), **{**PURE, "--teacher_pretrain": teachers["big"], split: "2"})
    p = run_torchrun(os.path.join(os.path.dirname(__file__), "_distill_worker.py"), 2, argv, timeout=600,
                     PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]), RLHF_TEST_DISTILL_DUMP=str(dump))
    assert p.returncode == 0, tail(p)
    assert f"{split[2:]}=2" in p.stdout + p.stderr  # the mesh line
    for r in (0, 1):
        step = torch.load(dump / f"rank{r}.pt")
        b, mask = step["batch"], step["batch"]["action_mask"]
        want = (_hf_logprobs(ppo_setup["actor"], b, 0.9) - _hf_logprobs(teachers["big"], b, 0.9)) * mask
        assert mask.sum() > 4 and want[mask].abs().median() > 1e-2, want
        torch.testing.assert_close(-step["advantages"], want, atol=2e-5, rtol=0)


def _from_step_1(save, dst):
    """The straight run's checkpoint after step 1 (--save_steps 1): where a job stopped after step 1 stands."""
    shutil.copytree(save, dst)
    shutil.rmtree(dst / "checkpoints" / "iter_0000002")
    os.remove(dst / "model.safetensors")
    (dst / "checkpoints" / "latest").write_text("iter_0000001")


def test_resume_with_a_teacher_is_exact(ppo_setup, teachers, straight, tmp_path, monkeypatch, capfd):
    """Resumed from step 1, the job says so, computes step 2 alone (its advantages equal the straight run's step 2,
    teacher signal included) and ends with the straight run's weights. Control: a job that ignores
    ``--load_checkpoint`` (the load a no-op) ends with the same weights too (the straight run is deterministic), so
    only the log line and the first step tell the two apart: it computes 2 steps and says nothing."""
    from rlhf.runtime.checkpoint import Checkpointer

    save, hist, weights, straight_steps = straight
    capfd.readouterr()
    _from_step_1(save, tmp_path / "r")
    steps: list = []
    resumed, w = _run(ppo_setup, tmp_path / "r", teachers["big"], monkeypatch, "--load_checkpoint", capture=steps)
    assert re.search(r"resumed from \S*iter_0000001 \(step 1\)", capfd.readouterr().err)  # the log line
    assert len(steps) == 1, len(steps)  # the first step computed is step 2
    torch.testing.assert_close(steps[0]["advantages"], straight_steps[1]["advantages"], atol=0, rtol=0)
    assert resumed[-1]["distill/reverse_kl"] == hist[-1]["distill/reverse_kl"]
    assert w.keys() == weights.keys() and all(torch.equal(w[k], weights[k]) for k in weights)
    # control: --load_checkpoint ignored
    _from_step_1(save, tmp_path / "c")
    monkeypatch.setattr(Checkpointer, "load_if_any", lambda self, *a, **k: None)
    ctl: list = []
    _, w = _run(ppo_setup, tmp_path / "c", teachers["big"], monkeypatch, "--load_checkpoint", capture=ctl)
    assert "resumed from" not in capfd.readouterr().err and len(ctl) == 2
    assert all(torch.equal(w[k], weights[k]) for k in weights)  # why the weights alone cannot tell


@pytest.mark.parametrize("which,needle", [("vocab", "vocabulary size: student"),
                                          ("eos", "special token ids: eos_token_id")])
def test_another_tokenizer_is_refused_by_name(ppo_setup, teachers, tmp_path, monkeypatch, capsys, which, needle):
    import rlhf.runtime.role
    from rlhf.ppo import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the teacher was checked")

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", boom)
    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{**PURE, "--teacher_pretrain": teachers[which]})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--teacher_pretrain" in err and needle in err, err


@pytest.fixture(scope="module")
def wide(ppo_setup):
    """A teacher whose LM head has 32 rows more than the student's (the same tokenizer; real families differ so:
    Qwen2.5-0.5B has 151936 rows, 7B 152064), and a student with 32 rows past its tokenizer."""
    from transformers import AutoTokenizer

    from rlhf.models.tiny import make_tiny_hf

    work, actor = ppo_setup["work"], ppo_setup["actor"]
    rows = len(AutoTokenizer.from_pretrained(actor))
    teacher = make_tiny_hf(os.path.join(work, "teacher_wide"), "llama", seed=13, tokenizer_dir=actor,
                           **{**DIMS, "vocab_size": rows + 32})
    student = make_tiny_hf(os.path.join(work, "student_wide"), "llama", seed=14, tokenizer_dir=actor,
                           **{**DIMS, "vocab_size": rows + 32})
    return {"teacher": teacher, "student": student, "rows": rows}


def test_a_wider_teacher_is_scored_over_the_students_ids(ppo_setup, wide, tmp_path, monkeypatch):
    """The teacher's head has 32 rows the student cannot sample: its log-probs are normalised over the student's
    rows, as transformers' teacher logits cut to them give (control: over all of its rows they differ)."""
    steps: list = []
    _run(ppo_setup, tmp_path / "o", wide["teacher"], monkeypatch, capture=steps)
    b, mask = steps[0]["batch"], steps[0]["batch"]["action_mask"]
    rows = wide["rows"]
    want = (_hf_logprobs(ppo_setup["actor"], b, 0.9) - _hf_logprobs(wide["teacher"], b, 0.9, rows=rows)) * mask
    torch.testing.assert_close(-steps[0]["advantages"], want, atol=2e-5, rtol=0)
    whole = (_hf_logprobs(ppo_setup["actor"], b, 0.9) - _hf_logprobs(wide["teacher"], b, 0.9)) * mask
    assert (whole - want)[mask.bool()].abs().min() > 1e-3  # the 32 extra rows hold mass


def test_a_narrower_teacher_is_refused_by_name(ppo_setup, wide, tmp_path, monkeypatch, capsys):
    """A student whose head has 32 rows past the shared tokenizer and a teacher with the tokenizer's rows only: the
    student could sample ids the teacher cannot score; refused before any model loads."""
    import rlhf.runtime.role
    from rlhf.ppo import main

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a model was loaded before the teacher was checked")))
    argv = ppo_args({**ppo_setup, "actor": wide["student"]}, str(tmp_path / "o"),
                    **{**PURE, "--teacher_pretrain": ppo_setup["actor"]})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"its LM head has {wide['rows']} rows, the student's {wide['rows'] + 32}" in err, err
