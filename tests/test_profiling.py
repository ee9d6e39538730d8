"""RLHF_PROFILE_STEPS: the opt-in profiler over chosen steps of a supervised run (used on the GPU for the MFU run)."""
import pytest
import torch

from rlhf.observability.profiling import StepProfiler, profile_range


@pytest.mark.parametrize("spec,want", [("", None), ("3", (3, 3)), ("4-6", (4, 6))])
def test_profile_range(monkeypatch, spec, want):
    monkeypatch.setenv("RLHF_PROFILE_STEPS", spec)
    assert profile_range() == want


@pytest.mark.parametrize("spec", ["x", "0-2", "5-3", "1-2-3"])
def test_a_malformed_range_names_the_variable(monkeypatch, spec):
    monkeypatch.setenv("RLHF_PROFILE_STEPS", spec)
    with pytest.raises(ValueError, match="RLHF_PROFILE_STEPS"):
        profile_range()


def test_only_the_chosen_steps_are_profiled(monkeypatch, tmp_path):
    """Steps 2-3 of 4: the table counts the matmuls of those two steps alone (3 products each), not of 1 or 4."""
    monkeypatch.setenv("RLHF_PROFILE_STEPS", "2-3")
    monkeypatch.delenv("RLHF_PROFILE_DIR", raising=False)
    prof = StepProfiler(str(tmp_path), is_rank0=True)
    a = torch.randn(8, 8)
    for n in range(1, 5):
        with prof.step(n):
            for _ in range(3):
                a = torch.mm(a, a).tanh()
    text = (tmp_path / "profile_steps_2-3.txt").read_text()
    row = next(line for line in text.splitlines() if line.strip().startswith("aten::mm "))
    assert row.split()[-1] == "6", row
