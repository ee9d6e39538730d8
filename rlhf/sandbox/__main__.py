"""Run one program in the sandbox and print its result as one JSON line.

    python -m rlhf.sandbox --program prog.py [--stdin input.txt] [--timeout_s 10] [--memory_mb 512] [--allow_weaker]

Fields: status (ok | timeout | memory | output_limit | error | refused), exit_code, stdout, stderr (each cut at
--max_output_bytes; stdout_cut / stderr_cut say how much was dropped), seconds, cpu_s, isolation (the layers that
ran, and the bounds missing where one was weaker), reason. Exit code 0 whatever the program did; 2 for bad input
(a missing file, a bad limit)."""
from __future__ import annotations

import argparse
import sys


FLAG_HELP = {"max_file_mb": "the largest file, and the size of each of /sandbox, /tmp and /dev/shm",
             "cpus": "CPU rate of the run's processes together, in cores",
             "cpu_s": "CPU seconds the program's processes may use together (0: --timeout_s)",
             "allow_weaker": "run with the isolation layers this machine has instead of refusing when one is missing"}
"""Help beyond the flag's name; every limit's flag, type and default are ``SandboxConfig``'s field."""


def parser() -> argparse.ArgumentParser:
    from dataclasses import fields

    from rlhf.sandbox.records import SandboxConfig

    p = argparse.ArgumentParser(prog="python -m rlhf.sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("--program", required=True, help="the Python program to run")
    p.add_argument("--stdin", default=None, help="a file whose content is the program's standard input")
    for f in fields(SandboxConfig):
        if f.name == "python":  # the interpreter: this one
            continue
        kind = {"action": "store_true"} if isinstance(f.default, bool) else {"type": type(f.default)}
        p.add_argument(f"--{f.name}", default=f.default, help=FLAG_HELP.get(f.name), **kind)
    return p


def config_of(args: argparse.Namespace):
    """The ``SandboxConfig`` of the parsed limits (``ValueError`` naming a bad one)."""
    from dataclasses import fields

    from rlhf.sandbox.records import SandboxConfig

    return SandboxConfig(**{f.name: getattr(args, f.name) for f in fields(SandboxConfig) if hasattr(args, f.name)})


def main(argv=None) -> int:
    from rlhf.sandbox.core import run_program

    args = parser().parse_args(argv)
    try:
        program = open(args.program).read()
        stdin = open(args.stdin).read() if args.stdin else ""
        cfg = config_of(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(run_program(program, stdin, cfg).to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
