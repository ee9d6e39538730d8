"""torchrun whose ranks are forked from a launcher that has already imported what they need.

    python -m rlhf.distributed.forkrun [--preload MODULES] <torchrun's flags> script.py [script args]

Every rank of a torchrun job is a fresh ``python -u script.py``, and each one imports torch, transformers'
tokenizer chain, megatron-core and (PPO) vLLM again: 6-8 s of CPU a rank on a 2-core AMD EPYC, more than a tiny
job's training. This runs torchrun itself (``torch.distributed.run``: the same flags, rendezvous, agent store,
``TORCHELASTIC_*`` and rank variables, restarts, failure handling) with its own ``--run-path --start-method fork``:
the launcher imports the modules once, then the elastic agent forks each rank from it, and the rank runs the
script in-process. A rank's work is the same as under torchrun; what it costs is a fork.

What a forked rank gets, as a ``python -u script.py`` would: ``__main__`` is the script (``sys.modules`` too, so
that what it defines pickles), ``sys.argv`` and ``sys.path[0]`` are the script's, stdout and stderr unbuffered
(the launcher re-executes itself with ``-u``), the signal handlers the defaults (the agent's own handlers, set
before it forks, are reset), its own ``random``, torch and numpy generator states, multiprocessing's start method
unset, no fault handler, an unconfigured root logger. It ends as
``rlhf.distributed.failures.exit_process`` ends a launched job: threads joined, ``atexit`` handlers run, streams
flushed, the exit code kept (a traceback and 1 for an exception, as the interpreter prints it); the agent counts a
rank that exits 0 as done.

What differs from torchrun, and why tests that are about these keep torchrun: the ranks share the launcher's string
hash seed (set iteration order is the same on every rank, where separate interpreters differ unless
``PYTHONHASHSEED`` is set), ``/proc/PID/environ`` and ``cmdline`` show the launcher's (the rank variables are in
``os.environ`` only), stdin is ``/dev/null`` (multiprocessing's), and the import cost moves into the launcher, once.

Fork is safe only from a process with one thread and no CUDA context; where the preloaded imports leave either,
the ranks are started as torchrun starts them (a subprocess each), logged once ("forkrun: ... started as
subprocesses"). Meant for single-node CPU jobs: the test suite's, and a developer's.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time

log = logging.getLogger("rlhf.forkrun")

BASE_PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.run",
    "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto",
    "rlhf.distributed", "rlhf.models.gpt", "rlhf.compat.cuda:_import_megatron_modules",
)
VLLM_PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.model_executor.layers.fused_moe",
                "vllm.model_executor.layers.quantization.online.base", "vllm.entrypoints.launchers.cli_args",
                "vllm.v1.core.sched.scheduler")
GENERATING_SCRIPTS = ("batch_inference.py", "rejection_sampling.py")  # launch/'s, vLLM behind a flag
VLLM_CPU_PRELOAD = ("vllm.v1.worker.cpu_worker",)  # the engine's worker on a CPU-only host


def default_preload(script: str) -> list[str]:
    """The modules a rank of ``script`` imports that cost the most: torch, transformers' auto classes,
    megatron-core, and vLLM's engine where the script's source names vLLM (or it is one of launch/'s generation
    scripts)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = "rlhf"
    if not any(name in text for name in ("rlhf", "transformers", "megatron", "vllm")):
        return ["torch", "torch.distributed"]  # a script of its own: what it imports beyond torch is its business
    mods = list(BASE_PRELOAD)
    if "vllm" in text or os.path.basename(script) in GENERATING_SCRIPTS:
        mods += VLLM_PRELOAD
        import torch

        if not torch.cuda.is_available():
            mods += VLLM_CPU_PRELOAD
    return mods


def preload(modules: list[str]) -> dict[str, float]:
    """Import ``modules`` (``module:function`` also calls the function, e.g. megatron-core's modules that
    ``rlhf.compat.cuda`` drives); seconds per entry. One that is not installed is skipped (its rank imports it, or
    fails, as under torchrun)."""
    took = {}
    for entry in modules:
        name, _, fn = entry.partition(":")
        t0 = time.monotonic()
        try:
            mod = importlib.import_module(name)
            if fn:
                getattr(mod, fn)()
        except ImportError as e:
            log.info("forkrun: not preloaded: %s (%s)", entry, e)
            continue
        took[entry] = round(time.monotonic() - t0, 2)
    return took


def fork_unsafe_reason() -> str | None:
    """Why forking this process would be unsafe, or None: a second thread (its locks are copied held), a CUDA
    context (a forked child cannot use it)."""
    alive = [t.name for t in threading.enumerate() if t.is_alive()]
    if len(alive) > 1:
        return f"threads running after the imports: {', '.join(alive)}"
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: the OS threads cannot be counted
        return "no /proc/self/task to count this process's threads"
    if tasks > 1:
        return f"{tasks} OS threads after the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports"
    return None


def _as_a_fresh_interpreter() -> None:
    """What a rank inherits from the launcher that a fresh interpreter would not have: the generators' states
    (``random``, torch's default generator and numpy's global one, each seeded anew from the OS, as a fresh process
    of ours finds them seeded differently on every rank), multiprocessing's start method (set by the agent: a rank's
    own ``set_start_method`` must work), the fault handler the launcher enabled."""
    import faulthandler
    import multiprocessing
    import random

    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    multiprocessing.set_start_method(None, force=True)
    if not (os.environ.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions):
        faulthandler.disable()


