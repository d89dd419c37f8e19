"""Tests for omgs_hook.cost_model: cost terms, instance validation, the timeline."""

import copy
import dataclasses
import math

import pytest

from omgs_hook.cost_model import (
    Instance,
    InstanceError,
    LinearCost,
    Timeline,
    TopkCost,
    Unit,
    check_groups,
    selected_k,
    simulate,
)


def instance_dict(**overrides):
    d = {
        "layers": [
            {"numel": 1000, "backward_s": 0.0002},
            {"numel": 250_000, "backward_s": 0.003},
            {"numel": 64, "backward_s": 0.0001},
        ],
        "world_size": 16,
        "density": 0.01,
        "forward_s": 0.01,
        "comm": {"alpha_s": 0.002, "beta_s_per_byte": 1e-8},
        "topk": {"c0": 1e-4, "c1": 2e-9, "c2": 1e-11},
    }
    d.update(overrides)
    return d


# ----------------------------------------------------------------------- cost terms


def test_linear_cost_time():
    cost = LinearCost(alpha_s=0.5, beta_s_per_byte=0.25)
    assert cost.time(0) == 0.5
    assert cost.time(8) == 2.5


def test_topk_cost_time_includes_the_log_term():
    cost = TopkCost(c0=1.0, c1=0.5, c2=0.25)
    assert cost.time(1) == 1.5  # log2(1) = 0
    assert cost.time(8) == pytest.approx(1.0 + 4.0 + 0.25 * 8 * 3)


@pytest.mark.parametrize(
    "numel, density, k",
    [
        (1, 0.001, 1),  # at least one entry
        (999, 0.001, 1),
        (1000, 0.001, 1),  # exactly one
        (1001, 0.001, 2),  # ceil
        (20_000_000, 0.001, 20_000),
        (7, 1.0, 7),
        (3, 0.5, 2),
    ],
)
def test_selected_k(numel, density, k):
    assert selected_k(numel, density) == k


# ----------------------------------------------------------------------- instances


def test_from_dict_round_trip_and_defaults():
    inst = Instance.from_dict(instance_dict())
    assert inst.num_units == 3
    assert inst.layers[1] == Unit(250_000, 0.003)
    assert inst.value_bytes == 4 and inst.index_bytes == 4
    assert inst.dense is None
    again = Instance.from_dict(inst.to_dict())
    assert again == inst
    assert "dense" not in inst.to_dict()


def test_dense_entry_round_trips_and_null_means_absent():
    inst = Instance.from_dict(instance_dict(dense={"alpha_s": 1e-3, "beta_s_per_byte": 2e-9}))
    assert inst.dense == LinearCost(1e-3, 2e-9)
    assert Instance.from_dict(inst.to_dict()) == inst
    assert Instance.from_dict(instance_dict(dense=None)).dense is None


