"""A rank that reports how it was started (tests/distributed/test_forkrun.py): ``OUT/rank<R>.json``.

    <launcher> --nproc_per_node 2 tests/distributed/_forkrun_probe.py OUT [exit0]

``exit0``: rank 1 ends at once by ``os._exit(0)`` (as ``exit_process`` ends every launched job of ours), rank 0
a second later by returning. ``exit3``: rank 1 ends by ``sys.exit(3)``. ``sleep``: both sleep 120 s after their
report."""
import json
import multiprocessing
import os
import pickle
import random
import signal
import sys
import time


def defined_here():
    return "here"


def handler_name(sig):
    h = signal.getsignal(sig)
    return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignore",
            signal.default_int_handler: "python-default-int"}.get(h, "other")


if __name__ == "__main__":
    out, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    rank = int(os.environ["RANK"])
    try:
        pickled = pickle.loads(pickle.dumps(defined_here)) is defined_here
    except Exception as e:  # __main__ is not the script: what it defines does not pickle
        pickled = repr(e)
    report = {
        "env": {k: v for k, v in os.environ.items() if k not in os.environ.get("RLHF_PROBE_BASE_ENV", "").split(",")},
        "argv": sys.argv, "path0": sys.path[0], "name": __name__, "main_file": sys.modules["__main__"].__file__,
        "signals": {s.name: handler_name(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)},
        "pickled": pickled, "random": random.random(), "forked": multiprocessing.parent_process() is not None,
        "stdout_raw": type(getattr(sys.stdout, "buffer", None)).__name__,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    print(f"probe rank {rank} wrote its report")
    if mode == "exit3" and rank == 1:
        sys.exit(3)
    if mode == "sleep":  # a job that is still running when the test kills or signals it
        time.sleep(120)
    if mode == "exit0":
        if rank == 1:
            os._exit(0)
        time.sleep(1)
