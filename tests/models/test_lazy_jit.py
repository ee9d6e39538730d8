"""rlhf.compat.lazy_jit: megatron-core's torch.compile decorators compile at first call instead of at import."""
import subprocess
import sys

import torch
from helpers import REPO
from helpers import test_env as child_env

from rlhf.compat.lazy_jit import lazy_compile


def test_lazy_compile_defers_and_forwards_every_call_form():
    calls = []

    def fake_compile(fn, **kw):
        calls.append(kw)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    lazy = lazy_compile(fake_compile)

    @lazy
    def f(x, y=1):
        return x + y

    g = lazy(mode="max-autotune")(lambda x: 2 * x)
    h = lazy(lambda x: -x, dynamic=True)
    assert calls == []  # nothing compiled at decoration
    assert f(1, y=2) == ("compiled", 3) and f(5) == ("compiled", 6)
    assert g(3) == ("compiled", 6) and h(4) == ("compiled", -4)
    assert calls == [{}, {"mode": "max-autotune"}, {"dynamic": True}]  # once per function, kwargs kept
    assert f.__name__ == "f"


def test_megatron_import_does_not_load_inductor():
    code = ("import sys, rlhf, megatron.core, megatron.core.jit as j\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "print(getattr(j.jit_fuser, '__rlhf_lazy_compile__', False),"
            " getattr(bias_gelu, '__rlhf_lazy_compile__', False), 'torch._inductor.compile_fx' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-3:] == ["True", "True", "False"], p.stdout


def test_compiled_on_first_call_matches_eager():
    lazy = lazy_compile(torch.compile)
    f = lazy(lambda x: torch.nn.functional.silu(x) * x, backend="eager")  # dynamo without a C++ toolchain
    x = torch.randn(16)
    torch.testing.assert_close(f(x), torch.nn.functional.silu(x) * x, rtol=0, atol=0)
