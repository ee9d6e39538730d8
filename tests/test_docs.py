"""The documentation's commands still run: every command line in a fenced shell block of README.md, docs/*.md,
bench/README.md and examples/*/README.md that starts a ``launch/*.py`` entry point is parsed with that entry point's
own argparse parser (built as ``rlhf.config.job.cli_main`` builds it: ``add_args(p)`` of the workflow, then
``rlhf.config.migration.add_launcher_args(p)``), without training or loading a model. A renamed or removed flag, a value
outside a flag's choices or type, or a required flag that a snippet leaves out without saying so (``...``) fails
with the file, the line and the flag. Every ``tools/``, ``bench/``, ``examples/``, ``tests/`` and ``launch/``
script a command runs must exist; the tools whose parser can be taken without running them (``TOOL_PARSERS``) are
parsed too. Also: every relative link resolves (file and ``#anchor``), the entry-point tables (README.md,
docs/entry_points.md) name only flags their entry point has, docs/README.md indexes every page of docs/, and the
pages stay readable: the README a guide (at most ``README_MAX_LINES`` lines and ``README_MAX_WORDS`` words, no
dates or commit hashes: those live in docs/status.md, tests/README.md, bench/README.md and each page's results), no
line of any of them wider than ``MAX_COLUMNS`` (a table row of a page other than the README excepted: markdown
cannot wrap one), and a page of docs/ dates a figure only in a results section (a heading that says "results") or
in a table.

Placeholders (``<actor HF dir>``, ``$MODEL``, ``...`` as a flag's value) become a value the flag accepts; a bare
``...`` stands for "more flags" and is dropped; ``[--flag value]`` is checked as if given; ``a|b`` is checked for
each alternative."""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 150
README_MAX_WORDS = 1500  # words as ``wc -w`` counts them: whitespace-separated
MAX_COLUMNS = 120
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")  # hex with a letter and a digit
# Pages other engineers were rewriting when the width and dates rules came (issue 70): held to every other rule
# until they pass these two. Remove a page from this set once it does.
PENDING: set[str] = set()
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
PLACEHOLDER = "__PLACEHOLDER__"
ELLIPSIS = "..."
# launch/<name>.py -> the workflow module whose add_args builds its flags (see each launch file's main)
ENTRY_POINTS = {"sft": "rlhf.supervised.sft", "rm": "rlhf.supervised.rm", "dpo": "rlhf.supervised.dpo", "kto": "rlhf.supervised.kto", "ppo": "rlhf.ppo.args",
                "rejection_sampling": "rlhf.offline.rejection_sampling", "batch_inference": "rlhf.offline.batch_inference",
                "evaluate": "rlhf.offline.evaluate"}
# launch/dschat.py takes DeepSpeed-Chat's flags: rlhf.config.migration.dschat_parser(step), after --step
DSCHAT = "dschat"
# Scripts whose main builds its parser before doing anything else, so the parser can be taken by stopping at
# parse_args (as tests/cli/test_cli_surface.py does). Other scripts are only checked to exist.
TOOL_PARSERS = {"tools/convert_hf_to_megatron.py", "tools/convert_megatron_to_hf.py", "tools/compare_logits.py",
                "tools/plan_memory.py", "tools/convert_reward_model.py", "tools/prepare_smollm2.py",
                "bench/weight_sync.py", "bench/ppo_vs_trl.py", "bench/rlvr_vs_trl.py",
                "examples/rlvr/run.py", "examples/agents/run.py"}
SCRIPT_DIRS = ("launch/", "tools/", "bench/", "examples/", "tests/")  # a command's script there must exist
PYTHONS = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
LAUNCHERS = {"torchrun", "srun", "mpirun", "mpiexec"}


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, p) for p in ("README.md", "CHANGELOG.md", "bench/README.md", "tests/README.md",
                                             "examples/README.md")]
    return [f for f in files if os.path.exists(f)] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + \
        sorted(glob.glob(os.path.join(ROOT, "examples", "*", "README.md")))


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT) if os.path.isabs(path) else path


