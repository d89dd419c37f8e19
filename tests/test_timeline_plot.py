"""The timeline behind a plan (cost_model.schedule), its Gantt chart, and omgs-plan --plot."""

import json
import random

import pytest

from omgs_hook import cli_plan
from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, schedule, simulate
from omgs_hook.planner import make_plan


def _instance(seed, dense=True):
    rng = random.Random(seed)
    layers = tuple(Unit(numel=rng.randint(1, 200_000), backward_s=rng.uniform(0, 2e-3))
                   for _ in range(rng.randint(1, 9)))
    return Instance(layers=layers, world_size=4, density=0.01, forward_s=rng.uniform(0, 5e-3),
                    comm=LinearCost(rng.uniform(0, 1e-3), rng.uniform(0, 1e-8)),
                    topk=TopkCost(rng.uniform(0, 1e-4), rng.uniform(0, 1e-9), 0.0),
                    dense=LinearCost(1e-4, 2e-9) if dense else None,
                    tail_s=rng.uniform(0, 1e-3))


@pytest.mark.parametrize("seed", range(30))
def test_schedule_agrees_with_simulate_and_respects_the_model(seed):
    inst = _instance(seed, dense=seed % 2 == 0)
    plan = make_plan(inst, "optimal")
    sched = schedule(inst, plan.groups, plan.dense)
    timeline = simulate(inst, plan.groups, plan.dense)
    assert sched.tail[1] == pytest.approx(timeline.predicted_iteration_s, rel=1e-12, abs=1e-15)
    assert sched.forward == (0.0, inst.forward_s)
    # backward units back to back; a group's collective starts after its selection and
    # after the previous collective; collectives never overlap
    assert sched.backward[0][0] == inst.forward_s
    for (s0, e0), (s1, e1) in zip(sched.backward, sched.backward[1:]):
        assert s1 >= e0 - 1e-15
    previous_end = 0.0
    for g, units in enumerate(sched.groups):
        last_unit_end = sched.backward[units[-1]][1]
        sel_start, sel_end = sched.selection[g]
        assert sel_start >= last_unit_end - 1e-15
        if sched.dense[g]:
            assert sel_end == sel_start
        start, end = sched.network[g]
        assert start >= sel_end - 1e-15 and start >= previous_end - 1e-15
        previous_end = end


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from omgs_hook.timeline_plot import plot_timelines

    inst = _instance(3)
    plan = make_plan(inst, "optimal")
    sched = schedule(inst, plan.groups, plan.dense)
    out = tmp_path / "t.png"
    plot_timelines([("predicted", sched), ("again", sched)], out, title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to draw"):
        plot_timelines([], tmp_path / "none.png")


def test_omgs_plan_plot_option(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(_instance(5).to_dict()))
    out = tmp_path / "plan.png"
    assert cli_plan.main([str(path), "--plot", str(out)]) == 0
    assert "groups" in json.loads(capsys.readouterr().out)
    assert out.stat().st_size > 1000
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([_instance(5).to_dict()] * 2))
    assert cli_plan.main([str(listed), "--plot", str(out)]) == 2
    assert "one instance" in capsys.readouterr().err


def test_measured_schedule_from_host_marks(tmp_path):
    from omgs_hook.group_exchange import GroupRecord
    from omgs_hook.timeline_plot import measured_schedule

    layout = [("a", "b"), ("c",), ("d",)]
    first = GroupRecord(("a", "b", "c"), False, 10, 1, 12, started=10.030)
    first.issued, first.done = 10.032, 10.050
    second = GroupRecord(("d",), True, 5, 5, 20, started=10.041)
    second.issued, second.done = 10.041, 10.060
    sched = measured_schedule(10.0, 10.010, [10.020, 10.030, 10.040], layout,
                              [first, second], tail_end=10.070)
    assert sched.forward == (0.0, pytest.approx(0.010))
    assert [pytest.approx(x) for pair in sched.backward for x in pair] == [
        0.010, 0.020, 0.020, 0.030, 0.030, 0.040]
    assert sched.groups == ((0, 1), (2,)) and sched.dense == (False, True)
    assert sched.selection[0] == (pytest.approx(0.030), pytest.approx(0.032))
    assert sched.network[1] == (pytest.approx(0.041), pytest.approx(0.060))
    assert sched.tail == (pytest.approx(0.060), pytest.approx(0.070))
    pytest.importorskip("matplotlib")
    from omgs_hook.timeline_plot import plot_timelines

    plot_timelines([("measured", sched)], tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
