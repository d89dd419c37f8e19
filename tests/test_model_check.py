"""The model against reality: collective costs scaled by the hook's own timed
collectives (``measured_comm``), estimates from the steps of the plan in use, and the
model check of a plan after it ran (``stats()["model_check"]``)."""

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import omgs_hook
from ddp_harness import run_ranks
from omgs_hook.cost_model import LinearCost
from omgs_hook.hook import MAX_CHECK_POSTPONES, OMGSState
from omgs_hook.measurements import (BackwardMeter, CommTimeMeter, comm_scale, comm_sums)
from test_hook_ddp import DENSITY, Net, train_steps


def record(dense, nbytes, numel, issued, done):
    return SimpleNamespace(dense=dense, bytes=nbytes, numel=numel, issued=issued, done=done)


# ----------------------------------------------------------------------------- pure parts
def test_comm_sums_counts_each_collective_from_issue_or_the_previous_end():
    records = [
        record(False, 80, 1000, issued=1.0, done=1.5),   # alone: 0.5
        record(True, 400, 100, issued=1.2, done=2.0),    # queued behind the first: 0.5
        record(False, 16, 200, issued=2.5, done=2.6),    # network idle before: 0.1
        record(True, 40, 10, issued=2.55, done=2.58),    # finished before the one ahead: 0
    ]
    s_s, s_n, s_b, d_s, d_n, d_e = comm_sums(records)
    assert s_s == pytest.approx(0.6) and (s_n, s_b) == (2, 96)
    assert d_s == pytest.approx(0.5) and (d_n, d_e) == (2, 110)


def test_comm_sums_of_a_step_with_an_unfinished_group_is_none():
    assert comm_sums([record(False, 8, 10, 1.0, None)]) is None
    assert comm_sums([]) == (0.0, 0, 0, 0.0, 0, 0)


def test_comm_scale_is_measured_over_modelled_time():
    # 3 collectives of 1000 bytes in all on alpha=1e-3, beta=1e-6: 4e-3 s modelled
    assert comm_scale(8e-3, 3, 1000, 1e-3, 1e-6) == pytest.approx(2.0)
    assert comm_scale(8e-3, 0, 0, 1e-3, 1e-6) is None  # no collective of this kind
    assert comm_scale(8e-3, 3, 1000, 0.0, 0.0) is None  # a line pricing it at zero
    assert comm_scale(0.0, 3, 1000, 1e-3, 1e-6) is None  # a clock that did not move


def test_comm_time_meter_keeps_the_last_steps_and_round_trips():
    meter = CommTimeMeter(window=2)
    meter.add((1.0, 1, 10, 0.0, 0, 0))
    meter.add(None)  # a failed step adds nothing
    meter.add((2.0, 2, 20, 0.5, 1, 100))
    meter.add((4.0, 4, 40, 0.0, 0, 0))
    assert len(meter) == 2
    assert meter.totals() == (6.0, 6, 60, 0.5, 1, 100)
    other = CommTimeMeter(window=2)
    other.load_state_dict(meter.state_dict())
    assert other.totals() == meter.totals()
    with pytest.raises(ValueError):
        CommTimeMeter(window=0)