# ---------------------------------------------------------------------------------------------------------------
# Markdown -> command lines


def fenced_blocks(text: str):
    """(language, [(line number, line), ...]) of each fenced block."""
    lang, body = None, []
    for n, line in enumerate(text.split("\n"), 1):
        s = line.strip()
        if s.startswith("```"):
            if lang is None:
                lang, body = s[3:].strip().lower(), []
            else:
                yield lang, body
                lang = None
        elif lang is not None:
            body.append((n, line))


def command_lines(text: str):
    """(line number, command) of every command line of the shell blocks: backslash continuations joined, comment
    lines skipped."""
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        start, parts = None, []
        for n, line in body:
            if not parts:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                start = n
            if line.rstrip().endswith("\\"):
                parts.append(line.rstrip()[:-1])
                continue
            parts.append(line)
            yield start, " ".join(p.strip() for p in parts)
            parts = []
        if parts:
            yield start, " ".join(p.strip() for p in parts)


def tokenize(command: str) -> list[list[str]]:
    """The simple commands of one line (split at ``&&``, ``||``, ``;``, ``|``, ``&``), as token lists; ``<...>``
    and ``$VAR`` placeholders become PLACEHOLDER, optional brackets are dropped."""
    command = re.sub(r"<[^<>]*>", PLACEHOLDER, command)
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&")
    lex.whitespace_split = True
    tokens = list(lex)
    out, cur = [], []
    for t in tokens:
        if t in ("&&", "||", ";", "&", "|", ";;"):
            out.append(cur)
            cur = []
            continue
        t = t.strip("[]") if not t.startswith("[[") else t
        if not t:
            continue
        if re.fullmatch(r"\$\{?\w+\}?", t):
            t = PLACEHOLDER
        cur.append(t)
    out.append(cur)
    return [c for c in out if c]


# ---------------------------------------------------------------------------------------------------------------
# Parsers


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.lru_cache(maxsize=None)
def entry_parser(name: str) -> argparse.ArgumentParser:
    """launch/<name>.py's parser, built as rlhf.config.job.cli_main builds it."""
    import importlib

    from rlhf.config.migration import add_launcher_args

    p = argparse.ArgumentParser(prog=f"launch/{name}.py")
    importlib.import_module(ENTRY_POINTS[name]).add_args(p)
    add_launcher_args(p)
    return p


@functools.lru_cache(maxsize=None)
def dschat_parser(step: int) -> argparse.ArgumentParser:
    from rlhf.config.migration import dschat_parser as build

    p = build(step)
    p.add_argument("--step", type=int, choices=[1, 2, 3], required=True)
    return p


@functools.lru_cache(maxsize=None)
def tool_parser(script: str) -> argparse.ArgumentParser:
    """The parser a tool's main builds, taken by stopping at its first parse_args (nothing after it runs)."""
    path = os.path.join(ROOT, script)
    spec = importlib.util.spec_from_file_location("_doc_tool_" + re.sub(r"\W", "_", script), path)
    mod = importlib.util.module_from_spec(spec)

    def stop(self, *a, **k):
        raise _Parsed(self)

    env, syspath, argv = dict(os.environ), list(sys.path), list(sys.argv)
    try:
        sys.argv = [path]
        spec.loader.exec_module(mod)
        with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
                mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop):
            try:
                mod.main([]) if inspect.signature(mod.main).parameters else mod.main()
            except _Parsed as e:
                return e.parser
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv = syspath, argv
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs is None or action.nargs == 1


def dummy_value(action: argparse.Action) -> str:
    """A value the flag accepts, for a placeholder."""
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is None:
        return "x"
    for v in ("1", "x", "a:b"):
        try:
            action.type(v)
            return v
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            continue
    return "x"


