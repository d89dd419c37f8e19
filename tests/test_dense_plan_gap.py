"""scripts/dense_plan_gap.py: the hook's dense plan against the search run to the end."""

import pytest

from omgs_hook import planner
from script_loader import load_script

gap_script = load_script("dense_plan_gap")


def test_a_plan_stopped_by_the_budget_is_measured_against_the_exact_one(monkeypatch):
    """With a budget small enough to stop the search, the hook's plan is the bounded
    one; lifted, the exact search finishes and is never worse; the budget is restored."""
    inst = gap_script.instance(seed=3, units=60)
    monkeypatch.setattr(planner, "SEARCH_BUDGET", 50)
    hook_row, exact_row, excess = gap_script.gap(inst, budget=1e9)
    assert hook_row["stopped_by_budget"] is True
    assert exact_row["stopped_by_budget"] is False
    assert excess >= -1e-12
    assert excess == pytest.approx(hook_row["predicted_s"] / exact_row["predicted_s"] - 1)
    assert planner.SEARCH_BUDGET == 50


@pytest.mark.parametrize("argv", [["--seeds", "a"], ["--seeds", ""], ["--units", "0"],
                                  ["--budget", "10"]])
def test_bad_arguments_are_refused_before_planning(argv):
    with pytest.raises(SystemExit):
        gap_script.main(argv)
