"""--context_parallel_size: bad layouts and what CP does not do yet are refused by name before any model loads;
the split itself (rlhf.models.context_parallel.make_layout) against a hand computation."""
import argparse

import pytest
import torch


def test_layouts_are_checked_before_anything_starts():
    from rlhf.distributed.mesh import validate_layout

    assert validate_layout(8, 2, 1, cp=2) == 2 and validate_layout(8, 1, 2, cp=4) == 1
    with pytest.raises(ValueError, match="world size 6 is not divisible by --tensor_model_parallel_size 2 x "
                                         "--pipeline_model_parallel_size 1 x --context_parallel_size 2"):
        validate_layout(6, 2, 1, cp=2)
    with pytest.raises(ValueError, match="--context_parallel_size must be >= 1, got 0"):
        validate_layout(2, 1, 1, cp=0)
    assert validate_layout(8, 1, 1, ep=2, cp=2) == 4  # EP with CP: the experts spread over the DP ranks


def test_what_cp_does_not_do_is_refused_by_name(monkeypatch):
    from rlhf.models import gpt
    from rlhf.models.context_parallel import check_cp_flags
    from rlhf.models.spec import ModelSpec

    check_cp_flags(2, argparse.Namespace(num_experts=0, attention_dropout=0.0), "--pretrain")  # fine
    check_cp_flags(2, argparse.Namespace(num_experts=8, attention_dropout=0.0), "--pretrain")  # MoE runs under CP
    check_cp_flags(1, argparse.Namespace(num_experts=8, attention_dropout=0.1), "--pretrain")  # CP 1: anything
    with pytest.raises(ValueError, match="attention_dropout=0.1 is not supported with context parallelism"):
        check_cp_flags(2, argparse.Namespace(num_experts=0, attention_dropout=0.1), "--critic_pretrain")
    assert "attention_dropout" in ModelSpec.__dataclass_fields__  # what the check reads
    with pytest.raises(ValueError, match="--transformer_impl transformer_engine with --context_parallel_size 2"):
        gpt.resolve_transformer_impl("transformer_engine", cp=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto picks the local layers under CP
    assert gpt.resolve_transformer_impl(None, cp=2) == "local"


def test_ppo_refuses_the_megatron_generator_under_cp(tmp_path):
    from rlhf.ppo.args import add_args, validate

    p = argparse.ArgumentParser()
    add_args(p)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    args = p.parse_args(["--pretrain", str(tmp_path), "--prompt_data", str(prompts), "--reward_fn", "x:y",
                         "--save_path", str(tmp_path / "out"),
                         "--context_parallel_size", "2", "--rollout_backend", "megatron"])
    with pytest.raises(ValueError, match="--context_parallel_size 2 with --rollout_backend megatron"):
        validate(args, world_size=2)


@pytest.mark.parametrize("lengths,cp,rank,local,pos", [
    # one 6-token row at CP2: padded to 8, chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    ([6], 2, 0, [0, 1, 6, 7], [0, 1, 6, 7]),
    ([6], 2, 1, [2, 3, 4, 5], [2, 3, 4, 5]),
    # a packed stream of 3 and 5 tokens at CP2: each padded to 4 and 8 (stream of 12), split on its own
    ([3, 5], 2, 0, [0, 3, 4, 5, 10, 11], [0, 3, 0, 1, 6, 7]),
    ([3, 5], 2, 1, [1, 2, 6, 7, 8, 9], [1, 2, 2, 3, 4, 5]),
])
def test_the_split_by_hand(lengths, cp, rank, local, pos):
    from rlhf.models.context_parallel import make_layout

    lay = make_layout(lengths, cp, rank, group=None)
    assert lay.local.tolist() == local and lay.pos.tolist() == pos
    assert lay.keep.tolist() == ([0, 1, 2, 3, 4, 5] if lengths == [6] else [0, 1, 2, 4, 5, 6, 7, 8])
    # the gathered (rank-major) stream put back in order is the padded stream
    other = make_layout(lengths, cp, 1 - rank, group=None)
    gathered = (lay.local.tolist() + other.local.tolist()) if rank == 0 else (other.local.tolist() +
                                                                             lay.local.tolist())
    assert [gathered[i] for i in lay.order.tolist()] == list(range(lay.padded_len))


def test_a_stream_split_as_a_longer_one_and_where_positions_lie():
    """``total`` (packed streams under CP and PP: one length for every micro-batch) appends a sequence of padding
    only, split as any other; ``local_index`` finds a caller position among a rank's tokens. By hand."""
    from rlhf.models.context_parallel import local_index, make_layout

    lay = make_layout([3, 5], 2, 0, group=None, total=16)  # padded 4 + 8, then 4 of padding: chunks of 1
    assert lay.local.tolist() == [0, 3, 4, 5, 10, 11, 12, 15] and lay.pos.tolist() == [0, 3, 0, 1, 6, 7, 0, 3]
    assert lay.keep.tolist() == [0, 1, 2, 4, 5, 6, 7, 8] and lay.padded_len == 16
    for bad in (14, 8):
        with pytest.raises(ValueError, match=f"cannot be split as {bad} tokens over 2 CP ranks"):
            make_layout([3, 5], 2, 0, group=None, total=bad)
    assert local_index(make_layout([6], 2, 0, None), torch.arange(6)).tolist() == [0, 1, -1, -1, -1, -1]
    assert local_index(make_layout([6], 2, 1, None), torch.arange(6)).tolist() == [-1, -1, 0, 1, 2, 3]
    # the packed stream: caller tokens 3 and 4 (the second sequence's first two) are padded-stream tokens 4 and 5,
    # rank 0's third and fourth; caller token 7 (stream 8) lies on rank 1
    assert local_index(lay, torch.tensor([[3, 0], [4, 7]])).tolist() == [[2, 0], [3, -1]]