def flag_errors(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], list[str]]:
    """Walks the arguments as argparse would: (unknown flags, the arguments with placeholder values filled in).
    A flag must be spelled out (argparse would also take an unambiguous prefix, which a rename can turn into
    another flag)."""
    opts = parser._option_string_actions
    unknown, out, i = [], [], 0
    while i < len(args):
        t = args[i]
        if t == ELLIPSIS:  # "more flags here"
            i += 1
            continue
        if t.startswith("-") and not re.fullmatch(r"-\d[\d.e+-]*", t) and t != "-":
            name, eq, val = t.partition("=")
            action = opts.get(name)
            if action is None:
                unknown.append(name)
                i += 1
                if i < len(args) and not args[i].startswith("-"):  # its value, most likely
                    i += 1
                continue
            if eq:
                out.append(name + "=" + (dummy_value(action) if val in (PLACEHOLDER, ELLIPSIS) else val))
                i += 1
                continue
            out.append(name)
            i += 1
            n = action.nargs
            if _takes_value(action):
                if i < len(args):
                    out.append(dummy_value(action) if args[i] in (PLACEHOLDER, ELLIPSIS) else args[i])
                    i += 1
            elif n == "?" and i < len(args) and not args[i].startswith("-") and args[i] != ELLIPSIS:
                out.append(dummy_value(action) if args[i] == PLACEHOLDER else args[i])
                i += 1
            elif n in ("*", "+"):
                while i < len(args) and not args[i].startswith("-") and args[i] != ELLIPSIS:
                    out.append(dummy_value(action) if args[i] == PLACEHOLDER else args[i])
                    i += 1
            elif isinstance(n, int) and n > 1:
                for _ in range(n):
                    if i < len(args):
                        out.append(dummy_value(action) if args[i] in (PLACEHOLDER, ELLIPSIS) else args[i])
                        i += 1
            continue
        out.append("x" if t == PLACEHOLDER else t)
        i += 1
    return unknown, out


def parse_with(parser: argparse.ArgumentParser, args: list[str], has_ellipsis: bool) -> list[str]:
    """Error messages of parsing ``args`` (empty when they parse)."""
    unknown, argv = flag_errors(parser, args)
    if unknown:  # argparse's own message would be a consequence ("required: --pretrain" for "--pretrian")
        return [f"unknown flag {u} (not a flag of {parser.prog})" for u in unknown]
    errors = []
    if has_ellipsis:  # "...": the snippet leaves flags out on purpose; fill the required ones it does not give
        given = {a.split("=")[0] for a in argv if a.startswith("-")}
        for action in parser._actions:
            if action.required and action.option_strings and not given & set(action.option_strings):
                argv += [action.option_strings[0], dummy_value(action)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if e.code:
                msg = err.getvalue().strip().splitlines()
                errors.append(msg[-1].removeprefix(f"{parser.prog}: ") if msg else f"exit {e.code}")
    return errors


def alternatives(args: list[str]) -> list[list[str]]:
    """``--lora_export merged|adapter`` -> one argument list per alternative."""
    variants = [[]]
    for a in args:
        if "|" in a and not a.startswith("-") and "://" not in a:
            alts = [x for x in a.split("|") if x]
            variants = [v + [x] for v in variants for x in alts][:16]
        else:
            variants = [v + [a] for v in variants]
    return variants


# ---------------------------------------------------------------------------------------------------------------
# One command


@dataclass
class Report:
    checked: list[str] = field(default_factory=list)  # "file:line: launch/x.py"
    skipped: list[str] = field(default_factory=list)  # "file:line: command (why)"
    errors: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # lines of shell blocks that are not commands


def wrapper_entry(script: str) -> str | None:
    """The launch/<name>.py a wrapper script (launch/mpirun_*.sh, launch/slurm/*.sbatch) hands "$@" to; "$NAME" for
    launch/mpirun.sh, whose first argument names it."""
    text = open(os.path.join(ROOT, script)).read()
    for line in text.split("\n"):
        if line.lstrip().startswith("#") or '"$@"' not in line:
            continue
        m = re.search(r"launch/(\w+)\.py", line) or re.search(r'/mpirun\.sh"? (\w+) "\$@"', line)
        if m:
            return m.group(1)
        if "$ENTRY" in line:
            m = re.search(r"ENTRY=\$\{ENTRY:-[^}\n]*?(\$?\w+)\.py\}", text)
            if m:
                return m.group(1)
    return None


def script_of(tokens: list[str]) -> tuple[str | None, list[str], str | None]:
    """(script, its arguments, why not) of one simple command."""
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[i]):  # VAR=value prefixes
        i += 1
    tokens = tokens[i:]
    if not tokens:
        return None, [], "only variable assignments"
    head = tokens[0]
    if head in ("bash", "sh", "exec") and len(tokens) > 1:
        return tokens[1], tokens[2:], None
    if head == "sbatch":
        for j, t in enumerate(tokens):
            if t.endswith((".sbatch", ".sh")):
                return t, tokens[j + 1:], None
        return None, [], "sbatch without a script"
    if PYTHONS.match(head) or head in LAUNCHERS:
        if PYTHONS.match(head) and len(tokens) > 2 and tokens[1] == "-m" and \
                tokens[2] not in ("torch.distributed.run", "torch.distributed.launch"):
            return None, [], f"python -m {tokens[2]}, not a script"
        for j, t in enumerate(tokens):
            if t.endswith(".py"):
                return t, tokens[j + 1:], None
        return None, [], "no .py script"
    return None, [], "not a command this test knows"


