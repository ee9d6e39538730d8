"""The registry of planted bugs (tests/mutants/) stays true to the code: every mutant's text is found exactly once in
its file, every test it names exists, names are unique; and the runner (tools/mutants.py) kills one mutant end to
end in a copy of the tree (the quick subset the suite can afford; the whole registry is run by hand, its table in
the closing notes)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.mutants import load

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mutant_applies_once_and_names_real_tests():
    mutants = load()
    assert len(mutants) >= 20
    names = [m.name for _, m in mutants]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    for area, m in mutants:
        assert m.name.startswith(area + "-"), m.name
        text = open(os.path.join(REPO, m.file)).read()
        assert text.count(m.find) == 1, (m.name, m.file, text.count(m.find))
        assert m.find != m.replace and m.claim and m.tests, m.name
        for node in m.tests:
            path, _, rest = node.partition("::")
            func = re.sub(r"\[.*\]$", "", rest)
            src = open(os.path.join(REPO, path)).read()
            assert re.search(rf"^def {re.escape(func)}\(", src, re.M), (m.name, node)


def test_the_runner_kills_a_mutant_in_a_copy_of_the_tree(tmp_path):
    out = tmp_path / "table.json"
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "mutants.py"), "--name",
                        "sandbox-socket-64-bit-compare", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    import json

    table = json.loads(out.read_text())
    assert table["killed"] == table["total"] == 1 and table["rows"][0]["result"] == "killed", table
    assert "unmutated: 1 tests, exit 0" in p.stdout, p.stdout
    assert open(os.path.join(REPO, "rlhf/sandbox/seccomp.py")).read().count("_deny_int_unless(f, deny, call, 0, ALLOWED") == 1
