"""Planted bugs of the flag generator (rlhf/config/part.py: ``flag`` and ``Part.add_args``), which declares every
entry point's flags from its parts' fields: each caught by tests/cli/test_cli_surface.py, whose frozen surfaces hold
every option string, dest, default, type, choices and help of every entry point."""
from tests.mutants import Mutant

S = "tests/cli/test_cli_surface.py::test_cli_surface_frozen"
F = "rlhf/config/part.py"

MUTANTS = [
    Mutant("flags-switches-dropped", F,
           find="            for switch, const, text in spec.get(\"switches\", ()):\n",
           replace="            for switch, const, text in ():\n",
           claim="a peer's switch for one value (--ipo, slime's --use-routing-replay) sets its field's flag",
           tests=(S + "[launch/dpo.py]", S + "[launch/ppo.py]")),
    Mutant("flags-field-default-ignored", F,
           find="            if f.default is not MISSING:\n                kw[\"default\"] = f.default\n",
           replace="            if f.default is not MISSING:\n                pass\n",
           claim="a flag's default is its field's default (one definition)",
           tests=(S + "[launch/sft.py]", S + "[launch/ppo.py]")),
    Mutant("flags-entry-point-changes-ignored", F,
           find="            kw.update(changes.get(f.name, {}))\n",
           replace="            pass\n",
           claim="an entry point's own default, help or names for a shared part's flag are the ones it declares",
           tests=(S + "[launch/ppo.py]", S + "[launch/sft.py]", S + "[launch/dpo.py]")),
]