HEADS = {"bash", "sh", "exec", "sbatch"} | LAUNCHERS


def looks_like_command(line: str) -> bool:
    """A shell command line (not a directory tree or a program's output in an unlabelled block)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0], flags=re.S):
        words = words[1:]
    return bool(words) and (words[0] in HEADS or bool(PYTHONS.match(words[0])))


def check_command(where: str, command: str, report: Report) -> None:
    if not looks_like_command(command):
        report.other.append(f"{where}: {command[:60]}")
        return
    try:
        simple = tokenize(command)
    except ValueError as e:
        report.errors.append(f"{where}: cannot split the command ({e}): {command}")
        return
    for tokens in simple:
        script, args, why = script_of(tokens)
        if script is None:
            report.skipped.append(f"{where}: {' '.join(tokens)} ({why})")
            continue
        script = script.removeprefix("./")
        if script.startswith(("$", PLACEHOLDER)) or not script.startswith(SCRIPT_DIRS):
            report.skipped.append(f"{where}: {' '.join(tokens)} (script {script} is not in this repository)")
            continue
        if not os.path.isfile(os.path.join(ROOT, script)):
            report.errors.append(f"{where}: {script} does not exist")
            continue
        has_ellipsis = any(ELLIPSIS in a for a in args)
        if script.startswith("launch/") and not script.endswith(".py"):
            name = wrapper_entry(script)
            if name is None:
                report.skipped.append(f"{where}: {script} (a shell script that passes no flags to an entry point)")
                continue
            if name == "$NAME":  # launch/mpirun.sh NAME flags...
                name, args = (args[0], args[1:]) if args else ("", args)
            target = f"launch/{name}.py"
        else:
            target = script
        m = re.fullmatch(r"launch/(\w+)\.py", target)
        if m and m.group(1) in ENTRY_POINTS:
            parser = entry_parser(m.group(1))
            from rlhf.config.openrlhf import entry_name, translate  # OpenRLHF's dotted flags, as cli_main rewrites them

            try:
                args = translate(args, entry_name(ENTRY_POINTS[m.group(1)]), set(parser._option_string_actions))
            except ValueError as e:
                report.errors.append(f"{where}: {target}: {e}")
                continue
        elif m and m.group(1) == DSCHAT:
            step = next((args[k + 1] for k, a in enumerate(args[:-1]) if a == "--step"), None)
            if step not in ("1", "2", "3"):
                report.errors.append(f"{where}: {target}: --step 1|2|3 missing")
                continue
            parser = dschat_parser(int(step))
        elif target in TOOL_PARSERS:
            parser = tool_parser(target)
        elif m:
            report.errors.append(f"{where}: {target} is a launch/*.py this test does not know: add it to "
                                 "ENTRY_POINTS with the module whose add_args builds its flags")
            continue
        else:
            report.checked.append(f"{where}: {target} (exists; flags not checked)")
            continue
        shown = target if target == script else f"{script} -> {target}"
        for variant in alternatives(args):
            for e in parse_with(parser, variant, has_ellipsis):
                report.errors.append(f"{where}: {shown}: {e}")
        report.checked.append(f"{where}: {shown}")


def check_markdown(text: str, path: str, report: Report | None = None) -> Report:
    """Checks every command of one markdown file (``path`` only names it in the messages)."""
    report = report or Report()
    for n, command in command_lines(text):
        check_command(f"{rel(path)}:{n}", command, report)
    return report


def check_all() -> Report:
    report = Report()
    for path in doc_files():
        with open(path) as f:
            check_markdown(f.read(), path, report)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Tests


def test_doc_commands_parse():
    report = check_all()
    print(f"{len(report.checked)} commands checked, {len(report.skipped)} skipped, {len(report.other)} lines of "
          "shell blocks that are not commands")
    for s in report.checked + ["skipped:"] + report.skipped + ["not commands:"] + report.other:
        print("  " + s)
    assert not report.errors, "commands in the docs that would not start:\n" + "\n".join(report.errors)
    assert sum("launch/" in c for c in report.checked) >= 20, report.checked  # the checker found the commands


def test_checker_catches_a_misspelled_flag():
    """Negative controls: the same checker reports a misspelled flag (with file, line and flag), a value outside
    a flag's choices, a missing required flag without "...", a removed tool, and passes the corrected snippet."""
    bad = "\n".join([
        "Some text.", "",
        "```bash",
        "# a comment",
        "torchrun --nproc_per_node 2 launch/sft.py --pretrian <HF dir> --dataset d.jsonl \\",
        "    --save_path out/sft",
        "torchrun --nproc_per_node 2 launch/ppo.py --pretrain m --prompt_data p.jsonl --save_path o \\",
        "    --lerning_rate 1e-6",
        "python launch/dpo.py --pretrain m --dataset d.jsonl --save_path o --lora_export merged|sideways",
        "OMP_NUM_THREADS=2 python launch/kto.py --pretrain m --dataset d.jsonl",
        "python tools/no_such_tool.py --x 1",
        "torchrun --nproc_per_node 2 launch/dschat.py --step 1 --model_name_or_path <model> --data_split 2,4,4 \\",
        "    --per_device_train_batch_size 8 --dtype bf16 --output_dir out/step1",
        "srun --kill-on-bad-exit=1 python launch/rm.py --pretrain m --dataset d --save_path o --tp 2  # comment",
        "mpirun -np 4 -x OMP_NUM_THREADS .venv/bin/python launch/batch_inference.py --mode generate --dataset d \\",
        "    --output_path o",
        "```",
    ])
    r = check_markdown(bad, "FAKE.md")
    errors = "\n".join(r.errors)
    assert "FAKE.md:5: launch/sft.py: unknown flag --pretrian" in errors, errors
    assert "FAKE.md:7: launch/ppo.py: unknown flag --lerning_rate" in errors, errors
    assert "FAKE.md:9: launch/dpo.py:" in errors and "sideways" in errors, errors
    assert "FAKE.md:10: launch/kto.py:" in errors and "--save_path" in errors, errors
    assert "FAKE.md:11: tools/no_such_tool.py does not exist" in errors, errors
    assert len(r.errors) == 5, errors

    good = bad.replace("--pretrian", "--pretrain").replace("--lerning_rate", "--actor_learning_rate")
    good = good.replace("merged|sideways", "merged|adapter").replace("--dataset d.jsonl\n", "--dataset d.jsonl ...\n")
    good = good.replace("python tools/no_such_tool.py --x 1", "python tools/plan_memory.py --pretrian x ...")
    r = check_markdown(good, "FAKE.md")
    assert [e.split(": ", 1)[0] for e in r.errors] == ["FAKE.md:11"], r.errors  # the tool's flags are checked too
    assert "unknown flag --pretrian" in r.errors[0], r.errors
    for checked in ("FAKE.md:12: launch/dschat.py", "FAKE.md:14: launch/rm.py", "FAKE.md:15: launch/batch_inference.py"):
        assert checked in r.checked, r.checked


