"""Planted bugs of the seed systems' command lines (rlhf/config/migration.py): each caught by
tests/train/test_dschat.py."""
from tests.mutants import Mutant

T = "tests/train/test_dschat.py::"
F = "rlhf/config/migration.py"

MUTANTS = [
    Mutant("migration-dschat-split-one-tmp-for-all-ranks", F,
           find='        fd, tmp = tempfile.mkstemp(dir=ds.data_output_path, prefix=os.path.basename(path) + ".", '
                'suffix=".tmp")\n',
           replace='        tmp = path + ".tmp"\n        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n',
           claim="every rank of a dschat job writes the split files at once and none fails or reads a part of one",
           tests=(T + "test_ranks_writing_the_split_at_once_each_leave_the_whole_file",)),
]