def test_instances_are_frozen():
    inst = Instance.from_dict(instance_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        inst.density = 0.5


def _mutate(path, value):
    """instance_dict() with the entry at `path` (keys / list indices) set or deleted."""
    d = copy.deepcopy(instance_dict())
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()

BAD_INSTANCES = [
    # (path, value, field named in the error)
    (("layers",), _DELETE, "layers"),
    (("layers",), [], "layers"),
    (("layers",), "conv1", "layers"),
    (("layers", 2, "numel"), -3, "layers[2].numel"),
    (("layers", 2, "numel"), 0, "layers[2].numel"),
    (("layers", 2, "numel"), 10.5, "layers[2].numel"),
    (("layers", 2, "numel"), True, "layers[2].numel"),
    (("layers", 2, "numel"), "64", "layers[2].numel"),
    (("layers", 0, "backward_s"), -1e-3, "layers[0].backward_s"),
    (("layers", 0, "backward_s"), float("nan"), "layers[0].backward_s"),
    (("layers", 0, "backward_s"), float("inf"), "layers[0].backward_s"),
    (("layers", 0, "backward_s"), _DELETE, "layers[0].backward_s"),
    (("layers", 1), [250_000, 0.003], "layers[1]"),
    (("layers", 1, "name"), "fc", "layers[1].name"),
    (("world_size",), 0, "world_size"),
    (("world_size",), 2.0, "world_size"),
    (("density",), 0.0, "density"),
    (("density",), -0.1, "density"),
    (("density",), 1.5, "density"),
    (("density",), "0.01", "density"),
    (("forward_s",), -0.01, "forward_s"),
    (("forward_s",), None, "forward_s"),
    (("tail_s",), -0.5, "tail_s"),
    (("tail_s",), True, "tail_s"),
    (("tail_s",), float("inf"), "tail_s"),
    (("level_s",), float("nan"), "level_s"),
    (("level_s",), False, "level_s"),
    (("level_s",), "-0.1", "level_s"),
    (("comm",), _DELETE, "comm"),
    (("comm",), 0.002, "comm"),
    (("comm", "alpha_s"), -1.0, "comm.alpha_s"),
    (("comm", "beta_s_per_byte"), _DELETE, "comm.beta_s_per_byte"),
    (("topk", "c2"), -1e-12, "topk.c2"),
    (("topk", "c0"), "fast", "topk.c0"),
    (("value_bytes",), 0, "value_bytes"),
    (("index_bytes",), 4.0, "index_bytes"),
    (("dense",), {"alpha_s": -1.0, "beta_s_per_byte": 0.0}, "dense.alpha_s"),
    (("dense",), {"alpha_s": 1.0}, "dense.beta_s_per_byte"),
    (("densty",), {"alpha_s": 1.0, "beta_s_per_byte": 0.0}, "densty"),
    # integers no float holds (10**400 written out in JSON): an OverflowError before
    (("comm", "alpha_s"), 10**400, "comm.alpha_s"),
    (("world_size",), 10**400, "world_size"),
    (("layers", 0, "numel"), 2**1024, "layers[0].numel"),
    (("min_sparse_numel",), 2**1024, "min_sparse_numel"),
]


@pytest.mark.parametrize("path, value, field", BAD_INSTANCES)
def test_bad_instances_raise_naming_the_field(path, value, field):
    with pytest.raises(InstanceError) as caught:
        Instance.from_dict(_mutate(path, value))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert isinstance(caught.value, ValueError)


def test_from_dict_rejects_non_objects():
    with pytest.raises(InstanceError, match="must be an object"):
        Instance.from_dict([instance_dict()])


def test_direct_construction_is_validated_too():
    good = Instance.from_dict(instance_dict())
    with pytest.raises(InstanceError, match="^layers: must contain at least one unit"):
        dataclasses.replace(good, layers=())
    with pytest.raises(InstanceError, match=r"^layers\[1\]: must be a Unit"):
        dataclasses.replace(good, layers=(Unit(1, 0.0), (5, 0.1)))
    with pytest.raises(InstanceError, match="^density: must be in"):
        dataclasses.replace(good, density=2.0)
    with pytest.raises(InstanceError, match="^numel: must be a positive integer"):
        Unit(0, 0.1)
    with pytest.raises(InstanceError, match="^alpha_s: must be non-negative"):
        LinearCost(-1.0, 0.0)
    with pytest.raises(InstanceError, match="^c1: must be a number"):
        TopkCost(0.0, "x", 0.0)
    # a list of units is accepted and stored as a tuple
    listed = dataclasses.replace(good, layers=list(good.layers))
    assert isinstance(listed.layers, tuple) and listed == good


def test_dense_comm_time_needs_a_dense_cost():
    inst = Instance.from_dict(instance_dict())
    with pytest.raises(InstanceError, match="^dense: "):
        inst.dense_comm_time(100)


# ----------------------------------------------------------------------- timeline


def _costs(inst, numel):
    topk = inst.topk.c0 + inst.topk.c1 * numel + inst.topk.c2 * numel * math.log2(numel)
    k = max(1, math.ceil(inst.density * numel))
    comm = inst.comm.alpha_s + inst.comm.beta_s_per_byte * 8 * k
    return topk, comm


def test_simulate_follows_the_recurrence_by_hand():
    inst = Instance.from_dict(instance_dict())
    # groups [0, 1] and [2]
    topk_a, comm_a = _costs(inst, 251_000)
    topk_b, comm_b = _costs(inst, 64)
    c1 = 0.0002 + 0.003 + topk_a
    e1 = c1 + comm_a
    c2 = c1 + 0.0001 + topk_b
    e2 = max(e1, c2) + comm_b
    timeline = simulate(inst, [[0, 1], [2]])
    assert isinstance(timeline, Timeline)
    assert timeline.compute_end_s == pytest.approx(c2, rel=1e-14)
    assert timeline.comm_end_s == pytest.approx(e2, rel=1e-14)
    assert timeline.predicted_iteration_s == pytest.approx(0.01 + e2, rel=1e-14)
    assert timeline.non_overlapped_s == pytest.approx(e2 - 0.0033, rel=1e-12)


def test_tail_is_added_to_every_plan_and_round_trips():
    base = Instance.from_dict(instance_dict())
    tailed = Instance.from_dict(instance_dict(tail_s=0.25))
    assert base.tail_s == 0.0 and "tail_s" not in base.to_dict()
    assert Instance.from_dict(tailed.to_dict()) == tailed
    for groups in ([[0, 1], [2]], [[0], [1], [2]], [[0, 1, 2]]):
        a, b = simulate(base, groups), simulate(tailed, groups)
        assert b.predicted_iteration_s == pytest.approx(a.predicted_iteration_s + 0.25, rel=1e-14)
        assert b.non_overlapped_s == a.non_overlapped_s  # the tail is not exchange time


def test_the_level_is_a_constant_of_either_sign_and_round_trips():
    base = Instance.from_dict(instance_dict(tail_s=0.25))
    assert base.level_s == 0.0 and "level_s" not in base.to_dict()
    for level in (-0.125, 0.5):
        levelled = Instance.from_dict(instance_dict(tail_s=0.25, level_s=level))
        assert levelled.to_dict()["level_s"] == level
        assert Instance.from_dict(levelled.to_dict()) == levelled
        for groups in ([[0, 1], [2]], [[0], [1], [2]]):
            a, b = simulate(base, groups), simulate(levelled, groups)
            assert b.predicted_iteration_s == pytest.approx(a.predicted_iteration_s + level)
            assert (b.comm_end_s, b.non_overlapped_s) == (a.comm_end_s, a.non_overlapped_s)


def test_simulate_network_waits_for_the_previous_collective():
    # a huge alpha: the second collective queues behind the first
    inst = Instance.from_dict(instance_dict(comm={"alpha_s": 1.0, "beta_s_per_byte": 0.0}))
    timeline = simulate(inst, [[0], [1], [2]])
    c_first = 0.0002 + _costs(inst, 1000)[0]
    assert timeline.comm_end_s == pytest.approx(c_first + 3.0, rel=1e-12)


def test_simulate_dense_groups_skip_topk_and_use_the_dense_cost():
    dense = {"alpha_s": 0.001, "beta_s_per_byte": 1e-9}
    inst = Instance.from_dict(instance_dict(dense=dense))
    timeline = simulate(inst, [[0], [1, 2]], dense=[True, False])
    c1 = 0.0002
    e1 = c1 + 0.001 + 1e-9 * 4 * 1000
    topk_b, comm_b = _costs(inst, 250_064)
    c2 = c1 + 0.0031 + topk_b
    e2 = max(e1, c2) + comm_b
    assert timeline.compute_end_s == pytest.approx(c2, rel=1e-14)
    assert timeline.comm_end_s == pytest.approx(e2, rel=1e-14)
    # all flags False is the sparse model
    assert simulate(inst, [[0], [1, 2]], dense=[False, False]) == simulate(
        Instance.from_dict(instance_dict()), [[0], [1, 2]]
    )


def test_dense_bytes_follow_value_bytes():
    dense = {"alpha_s": 0.0, "beta_s_per_byte": 1.0}
    inst = Instance.from_dict(instance_dict(dense=dense, value_bytes=2))
    assert inst.dense_comm_time(10) == 20.0


@pytest.mark.parametrize(
    "groups, field",
    [
        ([], "groups"),
        ([[0, 1]], "groups"),  # unit 2 missing
        ([[0], [2], [1]], "groups[1]"),  # out of order
        ([[0, 2], [1]], "groups[0]"),  # not contiguous
        ([[0, 1], [2, 3]], "groups[1]"),  # no unit 3
        ([[0], [], [1, 2]], "groups[1]"),
        ([[0], [1.0], [2]], "groups[1]"),
        ("012", "groups"),
    ],
)
def test_simulate_rejects_malformed_groups(groups, field):
    inst = Instance.from_dict(instance_dict())
    with pytest.raises(InstanceError) as caught:
        simulate(inst, groups)
    assert caught.value.field == field


def test_simulate_rejects_bad_dense_flags():
    inst = Instance.from_dict(instance_dict())
    with pytest.raises(InstanceError, match="no dense cost"):
        simulate(inst, [[0], [1, 2]], dense=[True, False])
    with pytest.raises(InstanceError, match="2 flags for 3 groups"):
        simulate(inst, [[0], [1], [2]], dense=[False, False])
    dense_inst = Instance.from_dict(instance_dict(dense={"alpha_s": 0, "beta_s_per_byte": 0}))
    with pytest.raises(InstanceError) as caught:
        simulate(dense_inst, [[0], [1, 2]], dense=[False, "yes"])
    assert caught.value.field == "dense[1]"


def test_check_groups_normalises_to_tuples():
    assert check_groups([[0, 1], (2,)], 3) == ((0, 1), (2,))


def test_units_of_equals_the_constructor_and_names_bad_values_the_same_way():
    from dataclasses import FrozenInstanceError

    import numpy as np

    from omgs_hook.cost_model import units_of

    numels, times = [4, 1, 1000], [1e-5, 0.0, 3]
    built = units_of(numels, times)
    assert built == tuple(Unit(numel=n, backward_s=b) for n, b in zip(numels, times))
    assert all(type(u.backward_s) is float for u in built) and hash(built[0])
    with pytest.raises(FrozenInstanceError):
        built[0].numel = 5  # still frozen
    for bad_numels, bad_times, field in (([4, 0], [0.0, 0.0], "numel"),
                                         ([4, True], [0.0, 0.0], "numel"),
                                         ([4, 4], [0.0, float("nan")], "backward_s"),
                                         ([4, 4], [0.0, -1.0], "backward_s"),
                                         ([4, 4], [0.0, float("inf")], "backward_s")):
        with pytest.raises(InstanceError, match=field):
            units_of(bad_numels, bad_times)
    # other number types take the constructor's path, with its result
    assert units_of(np.array([3], dtype=np.int64).tolist(), [np.float64(0.5)]) == (
        Unit(numel=3, backward_s=0.5),)
    with pytest.raises(ValueError, match="2 sizes for 1"):
        units_of([1, 2], [0.0])


def test_scaled_lines_multiply_every_term_and_leave_the_original():
    line = LinearCost(alpha_s=2e-4, beta_s_per_byte=3e-9)
    doubled = line.scaled(2.5)
    assert (doubled.alpha_s, doubled.beta_s_per_byte) == (2e-4 * 2.5, 3e-9 * 2.5)
    assert doubled.time(1000) == pytest.approx(2.5 * line.time(1000))
    assert line == LinearCost(alpha_s=2e-4, beta_s_per_byte=3e-9)
    topk = TopkCost(c0=1e-4, c1=2e-9, c2=3e-11)
    tripled = topk.scaled(3.0)
    assert (tripled.c0, tripled.c1, tripled.c2) == (1e-4 * 3.0, 2e-9 * 3.0, 3e-11 * 3.0)
    assert tripled.time(50_000) == pytest.approx(3.0 * topk.time(50_000))