def test_scaling_takes_the_median_step_and_the_least_rank_per_kind():
    comm, dense = LinearCost(1e-3, 1e-6), LinearCost(2e-3, 1e-9)
    # per rank, three steps of (sparse_s, count, bytes, dense_s, count, elements); the
    # modelled sparse time of 3 collectives of 1000 bytes in all is 4e-3 s
    table = torch.tensor([
        [[8e-3, 3, 1000, 0, 0, 0], [8e-3, 3, 1000, 0, 0, 0], [80e-3, 3, 1000, 0, 0, 0]],
        # x3 (it waited for rank 0); one dense all-reduce of 1000 elements, twice
        [[12e-3, 3, 1000, 6e-3, 1, 1000], [12e-3, 3, 1000, 6e-3, 1, 1000], [0] * 6],
        [[0] * 6] * 3,  # a rank without samples is left out
    ], dtype=torch.float64)
    new_comm, new_dense, factors = OMGSState._scaled_by_measurement(table, comm, dense)
    assert factors["sparse"] == pytest.approx(2.0)  # rank 0's median step, not its sum (x8)
    assert factors["dense"] == pytest.approx(6e-3 / (2e-3 + 4e-6))
    assert new_comm.alpha_s == pytest.approx(2e-3) and new_comm.beta_s_per_byte == pytest.approx(2e-6)
    assert new_dense.alpha_s == pytest.approx(2e-3 * factors["dense"])
    # no dense cost (allow_dense=False): nothing to scale there
    _, none_dense, factors = OMGSState._scaled_by_measurement(table, comm, None)
    assert none_dense is None and factors["dense"] is None


def test_the_comm_time_table_has_a_fixed_width():
    meter = CommTimeMeter(window=3)
    assert meter.table() == [0.0] * 18 == meter.empty_table()
    meter.add((1.0, 1, 8, 0.0, 0, 0))
    assert meter.table()[:6] == [1.0, 1.0, 8.0, 0.0, 0.0, 0.0] and len(meter.table()) == 18


def _step(meter, step, backward, layout=(("a",), ("b",))):
    meter.forward_started()
    meter.forward_finished()
    meter.clock = FakeMarks(backward)
    for i in range(len(layout)):
        meter.bucket_arrived(i)
        meter.sends_started()
        meter.sends_finished()
    meter.end_step(layout, step=step)


class FakeMarks:
    """A clock whose marks advance by ``per_mark`` each: every bucket gap is the same."""

    def __init__(self, per_mark):
        self.t, self.per_mark = 0.0, per_mark

    def mark(self):
        self.t += self.per_mark
        return self.t

    def seconds(self, start, end):
        return end - start


def test_the_meter_prefers_the_steps_of_the_plan_in_use_once_there_are_enough():
    meter = BackwardMeter(window=32)
    for step in range(10):
        _step(meter, step, backward=1.0)  # e.g. the dense warm-up
    meter.prefer_from(10)
    _step(meter, 10, backward=0.25)
    _step(meter, 11, backward=0.25)
    # a bucket's gap is 3 marks (arrival, sends started, finished) less the sends' 1
    assert meter.backward_s()[1] == pytest.approx(2.0)  # 2 fresh steps: not enough yet
    _step(meter, 12, backward=0.25)
    assert meter.backward_s()[1] == pytest.approx(0.5)
    assert all(step >= 10 for step, _ in meter.timelines())
    # the preference survives a state dict; an old one without step tags has none
    other = BackwardMeter(window=32)
    other.load_state_dict(meter.state_dict())
    assert other.backward_s() == meter.backward_s()
    old = meter.state_dict()
    for key in ("sample_steps", "forward_steps", "tail_steps", "prefer_from_step"):
        old.pop(key)
    other.load_state_dict(old)
    assert other.backward_s()[1] == pytest.approx(2.0)  # all 13 samples: the old median


def test_measured_comm_must_be_a_bool():
    with pytest.raises(ValueError, match="measured_comm"):
        OMGSState(measured_comm="yes")


# ----------------------------------------------------------------------- under real DDP
STEADY_FORWARD_S = 0.01


def steady_forward(model, extra=None):
    """Every forward of ``model`` takes a steady STEADY_FORWARD_S more, then ``extra()``.

    This tiny model's own forward takes well under 1 ms, so a scheduler hiccup of a busy
    host alone could move its median by the spell factor: a real load spell, which a
    model check rightly waits for, moving its step (tests without a spell failed so now
    and then)."""
    import time

    def pre_hook(module, args):
        time.sleep(STEADY_FORWARD_S)
        if extra is not None:
            extra()

    model.register_forward_pre_hook(pre_hook)