def test_wrappers_forward_to_their_entry_points():
    for kind in ("sft", "rm", "ppo"):
        assert wrapper_entry(f"launch/mpirun_{kind}.sh") == kind
        assert wrapper_entry(f"launch/slurm/{kind}.sbatch") == kind
    assert wrapper_entry("launch/mpirun.sh") == "$NAME"
    assert wrapper_entry("launch/demo.sh") is None


def guide_problems(text: str) -> list[str]:
    """What keeps ``text`` (the README) from being a guide: too long, too many words, a date or a commit hash."""
    lines = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
    out = []
    if len(lines) > README_MAX_LINES:
        out.append(f"{len(lines)} lines (at most {README_MAX_LINES}): move details to docs/")
    words = len(text.split())
    if words > README_MAX_WORDS:
        out.append(f"{words} words (at most {README_MAX_WORDS}): move details to docs/")
    for n, line in enumerate(lines, 1):
        for m in DATE.finditer(line):
            out.append(f"line {n}: date {m.group()}: dated figures go to docs/status.md or the page they belong to")
        for m in COMMIT.finditer(line):
            out.append(f"line {n}: commit hash {m.group()}: the evidence goes to docs/status.md")
    return out


def wide_lines(text: str, tables_too: bool) -> list[int]:
    """Line numbers wider than MAX_COLUMNS; table rows (``| ...``) outside fenced blocks only with ``tables_too``."""
    out, fence = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if len(line) > MAX_COLUMNS and (tables_too or fence or not line.lstrip().startswith("|")):
            out.append(n)
    return out


