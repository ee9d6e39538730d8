"""A rank that reports how it was started, after the imports a real job of ours makes (rlhf, megatron-core,
transformers, vllm): ``OUT/rank<R>.json`` (tests/distributed/test_zygote.py). The launchers preload these modules
for a script that names them (``rlhf.distributed.forkrun.default_preload``), so a zygote's or forkrun's rank sees
what they left behind, where a fresh rank imports them itself: what the imports change must be the same.

    <launcher> --nproc_per_node 2 tests/distributed/_forkrun_probe_full.py OUT"""
import faulthandler
import json
import locale
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
import warnings

if __name__ == "__main__":
    from rlhf.distributed.forkrun import default_preload, preload

    preload(default_preload(__file__))  # what the launchers import before forking (a no-op there), here too
    import torch

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    base = os.environ.get("RLHF_PROBE_BASE_ENV", "").split(",")
    report = {
        "env": {k: v for k, v in os.environ.items() if k not in base},
        "argv": sys.argv, "path": [p for p in sys.path if "site-packages" not in p], "cwd": os.getcwd(),
        "main_file": sys.modules["__main__"].__file__,
        "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                               signal.SIGQUIT, signal.SIGCHLD, signal.SIGPIPE,
                                                               signal.SIGUSR1)},
        "torch_threads": torch.get_num_threads(), "torch_interop": torch.get_num_interop_threads(),
        "torch_dtype": str(torch.get_default_dtype()), "torch_deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(), "torch_random": torch.rand(1).item(), "random": random.random(),
        "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
        "root_level": logging.getLogger().level, "logging_disabled": logging.root.manager.disable,
        "warnings": len(warnings.filters), "start_method": multiprocessing.get_start_method(allow_none=True),
        "faulthandler": faulthandler.is_enabled(), "recursion": sys.getrecursionlimit(),
        "threads": threading.active_count(), "umask": os.umask(0o022), "locale": locale.setlocale(locale.LC_ALL),
        "flags": [getattr(sys.flags, f) for f in ("optimize", "dont_write_bytecode", "no_user_site", "isolated",
                                                  "safe_path", "utf8_mode", "int_max_str_digits")],
        "stdout_raw": type(getattr(sys.stdout, "buffer", None)).__name__,
        "hash": hash("rlhf-probe"),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
