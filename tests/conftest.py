"""Suite-wide settings: 1 thread per process, CUDA-only tests skipped cleanly on CPU machines."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# PPO offloads for real on CPU too, so the tests exercise the CUDA path's copies (rlhf.runtime.offload.cpu_offload_moves)
os.environ.setdefault("RLHF_OFFLOAD_ON_CPU", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


import json  # noqa: E402

from zygote import FALLBACK_LOG  # noqa: E402

# tests/durations.json: every test's and file's seconds from a full run (tools/test_durations.py writes it; the
# machine, date and commit are in it). pytest.ini runs the suite on 2 xdist workers a file at a time (--dist loadfile
# --no-loadscope-reorder), in collection order: the heaviest files go first, so that the two workers end together
# instead of one running the demo alone at the end. Files not measured yet keep their order after the measured ones.
_DURATIONS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
try:
    with open(_DURATIONS_PATH) as _f:
        DURATIONS = json.load(_f)
except (OSError, ValueError):
    DURATIONS = {"files": {}, "tests": {}}

SLOW_S = 5.0
"""A test measured above this many seconds is marked ``slow`` (the quick tier, ``-m "not slow"``, leaves it out)
unless it is in ``QUICK``."""
QUICK = {
    "tests/train/test_sft_rm.py::test_sft_loss_falls_tp2",  # one real SFT job (2 ranks, TP 2)
    "tests/train/test_sft_rm.py::test_rm_accuracy_export_and_scores",  # one real RM job and its HF export
    "tests/ppo/test_ppo_e2e.py::test_reward_rises_and_vllm_matches_trainer",  # one PPO job with vLLM (2 ranks)
    "tests/models/test_convert_cli.py::test_round_trip_is_bit_exact_and_loads_in_transformers"
    "[llama-AutoModelForCausalLM-layout0]",  # the converters, both ways
}
"""The quick tier's representatives among slow tests: every subsystem is touched at least once (with the unit
tests of kernels, CLI, config and data, which are all quick)."""


def _module_fixtures(item) -> set[str]:
    """The module- and class-scoped fixtures ``item`` uses (set up once per file, or per class, of tests)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope in ("module", "class")}


def pytest_collection_modifyitems(config, items):
    files = DURATIONS.get("files", {})
    tests = DURATIONS.get("tests", {})
    unknown = max(files.values(), default=0.0) + 1.0
    items.sort(key=lambda item: -files.get(item.nodeid.split("::")[0], -unknown))  # stable: heaviest file first
    slow = pytest.mark.slow
    # A module-scoped fixture's cost lands on the first test that uses it (junit times it there): when that test is
    # left out of the quick tier, the next one would pay it. So the tests that share a module-scoped fixture with a
    # slow test of their file are slow too (one CP fixture took 103 s of a quick tier's 6 minutes that way).
    heavy: dict[str, set[str]] = {}
    for item in items:
        if tests.get(item.nodeid, 0.0) > SLOW_S:
            heavy.setdefault(item.nodeid.split("::")[0], set()).update(_module_fixtures(item))
    for item in items:
        if item.nodeid in QUICK:
            continue
        shared = _module_fixtures(item) & heavy.get(item.nodeid.split("::")[0], set())
        if tests.get(item.nodeid, 0.0) > SLOW_S or shared:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not the keyword: tests/gpu/'s CPU tests of the check run
            item.add_marker(skip)


# ----------------------------------------------------------------------------------- where the time went, per file
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Every phase's seconds, summed per file (on xdist's controller too: the workers' reports reach it)."""
    f = report.nodeid.split("::")[0]
    _FILE_SECONDS[f] = _FILE_SECONDS.get(f, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_configure(config):
    # Where the zygote's clients note each job they ran through forkrun instead (tests/zygote.py): set once by the
    # controller, inherited by xdist's workers, read back in the summary below.
    if not os.environ.get(FALLBACK_LOG):
        import tempfile

        os.environ[FALLBACK_LOG] = os.path.join(tempfile.mkdtemp(prefix="rlhf-zygote-log-"), "fallbacks")
        config._zygote_log_owner = True


def _zygote_fallbacks(terminalreporter) -> None:
    """How many jobs did not go through a zygote, and why (each one paid forkrun's imports, 10-20 s under load)."""
    import collections
    import shutil

    path = os.environ.get(FALLBACK_LOG, "")
    if not getattr(terminalreporter.config, "_zygote_log_owner", False) or not path:
        return
    try:
        with open(path) as f:
            reasons = collections.Counter(line.strip() for line in f if line.strip())
    except OSError:
        reasons = collections.Counter()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    terminalreporter.write_line(f"zygote: {sum(reasons.values())} job(s) ran forkrun themselves"
                                + "".join(f"\n  {n} x {why}" for why, n in reasons.most_common(10)))


def pytest_terminal_summary(terminalreporter):
    _zygote_fallbacks(terminalreporter)
    if not _FILE_SECONDS:
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:20]
    terminalreporter.write_sep("=", f"slowest {len(top)} files (set-up + call + tear-down, summed)")
    for f, sec in top:
        terminalreporter.write_line(f"{sec:8.1f}s  {f}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s  in all ({len(_FILE_SECONDS)} files)")
