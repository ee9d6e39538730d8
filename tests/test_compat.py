"""rlhf.compat: the version check of the patched packages, the vLLM shared-memory names (the relaunch of a
killed TP job failed with "create shm in SHMManager failed. errno: 17" before them) and vLLM's socket files."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types

import torch

from rlhf import compat


def test_version_mismatch_names_package_and_both_versions():
    assert compat.version_mismatch("vllm", "0.32.0") is None
    assert compat.version_mismatch("vllm", "0.32.0+cpu") is None
    assert compat.version_mismatch("torch", "2.13.0+cpu") is None
    assert compat.version_mismatch("vllm", None) is None  # not installed: nothing patched
    msg = compat.version_mismatch("megatron-core", "0.17.0")
    assert "megatron-core 0.17.0" in msg and "0.16.1" in msg
    assert "2.11.0" in compat.version_mismatch("torch", "2.11.0")


def test_check_version_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_checked", set())
    monkeypatch.setattr(compat, "installed_version", lambda pkg: "0.99.0")
    with caplog.at_level(logging.WARNING, logger="rlhf.compat"):
        compat.check_version("vllm")
        compat.check_version("vllm")
    assert [r.getMessage() for r in caplog.records if "vllm 0.99.0" in r.getMessage()] and len(caplog.records) == 1
    caplog.clear()
    monkeypatch.setattr(compat, "installed_version", lambda pkg: compat.TESTED[pkg])
    with caplog.at_level(logging.WARNING, logger="rlhf.compat"):
        compat.check_version("megatron-core")
    assert not caplog.records


def test_check_versions_one_warning_per_mismatch_once(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_checked", set())
    installed = {**compat.TESTED, "megatron-core": "0.17.0", "torch": "2.13.0+cpu"}
    monkeypatch.setattr(compat, "installed_version", lambda pkg: installed[pkg])
    with caplog.at_level(logging.WARNING, logger="rlhf.compat"):
        msgs = compat.check_versions()
        assert compat.check_versions() == []  # once per process
    assert [r.getMessage() for r in caplog.records] == msgs and len(msgs) == 1
    assert msgs[0].startswith("megatron-core 0.17.0 is installed; rlhf.compat's patches") and "0.16.1" in msgs[0]
    caplog.clear()
    monkeypatch.setattr(compat, "_checked", set())
    monkeypatch.setattr(compat, "installed_version", lambda pkg: compat.TESTED[pkg])
    with caplog.at_level(logging.WARNING, logger="rlhf.compat"):
        assert compat.check_versions() == []
    assert not caplog.records


def test_vllm_generator_drives_the_tested_release():
    from rlhf.compat.vllm import TESTED_VLLM
    from rlhf.rollout import vllm_generator

    assert vllm_generator.TESTED_VLLM is TESTED_VLLM == compat.TESTED["vllm"]


def test_installed_releases_are_the_tested_ones():
    """What setup_env.sh installs here is what the patches were written against (no warning in the suite)."""
    for pkg in ("megatron-core", "vllm", "torch"):
        assert compat.version_mismatch(pkg, compat.installed_version(pkg)) is None, pkg


def test_keep_torch_rng_restores_the_global_generator():
    from rlhf.compat.vllm import keep_torch_rng

    torch.manual_seed(3)
    want = torch.rand(2)
    torch.manual_seed(3)
    with keep_torch_rng():
        torch.manual_seed(123)  # what LLM(seed=...) does
    assert torch.equal(torch.rand(2), want)


def test_cpu_shm_names_get_the_job_tag(monkeypatch):
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from rlhf.compat.vllm_files import new_shm_tag, unique_cpu_shm_names

    from rlhf.compat.vllm_files import _SHM_TAG_ENV

    monkeypatch.setattr(_CPUSHMDistributed, "make_group_name", _CPUSHMDistributed.make_group_name)
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what external_launcher's env:// init method gives every job
    monkeypatch.delenv(_SHM_TAG_ENV, raising=False)  # an engine built earlier in this process tagged its names
    comm = types.SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    plain = _CPUSHMDistributed.make_group_name(comm)
    tag_a, tag_b = new_shm_tag(), new_shm_tag()
    assert tag_a != tag_b
    unique_cpu_shm_names(tag_a)
    assert _CPUSHMDistributed.make_group_name(comm) == tag_a + plain.lstrip("/")
    unique_cpu_shm_names(tag_b)  # a second engine in the process: re-tagged, not tagged twice
    assert _CPUSHMDistributed.make_group_name(comm) == tag_b + plain.lstrip("/")
    assert "/" not in tag_b + plain.lstrip("/")


def _dead_pid() -> int:
    """A pid no process has (above the default pid_max)."""
    dead = 2 ** 22 + 12345
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            return dead


def test_remove_dead_shm_keeps_live_and_foreign_segments(tmp_path):
    from rlhf.compat.vllm_files import _host_id, remove_dead_shm

    dead = _dead_pid()
    host = _host_id()
    other = f"{(int(host, 16) + 1) & 0xffff:04x}"
    names = {f"rlhf{dead}h{host}x0123abcd--tp:0-[0-1]-cpushm_0": False,
             f"rlhf{os.getpid()}h{host}x0123abcd--tp:0-[0-1]-cpushm_0": True,
             f"rlhf{dead}h{other}x0123abcd--tp:0-[0-1]-cpushm_0": True,
             "-tp:0-[0-1]-cpushm_0": True, "psm_1234": True}
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = remove_dead_shm(str(tmp_path))
    assert removed == [f"rlhf{dead}h{host}x0123abcd--tp:0-[0-1]-cpushm_0"]
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)


_IPC_CHILD = """
import os, sys
import zmq
from rlhf.compat.vllm_files import ipc_env, private_ipc_dir
folder = private_ipc_dir() if sys.argv[1] == "private" else None
from vllm.utils.network_utils import get_open_zmq_ipc_path  # what vLLM's MessageQueue binds
with ipc_env(folder):
    addr = get_open_zmq_ipc_path()
    sock = zmq.Context().socket(zmq.XPUB)
    sock.bind(addr)