def dates_outside_results(text: str) -> list[int]:
    """Line numbers of dates outside a results section and outside a table. A results section is a heading whose
    text says "results" (any case) and everything under it up to the next heading of its level or above; a heading
    line belongs to the section it opens; a link's target is not prose."""
    out, fence, stack = [], False, []  # stack: (level, is results) of the headings above the line
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"(#{1,6})\s+(.*)", line)
        if m:
            level = len(m.group(1))
            stack = [s for s in stack if s[0] < level] + [(level, "results" in m.group(2).lower())]
        in_results = any(r for _, r in stack)
        is_table = not fence and line.lstrip().startswith("|")
        prose = re.sub(r"\]\([^)\s]*\)", "]", line)  # a link's target (CHANGELOG.md#2026-11-28) dates nothing
        if DATE.search(prose) and not in_results and not is_table:
            out.append(n)
    return out


def test_readme_is_a_guide():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    problems = guide_problems(text)
    assert not problems, "README.md:\n" + "\n".join(problems)
    for command in ("bash tools/setup_env.sh && bash launch/demo.sh",
                    "bash tools/setup_env.sh && .venv/bin/python -m pytest tests -q",
                    '.venv/bin/python -m pytest tests -q -m "not slow"'):
        assert f"```bash\n{command}" in text, command


def test_no_line_is_wider_than_the_cap():
    bad = []
    for path in doc_files():
        if rel(path) in PENDING:
            continue
        with open(path) as f:
            text = f.read()
        bad += [f"{rel(path)}:{n}" for n in wide_lines(text, tables_too=rel(path) == "README.md")]
    assert not bad, f"lines over {MAX_COLUMNS} columns (rewrap them):\n" + "\n".join(bad)