def check_worker(rank, world_size, steps, **options):
    import torch.distributed as dist
    from omgs_hook import plan_selection

    # (real clocks: the winner's second trial, when its settled steps ran slower than
    # another candidate's trial steps, would put a trial plan in use at the end; that
    # second trial is tested with fake clocks in test_regret_trial)
    plan_selection.REGRET_TRIAL = False
    plan_selection.DUEL_PAIRS = 0  # (the check after the trial is tested: a short trial)
    torch.manual_seed(0)
    model = Net()
    steady_forward(model)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=2, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_steps(ddp, opt, 0, steps, rank)
    stats = state.stats()
    layout = state.plan.layout
    # the same inputs with and without the measured scaling (collective: both ranks)
    scaled, inputs = state._build_instance(layout)
    state.measured_comm = False
    plain, plain_inputs = state._build_instance(layout)
    out = {"stats": stats, "factor": inputs["comm_scale"]["sparse"],
           "scaled_alpha": scaled.comm.alpha_s, "plain_alpha": plain.comm.alpha_s,
           "plain_scale": plain_inputs["comm_scale"],
           "state_dict_keys": sorted(state.state_dict())}
    dist.barrier()
    del ddp, state
    gc.collect()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("select", ["model", "measured"])
def test_a_plan_is_checked_against_its_own_steps_identically_on_every_rank(select):
    steps = 30 if select == "model" else 70
    results = run_ranks("test_model_check", "check_worker", world_size=2, timeout=240,
                        steps=steps, select=select, allow_dense=False)
    checks = [r["stats"]["model_check"] for r in results]
    assert checks[0] is not None, "no model check ran"
    assert checks[0] == checks[1]  # gathered numbers: the same on both ranks
    check = checks[0]
    assert check["measured_s"] > 0 and check["predicted_s"] > 0
    assert check["error"] == pytest.approx(
        (check["predicted_s"] - check["measured_s"]) / check["measured_s"])
    assert check["comm_scale"]["sparse"] is not None
    if select == "measured":
        # the winner's prediction is now the one from its own steps
        assert results[0]["stats"]["predicted_iteration_s"] == check["predicted_s"]
        assert results[0]["stats"]["selection"]["last_trial"] is not None
    for r in results:
        # the factor really reaches the planner's input: alpha (+ write-back) scaled by it
        assert r["factor"] is not None
        assert r["scaled_alpha"] == pytest.approx(r["plain_alpha"] * r["factor"], rel=1e-9)
        assert r["plain_scale"] == {"sparse": None, "dense": None}
        assert "comm_times" in r["state_dict_keys"]


def spell_check_worker(rank, world_size, steps, spell):
    import time

    from omgs_hook import plan_selection
    plan_selection.DUEL_PAIRS = 0  # (the check after the trial is tested: a short trial)

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0)
    # (the check that follows a trial's winner; select="model" checks a plan only when
    # a re-plan changed it)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=2, select="measured",
                               allow_dense=False)
    slowed = []

    def load_spell():
        # a load spell over the first check's steps: each forward takes 30 ms more
        if spell and state._check_at is not None and state._check_postponed == 0:
            time.sleep(0.03)
            slowed.append(state.step)

    steady_forward(model, load_spell)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checks = []
    # only the checks from the first one scheduled (_check_at) on: the "overhead"
    # re-plan after the sparse lead checks its plan too, before any of them
    armed, before = False, None
    for step in range(steps):
        train_steps(ddp, opt, step, step + 1, rank)
        check = state.stats()["model_check"]
        if not armed:
            armed, before = state._check_at is not None, check
            continue
        if check is not None and check != before and (not checks or check != checks[-1]):
            checks.append(check)
        if checks and not spell:
            break
    out = {"checks": checks, "slowed": slowed}
    del ddp, state
    gc.collect()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("spell", [True, False])