assert "VLLM_RPC_BASE_PATH" not in os.environ  # restored after the block
path = addr.removeprefix("ipc://")
print(path, folder, os.path.exists(path), flush=True)
from rlhf.distributed.failures import exit_process
exit_process(0)  # how a rank ends: atexit handlers, then os._exit (the socket is never closed)
"""


def test_vllm_socket_files_live_in_a_folder_that_goes_at_exit():
    """A process ending as a rank does (``exit_process``) with a vLLM ipc socket still bound: by default the socket
    file stays in the temporary folder (the control: what every job left in /tmp); after ``private_ipc_dir`` it is
    bound inside ``<tmp>/rlhf-ipc-<pid>h<host>``, which is gone when the process has ended."""
    import pathlib
    import shutil
    import tempfile

    from helpers import REPO

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="rlhf-t-", dir="/tmp"))  # pytest's is too long for a socket path
    try:
        _sockets_in_plain_and_private(tmp_path, REPO)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _sockets_in_plain_and_private(tmp_path, REPO):
    import subprocess
    import sys

    procs = {}
    for mode in ("plain", "private"):
        tmp = tmp_path / mode
        tmp.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
        env.update(TMPDIR=str(tmp), PYTHONPATH=REPO)
        procs[mode] = subprocess.Popen([sys.executable, "-c", _IPC_CHILD, mode], env=env, cwd=REPO, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out[mode] = stdout.split()
    path, folder, bound = out["plain"]
    assert (folder, bound) == ("None", "True") and os.path.dirname(path) == str(tmp_path / "plain")
    assert _sockets(tmp_path / "plain") == [path]  # the control: the socket file outlived the process
    path, folder, bound = out["private"]
    assert bound == "True" and os.path.dirname(path) == folder
    assert os.path.basename(folder).startswith("rlhf-ipc-") and os.path.dirname(folder) == str(tmp_path / "private")
    assert not os.path.exists(folder) and _sockets(tmp_path / "private") == []  # gone with the process


def _sockets(top) -> list[str]:
    import stat

    return [os.path.join(d, f) for d, _, files in os.walk(top) for f in files
            if stat.S_ISSOCK(os.lstat(os.path.join(d, f)).st_mode)]


def test_private_ipc_dir_keeps_the_users_setting_and_is_made_once(monkeypatch):
    import shutil
    import tempfile

    from rlhf.compat import vllm_files as cv

    handlers = []
    monkeypatch.setattr("atexit.register", handlers.append)
    monkeypatch.setattr(cv, "_IPC_DIRS", set())
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp/mine")
    assert cv.private_ipc_dir() is None and handlers == []  # the user's setting is kept
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    short = tempfile.mkdtemp(prefix="rlhf-t-", dir="/tmp")  # pytest's tmp_path is too long for a socket's path
    try:
        # a temporary folder where vLLM's <tmp>/<uuid> fits a socket's path and <tmp>/rlhf-ipc-.../<uuid> does not
        long = os.path.join(short, "x" * (107 - 37 - len(short) - 1))
        os.mkdir(long)
        monkeypatch.setattr("tempfile.tempdir", long)
        assert cv.private_ipc_dir() is None and os.listdir(long) == [] and handlers == []  # with a warning
        monkeypatch.setattr("tempfile.tempdir", short)
        first = cv.private_ipc_dir()
        assert first == os.path.join(short, f"rlhf-ipc-{os.getpid()}h{cv._host_id()}") and os.path.isdir(first)
        assert cv.private_ipc_dir() == first and len(handlers) == 1  # a second engine of the process: the same
        with cv.ipc_env(first):
            assert os.environ["VLLM_RPC_BASE_PATH"] == first
        assert "VLLM_RPC_BASE_PATH" not in os.environ
        handlers[0]()
        assert not os.path.exists(first)
    finally:
        shutil.rmtree(short)


def test_remove_dead_ipc_keeps_live_and_foreign_folders(tmp_path):
    from rlhf.compat.vllm_files import _host_id, remove_dead_ipc

    dead = _dead_pid()
    host = _host_id()
    other = f"{(int(host, 16) + 1) & 0xffff:04x}"
    names = {f"rlhf-ipc-{dead}h{host}": False, f"rlhf-ipc-{os.getpid()}h{host}": True,
             f"rlhf-ipc-{dead}h{other}": True, f"rlhf-ipc-{dead}h{host}x": True, "0c5130dd-6e46": True}
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "sock").write_bytes(b"")
    assert remove_dead_ipc(str(tmp_path)) == [f"rlhf-ipc-{dead}h{host}"]
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)


def test_cpu_engine_on_a_cuda_host_gets_the_cpu_shim(monkeypatch):
    """With a GPU visible but the engine on the CPU (a CPU device passed to the mesh, or RLHF_DEVICE=cpu, as the
    HF export's converter inherits it), megatron must still get the CPU shim (else it allocates its grad buffers on
    the GPU); with neither, a CUDA host gets no shim (the control)."""
    import torch

    from rlhf.compat import cuda as cuda_shim

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RLHF_DEVICE", raising=False)
    assert cuda_shim.install() is False
    assert cuda_shim.install(torch.device("cpu")) is True
    monkeypatch.setenv("RLHF_DEVICE", "cpu")
    assert cuda_shim.install() is True


def test_eager_logprob_ranks_equal_vllms_own_function():
    """rlhf.compat.vllm.eager_logprob_ranks: vLLM's sampler gets the eager twin of its torch.compile'd
    ``batched_count_greater_than`` (the compile costs 1-2 s a process on CPU): the same ranks as vLLM's own
    function run uncompiled, on ties and infinities too; the module-level name vLLM calls is the twin."""
    from helpers import require

    require("vllm", "rlhf.compat.vllm patches it")
    import vllm.v1.sample.ops.logprobs as ops
    import vllm.v1.sample.sampler as sampler

    from rlhf.compat.vllm import eager_logprob_ranks

    original = getattr(ops.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    assert original is not None, "vLLM's function is no longer torch.compile'd: the patch may go"
    eager_logprob_ranks()
    eager_logprob_ranks()  # idempotent
    assert getattr(sampler.batched_count_greater_than, "_rlhf_eager", False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 50, generator=g).log_softmax(-1)
    x[0, :5] = x[0, 5]  # ties
    x[1, 3] = float("-inf")
    values = x.gather(1, torch.randint(0, 50, (7, 1), generator=g))
    assert torch.equal(sampler.batched_count_greater_than(x, values), original(x, values))


def test_eager_vocab_mask_is_vllms_own_function_uncompiled():
    """rlhf.compat.vllm.eager_vocab_mask: the name ``VocabParallelEmbedding.forward`` calls at vLLM TP > 1 becomes
    vLLM's own undecorated ``get_masked_input_and_mask`` (the compile cost about 1.6 s a rank on CPU): a call traces
    no frame with dynamo, and its ids and mask are the hand-computed ones for a shard of the vocabulary."""
    from helpers import require

    require("vllm", "rlhf.compat.vllm patches it")
    import torch._dynamo.utils as dynamo_utils
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    from rlhf.compat.vllm import eager_vocab_mask

    # vLLM's function, as torch.compile wrapped it (or already unwrapped by a patch earlier in this process)
    original = getattr(vpe.get_masked_input_and_mask, "_torchdynamo_orig_callable", vpe.get_masked_input_and_mask)
    assert original.__name__ == "get_masked_input_and_mask"
    eager_vocab_mask()
    eager_vocab_mask()  # idempotent
    assert vpe.get_masked_input_and_mask is original
    frames = dynamo_utils.counters["frames"]["total"]
    ids = torch.tensor([0, 3, 7, 8, 11, 12, 15])
    # the shard of TP rank 1 of 2 over 16 ids: [8, 16), no added vocabulary
    masked, outside = vpe.get_masked_input_and_mask(ids, 8, 16, 0, 16, 16)
    assert dynamo_utils.counters["frames"]["total"] == frames  # nothing traced
    assert masked.tolist() == [0, 0, 0, 0, 3, 4, 7] and outside.tolist() == [True, True, True, False, False, False,
                                                                             False]


def test_fast_kernel_rebind_rebinds_what_vllms_scan_rebinds():
    """rlhf.compat.vllm.fast_kernel_rebind: vLLM's ``_rebind_kernels`` scan with a dict instead of its loop (0.75 s a
    rank on CPU). Both run over fake modules holding a kernel as a plain attribute, as a ``kernel`` attribute of an
    object (whose cached ``_kernel_arg_names`` must go) and of a class, an equal-but-not-identical value, and an
    unrelated one: the same attributes end up pointing at the wrappers."""
    import sys
    import types

    from helpers import require

    require("vllm", "rlhf.compat.vllm patches it")
    from vllm.triton_utils import dispatcher

    from rlhf.compat.vllm import fast_kernel_rebind

    fast_kernel_rebind()
    fast_kernel_rebind()  # idempotent
    fast, vllms = dispatcher._rebind_kernels, dispatcher._rebind_kernels._rlhf_orig
    assert getattr(fast, "_rlhf_fast", False) and not getattr(vllms, "_rlhf_fast", False)

    class Equal:  # equal to everything, identical to nothing
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    def world(tag):
        k1, k2 = (lambda: 1), (lambda: 2)
        w1, w2 = object(), object()
        owner = types.SimpleNamespace(kernel=k2, _kernel_arg_names=("a",))
        owner_cls = type("Owner", (), {"kernel": k1})
        mod = types.ModuleType(f"_rlhf_fake_{tag}")
        mod.copy1, mod.owner, mod.owner_cls, mod.equal, mod.other = k1, owner, owner_cls, Equal(), 3
        sys.modules[mod.__name__] = mod
        return mod, [(k1, w1), (k2, w2)], (w1, w2)

    results = []
    for tag, fn in (("vllm", vllms), ("fast", fast)):
        mod, overrides, (w1, w2) = world(tag)
        try:
            fn(overrides)
        finally:
            del sys.modules[mod.__name__]
        results.append((mod.copy1 is w1, mod.owner.kernel is w2, "_kernel_arg_names" in vars(mod.owner),
                        mod.owner_cls.kernel is w1, isinstance(mod.equal, Equal), mod.other))
    assert results[0] == results[1] == (True, True, False, True, True, 3), results


def test_one_collection_then_freeze_collects_before_it_freezes():
    """rlhf.compat.vllm.one_collection_then_freeze (vLLM's engine start on CPU): inside, ``gc.collect`` does nothing
    and ``gc.freeze`` is deferred; after, one full collection then the freeze. A reference cycle made before the
    block is gone after it (collected, not frozen), and the heap is frozen; without a freeze asked, none happens.
    Negative control: the freeze before the collection keeps the cycle alive."""
    import gc
    import weakref

    from rlhf.compat.vllm import one_collection_then_freeze

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    def engine_start():  # what vLLM's engine start does with the collector
        assert gc.collect() == 0 and gc.collect(2) == 0  # no-ops inside
        gc.collect(0)
        gc.freeze()

    collect, freeze = gc.collect, gc.freeze
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection may take the cycle inside the block
    gc.collect()
    frozen_before = gc.get_freeze_count()
    try:
        ref = cycle()
        with one_collection_then_freeze():
            engine_start()
            assert ref() is not None  # nothing collected inside
        assert gc.collect is collect and gc.freeze is freeze
        assert ref() is None and gc.get_freeze_count() > frozen_before
        gc.unfreeze()
        ref = cycle()
        with one_collection_then_freeze():
            gc.collect()
        assert ref() is None and gc.get_freeze_count() == 0
        ref = cycle()  # negative control: frozen first, the cycle survives the collection
        gc.freeze()
        gc.collect()
        assert ref() is not None
    finally:
        gc.unfreeze()
        gc.collect()
        if enabled:
            gc.enable()


def test_without_collections_is_a_no_op_inside_and_restores_gc():
    import gc

    from rlhf.compat.vllm import without_collections
    from rlhf.distributed.failures import process_ending

    collect = gc.collect
    with without_collections():
        assert gc.collect() == 0 and gc.collect is not collect
    assert gc.collect is collect and not process_ending()  # a test's process does not end with its entry point


def test_expert_bias_is_skipped_only_without_expert_bias():
    """rlhf.compat.megatron.expert_bias_only_when_enabled: a router without expert bias skips megatron's compiled
    ``_apply_expert_bias`` (its body does nothing then): no dynamo frame. Negative control: megatron's own method,
    called the same way, is traced by dynamo (the compile every MoE process paid). A router with expert bias still
    runs megatron's body: its token counts grow by the routing map's column sums (hand-computed)."""
    import types

    import torch._dynamo.utils as dynamo_utils
    from megatron.core.transformer.moe import router

    from rlhf.compat.megatron import expert_bias_only_when_enabled

    expert_bias_only_when_enabled()
    expert_bias_only_when_enabled()  # idempotent
    patched = router.TopKRouter._apply_expert_bias
    megatrons = patched.__wrapped__
    assert not getattr(megatrons, "__rlhf_skips_without_bias__", False)
    routing_map = torch.tensor([[True, False, True], [False, False, True]])
    frames = dynamo_utils.counters["frames"]["total"]
    assert patched(types.SimpleNamespace(enable_expert_bias=False), routing_map) is None
    assert dynamo_utils.counters["frames"]["total"] == frames  # nothing traced
    megatrons(types.SimpleNamespace(enable_expert_bias=False), routing_map)  # control: megatron's own, compiled
    assert dynamo_utils.counters["frames"]["total"] > frames
    biased = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    patched(biased, routing_map)
    assert biased.local_tokens_per_expert.tolist() == [1.0, 0.0, 2.0]


def test_vllms_expected_warnings_are_dropped_and_said_once(caplog):
    """Each expected vLLM warning, as vLLM logs it (its format string and arguments), is dropped on the handler
    and its meaning logged once; another vLLM warning (a layer that missed its weights) passes."""
    import logging

    from rlhf.compat.quiet import VLLM_EXPECTED, ExpectedWarnings

    f = ExpectedWarnings(VLLM_EXPECTED)
    rec = lambda msg, *args, level=logging.WARNING: logging.LogRecord("vllm.x", level, "f.py", 1, msg, args, None)
    with caplog.at_level(logging.INFO, logger="rlhf.compat.quiet"):
        for prefix in VLLM_EXPECTED:
            full = prefix + " the rest of vLLM's text."
            args = (1234,) if "%d" in prefix else ("libtcmalloc",) if "%s" in prefix else ()
            assert not f.filter(rec(full, *args)) and not f.filter(rec(full, *args)), prefix
        assert f.filter(rec("%s: Failed to load weights", "Linear"))
        assert f.filter(rec("Model Runner V2 requires Triton", level=logging.ERROR))  # warnings only
    said = [r.getMessage() for r in caplog.records if r.name == "rlhf.compat.quiet"]
    assert len(said) == len(set(VLLM_EXPECTED.values())) and all(v == 2 for v in f.dropped.values()), said


def test_vllms_expected_warnings_are_vllms_own_text():
    """Each expected warning's text is in the source of one of the modules whose loggers carry the filter (an
    upgrade that rewords or moves one fails here, rather than letting it through unexplained)."""
    import importlib.util

    from rlhf.compat.quiet import VLLM_EXPECTED, VLLM_LOGGERS

    sources = [re.sub(r'"\s*\n\s*"', "", open(importlib.util.find_spec(m).origin).read()) for m in VLLM_LOGGERS]
    missing = [p for p in VLLM_EXPECTED if not any(p in text for text in sources)]
    assert not missing, missing


def test_megatrons_fallback_warnings_are_not_shown():
    """A process that imports rlhf, then megatron's optimizer and layer specs, shows none of megatron-core's
    Transformer Engine / Apex fallback warnings; without rlhf's import the same imports show them."""
    code = "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
    quiet = subprocess.run([sys.executable, "-W", "default", "-c", "import rlhf; " + code], capture_output=True,
                           text=True, timeout=300)
    loud = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr[-2000:] + loud.stderr[-2000:]
    assert "Apex are not installed" in loud.stderr and "Apex is not installed" in loud.stderr, loud.stderr[-2000:]
    assert "Apex are not installed" not in quiet.stderr and "Apex is not installed" not in quiet.stderr, \
        quiet.stderr[-2000:]
