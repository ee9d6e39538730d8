"""Weight gradients into megatron's fp32 ``main_grad`` inside the GEMM (``rlhf.compat.main_grad``, the fused part
``wgrad`` on CUDA). On CPU torch has no fp32-output bf16 GEMM, so these tests stand CUDA's ``torch.addmm(...,
out_dtype=torch.float32)`` in by its definition (fp32 products of the bf16 operands) and check the rest: the check
before use and its named fallback, which calls are routed, and a bf16 training step through megatron's DDP whose
gradient norm is megatron's own path's. The op itself is checked against fp64 on a GPU
(``tests/kernels/triton_cases.py`` with ``KERNELS_TEST_DEVICE=cuda``)."""
import logging

import pytest
import torch

from rlhf.compat import main_grad

REAL_ADDMM = torch.addmm


def emulated_addmm(inp, a, b, *args, out_dtype=None, out=None, **kw):
    """CUDA's ``addmm.dtype_out`` by its definition: ``inp + a @ b`` with fp32 products of the (exact) bf16 values."""
    if out_dtype is None:
        return REAL_ADDMM(inp, a, b, *args, **kw) if out is None else REAL_ADDMM(inp, a, b, *args, out=out, **kw)
    r = REAL_ADDMM(inp.to(out_dtype), a.to(out_dtype), b.to(out_dtype), *args, **kw)
    return r if out is None else out.copy_(r)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(main_grad, "_checked", {})


def test_the_check_before_use_and_its_named_fallback(fresh, monkeypatch, caplog):
    """No op (this CPU's torch), or an op that rounds the sum to bf16: not used, logged once naming the fallback;
    the op as CUDA defines it: used."""
    def missing(*a, out_dtype=None, **k):
        raise NotImplementedError("Could not run 'aten::addmm.dtype_out' with arguments from the 'CPU' backend")

    def rounded(inp, a, b, *args, out_dtype=None, out=None, **kw):
        return out.add_((a @ b).to(out_dtype)) if out_dtype is not None else REAL_ADDMM(inp, a, b, *args, **kw)

    for op, why in ((missing, "NotImplementedError: Could not run 'aten::addmm.dtype_out'"), (rounded, "off by")):
        monkeypatch.setattr(main_grad, "_checked", {})
        monkeypatch.setattr(torch, "addmm", op)
        with caplog.at_level(logging.WARNING, logger=main_grad.__name__):
            caplog.clear()
            assert not main_grad.bf16_accumulation_works("cpu")
            assert not main_grad.bf16_accumulation_works("cpu")
        assert len(caplog.records) == 1 and why in caplog.text, caplog.text
        assert "megatron's own weight gradient runs" in caplog.text
        assert main_grad.use_main_grad_linears(_layers(), "cpu") == 0
    monkeypatch.setattr(main_grad, "_checked", {})
    monkeypatch.setattr(torch, "addmm", emulated_addmm)
    assert main_grad.bf16_accumulation_works("cpu")
    assert main_grad.use_main_grad_linears(_layers(), "cpu") == 2


def _layers() -> torch.nn.Module:
    """Two megatron linear layers, not initialised (no parallel state needed): what the routing looks for."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    out = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        out.append(m)
    return torch.nn.ModuleList(out)


class _Own:
    """Stands in for a megatron layer class: its own ``_forward_impl`` records that it ran."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        return "megatron's own"


@pytest.mark.parametrize("call,routed", [
    (dict(), True), (dict(bias=True), True), (dict(allreduce_dgrad=True), False), (dict(sequence_parallel=True), False),
    (dict(gradient_accumulation_fusion=True), False), (dict(grad_output_buffer=[]), False),
    (dict(no_main_grad=True), False), (dict(fp32_input=True), False)])
def test_only_calls_without_communication_on_trained_weights_are_routed(call, routed, monkeypatch):
    monkeypatch.setattr(torch, "addmm", emulated_addmm)
    w = torch.randn(3, 4).bfloat16().requires_grad_()
    if not call.pop("no_main_grad", False):
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(3, 4), False
    x = torch.randn(5, 4).to(torch.float32 if call.pop("fp32_input", False) else torch.bfloat16)
    bias = torch.randn(3).bfloat16() if call.pop("bias", False) else None
    # positional, as megatron-core 0.16.1's layers pass them: bias, gradient_accumulation_fusion, allreduce_dgrad, ...
    args = tuple(bias if a == "bias" else call.get(a, None if a == "grad_output_buffer" else False)
                 for a in main_grad.COMM_ARGS)
    y = main_grad._cuda_forward_impl(_Own(), x, w, *args)
    assert (y != "megatron's own") == routed
    if routed:
        want = x.float() @ w.detach().float().T + (0 if bias is None else bias.float())
        torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=1e-2)
        y.backward(torch.ones_like(y))
        assert w.grad_added_to_main_grad
        torch.testing.assert_close(w.main_grad, torch.ones(5, 3).T @ x.float())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("main_grad")
    make_tiny_hf(str(work / "hf"), "llama", seed=3, num_hidden_layers=2, hidden_size=64)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    yield mesh, str(work / "hf")
    destroy_mesh()


def _batches():
    from rlhf.data import SFTSample, collate_sft

    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return [collate_sft([SFTSample(t(s), torch.arange(len(s)) >= 2, 2, "a")], 0)
            for s in ([5, 6, 7, 2, 9, 11, 3], [8, 4, 4, 12, 30, 1, 7, 9, 2])]


def test_a_bf16_step_through_megatrons_ddp_matches_its_own_weight_gradients(tiny, fresh, monkeypatch):
    """The tiny Llama in bf16 (Float16Module, DDP's fp32 main_grad), two micro-batches a step, every linear layer
    routed: its gradient norm is that of megatron's own layers (which round each weight gradient to bf16 before DDP
    adds it: 2^-8 relative at most) for 3 steps, every routed weight was accumulated directly (DDP's hook skipped its
    add), and none of megatron's own layers was."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.supervised.sft import SFTTask

    mesh, hf = tiny
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "bf16")  # megatron's own bf16 layers on CPU, not rlhf.compat.onednn's
    monkeypatch.setattr(torch, "addmm", emulated_addmm)
    norms, direct = {}, {}
    for routed in (False, True):
        optim = OptimConfig(lr=1e-3, total_steps=3, warmup_ratio=0.0, scheduler="constant")
        eng = ModelRole(mesh, hf, optim=optim, name=f"sft_{routed}", bf16=True)
        if routed:
            linears = [m for m in eng.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
            assert main_grad.use_main_grad_linears(eng.model, "cpu") == len(linears) >= 8
        norms[routed] = [eng.train_step(_batches(), SFTTask().loss_fn(eng), ("loss",))["grad_norm"]
                         for _ in range(3)]
        direct[routed] = sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in eng.model.parameters())
    assert direct[False] == 0 and direct[True] >= 8, direct
    for own, ours in zip(norms[False], norms[True]):
        assert abs(ours - own) <= 8e-3 * own, (norms, direct)