def run_rank(script: str, *script_args: str) -> None:
    """A forked rank's life: ``script`` as ``__main__``, then ``exit_process`` with its exit code. Never returns."""
    import builtins
    import signal
    import traceback
    import types

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers, inherited by the fork
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _as_a_fresh_interpreter()
    root = logging.getLogger()  # and an unconfigured root logger, as a fresh interpreter has (not the launcher's)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        import torch.multiprocessing as tmp

        tmp._set_thread_name(os.path.basename(sys.executable)[:15])  # the agent named its thread "pt_elastic"
    except Exception:  # cosmetic only
        pass
    from rlhf.distributed.failures import exit_process

    script = os.path.abspath(script)
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = builtins
    main.__spec__ = None
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(script, "rb") as f:
            source = f.read()
        exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):  # sys.exit("message"), as the interpreter prints it
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_process(code)


def _one_thread_per_rank_by_default(argv: list[str]) -> bool:
    """torchrun sets ``OMP_NUM_THREADS=1`` for its ranks when the environment has none and more than one rank runs
    on the node; here the launcher's own torch import must see it too (with more threads, importing torch starts a
    second OS thread, and the launcher could not fork). True when it was set now."""
    if "OMP_NUM_THREADS" in os.environ:
        return False
    nproc = "1"
    for i, a in enumerate(argv):
        if a in ("--nproc_per_node", "--nproc-per-node") and i + 1 < len(argv):
            nproc = argv[i + 1]
        elif a.startswith(("--nproc_per_node=", "--nproc-per-node=")):
            nproc = a.split("=", 1)[1]
    if not nproc.isdigit() or int(nproc) > 1:  # "auto", "cpu", "gpu" or a count over 1
        os.environ["OMP_NUM_THREADS"] = "1"
        print(f"forkrun: OMP_NUM_THREADS=1 for every rank (unset, {nproc} ranks), as torchrun sets it",
              file=sys.stderr)
        return True
    return False


def _unbuffered() -> bool:
    """stdout and stderr as ``python -u`` (or ``PYTHONUNBUFFERED``) makes them: no buffer under the text layer."""
    import io

    return all(isinstance(getattr(s, "buffer", None), io.RawIOBase) for s in (sys.stdout, sys.stderr))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torchrun starts its ranks with -u (forked ranks inherit the launcher's streams), and sets OMP_NUM_THREADS for
    # them (this process's torch import must see it: rlhf's package imports torch before this module runs)
    if not _unbuffered() or _one_thread_per_rank_by_default(argv):
        os.execv(sys.executable, [sys.executable, "-u", "-m", "rlhf.distributed.forkrun", *argv])
    modules = None
    if argv[:1] == ["--preload"] or any(a.startswith("--preload=") for a in argv[:1]):
        value = argv[1] if argv[0] == "--preload" else argv[0].split("=", 1)[1]
        argv = argv[2:] if argv[0] == "--preload" else argv[1:]
        modules = [m for m in value.split(",") if m]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(argv)
    if args.module or args.no_python:
        raise ValueError("forkrun: --module / --no-python are not supported (it runs a script path in-process); "
                         "use torchrun")
    if modules is None:
        modules = default_preload(args.training_script)
    t0 = time.monotonic()
    took = preload(modules)
    reason = fork_unsafe_reason()
    if reason is not None:
        log.warning("forkrun: %s; the ranks are started as subprocesses, as torchrun starts them", reason)
        torchrun.run(args)
        return
    log.info("forkrun: preloaded %d module(s) in %.1f s (%s); forking %s rank(s)", len(took),
             time.monotonic() - t0, ", ".join(f"{k} {v}" for k, v in took.items()), args.nproc_per_node)
    from rlhf.compat.elastic import count_clean_exits_as_done, run_path_entry

    count_clean_exits_as_done()
    run_path_entry(run_rank, args.training_script)
    args.run_path = True
    args.start_method = "fork"
    torchrun.run(args)
    # Done, every rank ended well: skip this process's interpreter teardown (from the ranks' end to the launcher's
    # exit 1.35 s with it, 0.15 s without, on 4 ranks of a trivial job; nothing of it is needed). A failure raises
    # above and ends as torchrun's does.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main_then_exit(argv: list[str] | None = None) -> None:
    """``record(main)(argv)``, then the end without the interpreter's teardown on every path, as ``main`` ends a job
    that went well: a failed job (the ranks' ``ChildFailedError``, re-raised by ``record`` after its report) printed its
    traceback and then spent 10.7 s collecting the imported modules under a loaded suite before it exited
    (``tests/dpo/test_dpo_faults.py``'s raise in an update, 0.2 s from the fault to the traceback; alone, from the
    fault to the end 1.2 s with the teardown, 0.1-0.2 s without, AMD EPYC 2026-11-29). The exit status is Python's:
    1 with the traceback, ``SystemExit``'s code otherwise, SIGINT's death on ``KeyboardInterrupt``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = 0
    try:
        record(main)(argv)
    except KeyboardInterrupt:
        raise  # Python's own end: killed by SIGINT, as torchrun's launcher is
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main_then_exit()
