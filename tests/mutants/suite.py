"""Planted bugs of the suite's own rank budget (tests/rank_budget.py, the xdist workers' share of the cores): each
caught by tests/test_rank_budget.py."""
from tests.mutants import Mutant

T = "tests/test_rank_budget.py::"
F = "tests/rank_budget.py"

MUTANTS = [
    Mutant("suite-rank-budget-ignored", F,
           find="    return used == 0 or used + ranks <= RANK_BUDGET\n", replace="    return True\n",
           claim="a multi-rank job waits while the other workers' jobs hold the budget of ranks",
           tests=(T + "test_a_job_waits_while_the_other_worker_holds_the_budget",
                  T + "test_run_tagged_waits_for_its_ranks")),
    Mutant("suite-rank-budget-overtaken", F,
           find='(not state["queue"] and _fits(state, ranks))', replace="_fits(state, ranks)",
           claim="a waiting wide job is not overtaken by narrow ones that fit (first come, first served)",
           tests=(T + "test_a_waiter_first_in_line_is_not_overtaken",)),
    Mutant("suite-rank-budget-zombie-holds", F,
           find='not in ("Z", "X")', replace='not in ("X",)',
           claim="the ranks of a killed worker (a zombie until reaped) are given back",
           tests=(T + "test_a_dead_holder_gives_its_ranks_back",)),
    Mutant("suite-rank-budget-not-reentrant", F,
           find='        if _HELD["ranks"] or (not state', replace='        if (not state',
           claim="a worker that holds ranks gets more at once (a test never waits for itself)",
           tests=(T + "test_a_worker_holding_ranks_gets_more_at_once",)),
    Mutant("suite-rank-budget-no-cap", F,
           find="                late = time.monotonic() >= deadline\n", replace="                late = False\n",
           claim="a leaked holder slows the suite but never hangs it",
           tests=(T + "test_a_leaked_holder_slows_the_suite_but_never_hangs_it",)),
    Mutant("suite-rank-budget-run-tagged-unhooked", "tests/helpers.py",
           find="    with ranks_of_budget(ranks_in(cmd)):\n", replace="    with ranks_of_budget(0):\n",
           claim="the jobs the tests start through run_tagged take their ranks from the budget",
           tests=(T + "test_run_tagged_waits_for_its_ranks",)),
]