def test_a_check_whose_steps_ran_in_a_load_spell_waits_and_measures_afresh(spell):
    results = run_ranks("test_model_check", "spell_check_worker", world_size=2, timeout=240,
                        steps=70, spell=spell)
    first = [r["checks"][0] for r in results if r["checks"]]
    assert len(first) == 2 and first[0] == first[1], "the check differs between ranks"
    check = first[0]
    if spell:
        assert results[0]["slowed"], "the spell never ran"
        # the check saw the spell in the forward times, waited, then ran on the steps
        # after it. (The spell slows only the first attempt; a busy host can add real
        # spells after it, each one more wait, up to the cap - so "at least once".)
        assert 1 <= check["postponed"] <= MAX_CHECK_POSTPONES
        assert check["step"] > max(results[0]["slowed"])
    else:
        assert check["postponed"] == 0 and not results[0]["slowed"]
    # (at the cap the check runs whatever the load: it gives up waiting)
    assert (check["forward_load"] is None or check["forward_load"] <= 1.3
            or check["postponed"] == MAX_CHECK_POSTPONES)


def test_the_dense_correction_reaches_a_measured_inter_node_all_reduce():
    from omgs_hook.hook import _two_level_corrected
    from omgs_hook.plan_selection import Correction

    intra, inter, inter_dense = LinearCost(1e-5, 1e-10), LinearCost(1e-3, 1e-8), LinearCost(1e-3, 2e-8)
    correction = Correction(dense_s_per_element=4e-9)
    per_node, _, _, corrected = _two_level_corrected((4, intra, inter, inter_dense), correction)
    # a D-element dense group all-reduces D/4 shard elements of 4 bytes: +4e-9 s per
    # group element is +4e-9 * 4 / 4 s per shard byte
    assert per_node == 4 and corrected.alpha_s == 1e-3
    assert corrected.beta_s_per_byte == pytest.approx(2e-8 + 4e-9)
    # derived inter_dense (None) and no dense term: unchanged
    assert _two_level_corrected((4, intra, inter, None), correction)[3] is None
    same = (4, intra, inter, inter_dense)
    assert _two_level_corrected(same, Correction(sparse_group_s=1e-3)) == same


def test_the_trial_correction_adds_its_slopes_but_not_its_level():
    from omgs_hook.cost_model import Instance, TopkCost, Unit
    from omgs_hook.hook import _corrected
    from omgs_hook.plan_selection import Correction

    base = Instance(layers=(Unit(numel=1000, backward_s=0.01),), world_size=2, density=0.01,
                    forward_s=0.02, comm=LinearCost(1e-4, 1e-9), topk=TopkCost(1e-4, 1e-9, 0.0),
                    dense=LinearCost(2e-4, 1e-9), tail_s=0.005)
    got = _corrected(base, Correction(constant_s=0.15, dense_s_per_element=4e-9,
                                      sparse_group_s=2e-3))
    assert got.tail_s == base.tail_s  # the trial's level stays out
    assert got.topk.c0 == pytest.approx(1e-4 + 2e-3)
    assert got.dense.beta_s_per_byte == pytest.approx(1e-9 + 1e-9)
    clamped = _corrected(base, Correction(sparse_group_s=-1.0))
    assert clamped.topk.c0 == 0.0
    assert _corrected(base, None) is base
    assert got.level_s == 0.0  # no reference (a correction saved before the centring)