def test_docs_date_figures_in_results_sections():
    bad = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        if rel(path) in PENDING:
            continue
        with open(path) as f:
            bad += [f"{rel(path)}:{n}" for n in dates_outside_results(f.read())]
    assert not bad, ("dates outside a results section or a table (move the dated sentences into the page's closing "
                     "'## Results' section):\n" + "\n".join(bad))


def test_guide_rules_catch_what_they_forbid():
    """Negative controls for the three rules above, on made-up pages."""
    long = "\n".join(f"line {i} of a README" for i in range(README_MAX_LINES + 1)) + "\n"
    assert any("lines" in p for p in guide_problems(long))
    assert not guide_problems("\n".join(long.split("\n")[:README_MAX_LINES]) + "\n")
    assert any("words" in p for p in guide_problems("word " * (README_MAX_WORDS + 1)))
    dated = "Measured 2026-11-23 at commit 5d5ab36.\nA 0x70000000 uid, deadbeef, 1234567 and a facade.\n"
    assert guide_problems(dated) == ["line 1: date 2026-11-23: dated figures go to docs/status.md or the page "
                                     "they belong to", "line 1: commit hash 5d5ab36: the evidence goes to "
                                     "docs/status.md"], guide_problems(dated)
    page = "\n".join([
        "# Page", "x" * (MAX_COLUMNS + 1), "| " + "y" * MAX_COLUMNS + " |", "```", "z" * (MAX_COLUMNS + 1), "```",
        "Measured 2026-11-26.",  # 7: outside
        "## Results: a real model", "Measured 2026-11-26.",  # 9: inside
        "### Seed 2", "Run 2026-11-27.",  # 11: inside, under the results heading
        "## Flags", "Until 2026-11-28 it failed.",  # 13: outside again
        "| 2026-11-29 | 13.9 |",  # 14: a table row
        "```", "## Results in a code block, not a heading", "```", "2026-11-30",  # 18: outside
        "Before that ([CHANGELOG](../CHANGELOG.md#2026-11-28)) it hung.",  # 19: a link's target only
    ])
    assert wide_lines(page, tables_too=False) == [2, 5]
    assert wide_lines(page, tables_too=True) == [2, 3, 5]
    assert dates_outside_results(page) == [7, 13, 18], dates_outside_results(page)


def test_docs_index_lists_every_page():
    with open(os.path.join(ROOT, "docs", "README.md")) as f:
        text = f.read()
    linked = {os.path.normpath(m.group(1).partition("#")[0]) for m in re.finditer(r"\]\(([^)\s]+)\)", text)}
    pages = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not list: {sorted(pages - linked)}"


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out, seen = set(), {}
    in_fence = False
    with open(path) as f:
        for line in f:
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            m = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def test_relative_links_resolve():
    bad = []
    for path in doc_files():
        with open(path) as f:
            text = f.read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest):
                bad.append(f"{rel(path)}: {target}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                bad.append(f"{rel(path)}: {target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


def test_readme_entry_point_table_names_real_flags():
    launch = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "launch", "*.py"))}
    assert launch <= set(ENTRY_POINTS) | {DSCHAT}, sorted(launch - set(ENTRY_POINTS) - {DSCHAT})
    bad = []
    for page in ("README.md", "docs/entry_points.md"):
        with open(os.path.join(ROOT, page)) as f:
            rows = [line for line in f if line.startswith("| `launch/")]
        assert rows, f"the entry-point table of {page} is gone"
        seen = set()
        for row in rows:
            m = re.match(r"\| `launch/(\w+)\.py`", row)
            if not m:
                continue
            name = m.group(1)
            seen.add(name)
            parser = dschat_parser(1) if name == DSCHAT else entry_parser(name)
            for flag in re.findall(r"`(--[\w.-]+)", row):
                if flag not in parser._option_string_actions:
                    bad.append(f"{page}: launch/{name}.py row: {flag} is not a flag of it")
        assert launch <= seen, f"launch/*.py missing from the entry-point table of {page}: {sorted(launch - seen)}"
    assert not bad, "\n".join(bad)
