"""Run one program in the sandbox and print its result as one JSON line.

    python -m rlhf.sandbox --program prog.py [--stdin input.txt] [--timeout_s 10] [--memory_mb 512] [--allow_weaker]

Fields: status (ok | timeout | memory | output_limit | error | refused), exit_code, stdout, stderr (each cut at
--max_output_bytes; stdout_cut / stderr_cut say how much was dropped), seconds, cpu_s, isolation (the layers that
ran, and the bounds missing where one was weaker), reason. Exit code 0 whatever the program did; 2 for bad input
(a missing file, a bad limit)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from rlhf.sandbox.core import SandboxConfig, run_program

    p = argparse.ArgumentParser(prog="python -m rlhf.sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("--program", required=True, help="the Python program to run")
    p.add_argument("--stdin", default=None, help="a file whose content is the program's standard input")
    p.add_argument("--timeout_s", type=float, default=10.0)
    p.add_argument("--memory_mb", type=int, default=512)
    p.add_argument("--max_processes", type=int, default=64)
    p.add_argument("--max_output_bytes", type=int, default=1 << 20)
    p.add_argument("--max_file_mb", type=int, default=16,
                   help="the largest file, and the size of each of /sandbox, /tmp and /dev/shm")
    p.add_argument("--cpus", type=float, default=1.0, help="CPU rate of the run's processes together, in cores")
    p.add_argument("--cpu_s", type=float, default=0.0,
                   help="CPU seconds the program's processes may use together (0: --timeout_s)")
    p.add_argument("--allow_weaker", action="store_true",
                   help="run with the isolation layers this machine has instead of refusing when one is missing")
    args = p.parse_args(argv)
    try:
        program = open(args.program).read()
        stdin = open(args.stdin).read() if args.stdin else ""
        cfg = SandboxConfig(timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_processes=args.max_processes,
                            max_output_bytes=args.max_output_bytes, max_file_mb=args.max_file_mb,
                            cpus=args.cpus, cpu_s=args.cpu_s, allow_weaker=args.allow_weaker)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(run_program(program, stdin, cfg).to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