def test_the_group_term_is_centred_on_the_trials_typical_plan():
    """A plan with the reference's sparse groups keeps the fresh model's prediction; one
    with fewer or more moves by the term per group of difference. (The instance is
    compute-bound: every group's top-k lies on the critical path.)"""
    from omgs_hook.cost_model import Instance, TopkCost, Unit
    from omgs_hook.hook import _corrected
    from omgs_hook.plan_selection import Correction
    from omgs_hook.planner import predicted_iteration_s

    base = Instance(layers=tuple(Unit(numel=1000, backward_s=0.01) for _ in range(6)),
                    world_size=8, density=0.01, forward_s=0.2,
                    comm=LinearCost(1e-5, 1e-10), topk=TopkCost(1e-3, 1e-9, 0.0), tail_s=0.02)
    correction = Correction(constant_s=-0.138, sparse_group_s=0.049, sparse_groups_ref=3.0)
    got = _corrected(base, correction)
    assert got.level_s == pytest.approx(-0.049 * 3)
    plans = {1: [list(range(6))], 2: [[0, 1, 2], [3, 4, 5]], 3: [[0, 1], [2, 3], [4, 5]],
             6: [[i] for i in range(6)]}
    for groups, plan in plans.items():
        before = predicted_iteration_s(base, plan, [False] * groups)
        after = predicted_iteration_s(got, plan, [False] * groups)
        assert after - before == pytest.approx(0.049 * (groups - 3), abs=1e-9)
    # clamped at zero: only what the clamp let through is taken back
    cut = _corrected(base, Correction(sparse_group_s=-0.005, sparse_groups_ref=2.0))
    assert cut.topk.c0 == 0.0 and cut.level_s == pytest.approx(1e-3 * 2)
    # never below minus the step outside backward: no prediction can be absurd
    far = _corrected(base, Correction(sparse_group_s=1.0, sparse_groups_ref=40.0))
    assert far.level_s == pytest.approx(-(0.2 + 0.02))


def test_the_level_takes_back_what_the_term_adds_to_the_reference_plans_timeline():
    """Network-bound: most of the per-group term hides behind the collectives. The
    reference plan keeps the fresh model's prediction exactly, a plan of the same
    group count moves only by what its own timeline shows, and the old level (the term
    times the reference's group count) priced every plan far too fast - as it did the
    winner of ResNet-20 on 8 ranks at density 0.01 (-14%)."""
    from omgs_hook.cost_model import Instance, TopkCost, Unit
    from omgs_hook.hook import _corrected
    from omgs_hook.plan_selection import Correction
    from omgs_hook.planner import predicted_iteration_s

    base = Instance(layers=tuple(Unit(numel=1000, backward_s=0.004) for _ in range(6)),
                    world_size=8, density=0.01, forward_s=0.2,
                    comm=LinearCost(0.05, 1e-9), topk=TopkCost(1e-3, 1e-9, 0.0), tail_s=0.02)
    ref = [[0, 1], [2, 3], [4, 5]]
    term = Correction(constant_s=-0.1, sparse_group_s=0.02, sparse_groups_ref=3.0)
    centred = dataclasses.replace(term, ref_plan=(tuple(map(tuple, ref)), (False,) * 3, None))
    before = predicted_iteration_s(base, ref, None)
    got = _corrected(base, centred)
    assert predicted_iteration_s(got, ref, None) == pytest.approx(before, abs=1e-12)
    other = [[0], [1, 2, 3], [4, 5]]  # the same count: its own hidden share only
    assert predicted_iteration_s(got, other, None) == pytest.approx(
        predicted_iteration_s(base, other, None), abs=0.02)
    old = _corrected(base, term)
    hidden = 3 * 0.02 - (predicted_iteration_s(old, ref, None) - old.level_s
                         - (before - base.level_s))
    assert hidden > 0.02  # most of the term is hidden in this timeline ...
    assert predicted_iteration_s(old, ref, None) < before - 0.02  # ... the old level: too fast
    # the slopes are the same either way; only the level differs
    assert got.topk == old.topk and got.dense == old.dense
    # a reference this timeline cannot price: the old level
    def level_with(groups, dense=None, exchange=None, registered=None):
        plan = (tuple(map(tuple, groups)), tuple(dense or [False] * len(groups)), exchange)
        return _corrected(base, dataclasses.replace(term, ref_plan=plan), registered).level_s

    assert level_with([[0, 1, 2], [3, 4, 5]]) != old.level_s  # any plan of these units
    assert level_with([[0, 1], [2, 3]]) == old.level_s  # other units: the layout changed
    assert level_with(ref, exchange="hierarchical") == old.level_s  # a two-level plan
    # a reference plan saved without its exchange ran on the registration's
    assert level_with(ref, registered="hierarchical") == old.level_s
    assert level_with(ref, registered="flat") == got.level_s
    # dense groups in the reference, no dense cost in the model: the old level
    assert level_with(ref, dense=[True, False, False]) == old.level_s
    # a reference with dense groups: the dense term (not centred) is never taken back,
    # only what the group term adds on top of it (at most its full product)
    with_dense = dataclasses.replace(base, dense=LinearCost(1e-3, 1e-9))
    mixed = Correction(dense_s_per_element=1e-4, sparse_group_s=0.02, sparse_groups_ref=1.0,
                       ref_plan=(((0, 1), (2, 3), (4, 5)), (True, False, True), "flat"))
    level = _corrected(with_dense, mixed).level_s
    assert -0.02 - 1e-12 <= level <= 0.0
    no_dense_term = _corrected(with_dense, dataclasses.replace(mixed, dense_s_per_element=0.0))
    dense_term_shows = (predicted_iteration_s(_corrected(with_dense, mixed), *mixed.ref_plan[:2])
                        - predicted_iteration_s(no_dense_term, *mixed.ref_plan[:2]))
    assert dense_term_shows > 0.1  # 2000 dense elements at 0.1 ms each, on the critical path
    # never below minus the step outside backward
    far = _corrected(base, dataclasses.replace(centred, sparse_group_s=5.0))
    assert far.level_s >= -(0.2 + 0.02)


