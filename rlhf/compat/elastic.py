"""torch 2.13's elastic agent (torchrun), for ``rlhf.distributed.forkrun``: its ranks forked from the launcher.

Importing this module checks the installed torch against the tested release (``rlhf.compat.check_versions``)."""
from __future__ import annotations

from typing import Callable

from rlhf.compat import check_versions

check_versions(("torch",))


# torch 2.13: MultiprocessContext takes a rank as done only once it has sent its return value.
def count_clean_exits_as_done() -> None:
    """torch's function-entrypoint context (``MultiprocessContext._poll``) takes a rank as done once it has sent its
    return value; a rank that ends by ``os._exit(0)`` (``exit_process``, as every launched job of ours ends) sends
    none, so the agent would wait for it for ever. Here a rank whose process exited 0 is done, as under the
    subprocess context. Idempotent."""
    from torch.distributed.elastic.multiprocessing import api

    if getattr(api.MultiprocessContext._poll, "__rlhf_forkrun__", False):
        return
    orig = api.MultiprocessContext._poll

    def _poll(self):
        if self._pc is not None:
            for local_rank, proc in enumerate(self._pc.processes):
                if proc.exitcode == 0 and local_rank not in self._return_values:
                    self._return_values[local_rank] = None
        return orig(self)

    _poll.__rlhf_forkrun__ = True
    _poll.__wrapped__ = orig
    api.MultiprocessContext._poll = _poll


# torch 2.13: torchrun's --run-path calls the module-level torch.distributed.run.run_script_path in each rank.
def run_path_entry(entry: Callable[..., None], script: str) -> None:
    """What torchrun's ``--run-path`` runs in each rank: ``entry(script, *args)``, named ``script`` in torchrun's
    failure report (``_get_entrypoint_name`` reads ``__name__`` in torch 2.13, ``__qualname__`` per its docstring),
    as a subprocess rank is named."""
    from torch.distributed import run as torchrun

    def run_script_path(*args: str) -> None:
        entry(*args)

    run_script_path.__name__ = run_script_path.__qualname__ = script
    torchrun.run_script_path = run_script_path
