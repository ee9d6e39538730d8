"""launch/sft.py, except that the rank named by RLHF_TEST_SKEW_RANK appends RLHF_TEST_SKEW_ARGS to its flags: a
job whose ranks disagree, for test_launchers.py's config-consistency check."""
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.supervised import sft  # noqa: E402
from rlhf.distributed import DistEnv  # noqa: E402
from rlhf.supervised.loop import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if DistEnv.from_environ().rank == int(os.environ["RLHF_TEST_SKEW_RANK"]):
        argv += shlex.split(os.environ["RLHF_TEST_SKEW_ARGS"])
    sys.exit(main(sft, argv))