def settled_check_worker(rank, world_size, steps, sleep_s):
    import time

    from omgs_hook import plan_selection
    plan_selection.DUEL_PAIRS = 0  # (the check after the trial is tested: a short trial)

    torch.manual_seed(0)
    model = Net()
    steady_forward(model)
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=DENSITY, warmup_steps=2, select="model",
                               strategy="single", allow_dense=False)

    def slow(grad):
        # from the first check on, backward takes sleep_s longer (its first bucket)
        if state._model_check is not None:
            time.sleep(sleep_s)
        return grad

    model.c.weight.register_hook(slow)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checks, seen = [], []
    for step in range(steps):
        train_steps(ddp, opt, step, step + 1, rank)
        check = state.stats()["model_check"]
        if check is not None and (not seen or check != seen[-1]):
            seen.append(check)
            checks.append(dict(check, preferred_from=state.meter.prefer_from_step))
    stats = state.stats()
    del ddp, state
    gc.collect()
    return {"checks": checks, "stats": stats}


@pytest.mark.multiprocess
def test_a_settled_check_re_predicts_the_plan_from_the_steps_after_the_first():
    from omgs_hook.hook import SETTLED_CHECK_STEPS

    results = run_ranks("test_model_check", "settled_check_worker", world_size=2,
                        timeout=240, steps=40, sleep_s=0.06)
    assert results[0]["checks"] == results[1]["checks"]  # gathered: the same everywhere
    checks = results[0]["checks"]
    assert [c["kind"] for c in checks] == ["first", "settled"], checks
    first, settled = checks
    stats = results[0]["stats"]
    history = stats["plan_history"]
    # the plan never changed: the settled check re-predicts, it does not re-plan
    assert len(history) == 1 and history[0]["strategy"] == "single", history
    assert settled["step"] == history[0]["step"] + SETTLED_CHECK_STEPS
    assert first["preferred_from"] == first["step"]  # the settled check's window starts there
    # its steps all ran with the slower backward (none from before the first check),
    # and so does its prediction, which the plan now carries. (60 ms of sleep against
    # margins of 20-25 ms: a busy host's noise in the first check's steps - up to 20 ms
    # at 12.5% CPU steal - must not eat the difference.)
    assert settled["measured_s"] > first["measured_s"] + 0.025, checks
    assert settled["predicted_s"] > first["predicted_s"] + 0.02, checks
    assert stats["predicted_iteration_s"] == settled["predicted_s"]
