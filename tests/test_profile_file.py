"""Profile files: loading, validation errors naming the problem, defaults, mismatches."""

import copy
import json

import pytest

from omgs_hook.cost_model import Instance, LinearCost, TopkCost, Unit, simulate
from omgs_hook.profile_file import (
    SCHEMA_VERSION,
    Profile,
    ProfileError,
    default_profile,
    load_profile,
    profile_bandwidth_gaps,
    profile_from_dict,
    profile_mismatches,
    unmeasured_bandwidth,
)

VALID = {
    "schema_version": SCHEMA_VERSION,
    "created": "2025-01-01T00:00:00+00:00",
    "world_size": 2,
    "backend": "gloo",
    "device": "cpu",
    "device_name": "cpu",
    "torch_version": "2.13.0+cpu",
    "cupy_version": None,
    "comm": {"alpha_s": 2.4e-4, "beta_s_per_byte": 1.1e-9},
    "dense": {"alpha_s": 2.6e-4, "beta_s_per_byte": 6e-10},
    "topk": {"backend": "sampled", "c0": 1e-5, "c1": 2e-9, "c2": 0.0},
    "topk_all": {"sampled": {"c0": 1e-5, "c1": 2e-9, "c2": 0.0},
                 "torch": {"c0": 2e-5, "c1": 1e-9, "c2": 1e-10}},
    "settings": {"topk_density": 0.001},
}


def _write(tmp_path, document, name="profile.json"):
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def test_load_valid_profile(tmp_path):
    path = _write(tmp_path, VALID)
    profile = load_profile(path)
    assert isinstance(profile, Profile)
    assert profile.comm == LinearCost(alpha_s=2.4e-4, beta_s_per_byte=1.1e-9)
    assert profile.dense == LinearCost(alpha_s=2.6e-4, beta_s_per_byte=6e-10)
    assert profile.topk == TopkCost(c0=1e-5, c1=2e-9, c2=0.0)
    assert profile.topk_backend == "sampled"
    assert (profile.world_size, profile.backend, profile.device_type) == (2, "gloo", "cpu")
    assert profile.path == str(path)
    assert profile.topk_density == 0.001
    assert profile.topk_for("torch") == TopkCost(c0=2e-5, c1=1e-9, c2=1e-10)
    # an unmeasured backend falls back to the default one
    assert profile.topk_for("cupy") == profile.topk


def test_a_bytes_path_loads(tmp_path):
    """OMGSState(profile=...) takes str, bytes and path-like paths: a bytes one was
    read from the file "b'...'" ("profile file not found")."""
    path = _write(tmp_path, VALID)
    profile = load_profile(bytes(path))
    assert profile.path == str(path) and profile.world_size == 2


def test_minimal_profile_without_optional_sections(tmp_path):
    document = {key: VALID[key] for key in
                ("schema_version", "world_size", "backend", "device", "comm", "dense", "topk")}
    profile = load_profile(_write(tmp_path, document))
    assert profile.topk_all == {"sampled": profile.topk}
    assert profile.topk_density is None


def test_profile_costs_drive_the_planner():
    profile = profile_from_dict(VALID)
    inst = Instance(layers=(Unit(1_000_000, 1e-3),), world_size=profile.world_size, density=0.01,
                    forward_s=0.0, comm=profile.comm, topk=profile.topk, dense=profile.dense)
    timeline = simulate(inst, [[0]])
    k = 10_000
    expected = 1e-3 + profile.topk.time(1_000_000) + profile.comm.time(8 * k)
    assert timeline.predicted_iteration_s == pytest.approx(expected)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.json")


def test_not_json(tmp_path):
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(_write(tmp_path, "{not json"))


def test_not_an_object(tmp_path):
    with pytest.raises(ProfileError, match="JSON object"):
        load_profile(_write(tmp_path, "[1, 2]"))


def test_a_directory_is_not_readable(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path)


def _mutate(path_keys, value):
    document = copy.deepcopy(VALID)
    target = document
    for key in path_keys[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path_keys[-1]]
    else:
        target[path_keys[-1]] = value
    return document


_DELETE = object()


@pytest.mark.parametrize("keys, value, field, message", [
    (("schema_version",), 2, "schema_version", "unsupported version 2"),
    (("schema_version",), "1", "schema_version", "unsupported"),
    (("schema_version",), True, "schema_version", "unsupported"),
    (("schema_version",), _DELETE, "schema_version", "missing"),
    (("world_size",), 0, "world_size", "positive integer"),
    (("world_size",), 2.0, "world_size", "positive integer"),
    (("world_size",), _DELETE, "world_size", "missing"),
    (("backend",), "", "backend", "non-empty string"),
    (("device",), _DELETE, "device", "missing"),
    (("comm",), _DELETE, "comm", "missing"),
    (("comm",), [1, 2], "comm", "must be an object"),
    (("comm", "alpha_s"), -1e-4, "comm.alpha_s", "non-negative"),
    (("comm", "beta_s_per_byte"), _DELETE, "comm.beta_s_per_byte", "missing"),
    (("dense", "alpha_s"), "fast", "dense.alpha_s", "must be a number"),
    (("dense", "beta_s_per_byte"), float("inf"), "dense.beta_s_per_byte", "finite"),
    (("topk", "backend"), _DELETE, "topk.backend", "missing"),
    (("topk", "c2"), -1.0, "topk.c2", "non-negative"),
    (("topk", "c0"), True, "topk.c0", "must be a number"),
    (("topk_all", "torch", "c1"), -3.0, "topk_all.torch.c1", "non-negative"),
    (("topk_all", "torch"), 5, "topk_all.torch", "must be an object"),
    (("settings", "topk_density"), 2.0, "settings.topk_density", r"\(0, 1\]"),
    # finite, but pricing anything at inf: the planner would compare inf and NaN
    (("comm", "beta_s_per_byte"), 1e308, "comm", "beyond any physical range"),
    (("topk", "c1"), 1e300, "topk", "beyond any physical range"),
    (("topk_all", "torch", "c2"), 1e299, "topk_all.torch", "beyond any physical range"),
])
def test_bad_fields_are_named(tmp_path, keys, value, field, message):
    path = _write(tmp_path, _mutate(keys, value))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert info.value.field == field
    assert str(info.value).startswith(f"{path}: {field}: ")
    assert isinstance(info.value, ValueError)


def test_mismatches_empty_when_matching():
    profile = profile_from_dict(VALID)
    assert profile_mismatches(profile, 2, "gloo", "cpu") == []
    assert profile_mismatches(profile, 2, "GLOO", "cpu") == []


def test_mismatches_name_every_difference():
    profile = profile_from_dict(VALID)
    problems = profile_mismatches(profile, 4, "nccl", "cuda")
    assert len(problems) == 3
    assert "world_size=2" in problems[0] and "world_size=4" in problems[0]
    assert "'gloo'" in problems[1] and "'nccl'" in problems[1]
    assert "'cpu'" in problems[2] and "'cuda'" in problems[2]
    assert profile_mismatches(profile, 8, "gloo", "cpu") == [problems[0].replace("=4", "=8")]


def test_a_per_byte_cost_fitted_as_zero_is_named_with_its_collective():
    # a sweep that stopped at latency-bound sizes: the all-reduce's bytes look free
    assert profile_bandwidth_gaps(profile_from_dict(VALID)) == []
    data = copy.deepcopy(VALID)
    data["dense"]["beta_s_per_byte"] = 0.0
    gaps = profile_bandwidth_gaps(profile_from_dict(data, "p.json"))
    assert len(gaps) == 1
    assert gaps[0].startswith("p.json: the all-reduce (dense groups) cost per byte ('dense') "
                              "was fitted as 0")
    assert "--sizes" in gaps[0]
    data["comm"]["beta_s_per_byte"] = 0.0
    gaps = profile_bandwidth_gaps(profile_from_dict(data, "p.json"))
    assert [g.split("(")[0] for g in gaps] == ["p.json: the packed all-gather ",
                                               "p.json: the all-reduce "]
    # the same rule on the raw fits omgs-profile prints; absent collectives are skipped
    assert unmeasured_bandwidth({"inter": 0.0, "intra": 1e-9, "dense": None}, "x") == [
        unmeasured_bandwidth({"inter": 0.0}, "x")[0]]
    assert "inter-node sparse all-gather" in unmeasured_bandwidth({"inter": 0.0}, "x")[0]


@pytest.mark.parametrize("device_type, backend, topk_backend", [
    ("cpu", "gloo", "sampled"),
    ("cuda", "nccl", "cupy"),
])
def test_default_profiles(device_type, backend, topk_backend):
    profile = default_profile(device_type)
    assert profile.backend == backend and profile.device_type == device_type
    assert profile.topk_backend == topk_backend
    assert profile.path is None and profile.world_size == 2
    assert profile_mismatches(profile, 2, backend, device_type) == []
    for cost in (profile.comm, profile.dense):
        assert cost.alpha_s > 0 and cost.beta_s_per_byte > 0
    assert profile.topk.c0 > 0
    # usable by the planner as is
    Instance(layers=(Unit(1000, 1e-4),), world_size=2, density=0.01, forward_s=0.0,
             comm=profile.comm, topk=profile.topk, dense=profile.dense)


def test_default_cpu_profile_models_one_gigabit_ethernet():
    profile = default_profile("cpu", world_size=2)
    # 8 MB contributed by each of 2 ranks: one ring step at ~117 MB/s plus start-up
    assert profile.comm.time(8e6) == pytest.approx(0.3e-3 + 8e6 / 117e6)
    # all-reduce of 8 MB over 2 ranks moves 2 * (1/2) of the tensor per rank
    assert profile.dense.time(8e6) == pytest.approx(0.6e-3 + 8e6 / 117e6)


def test_default_profile_scales_with_world_size():
    two, eight = default_profile("cpu", world_size=2), default_profile("cpu", world_size=8)
    assert eight.world_size == 8
    assert eight.comm.alpha_s == pytest.approx(7 * two.comm.alpha_s)
    assert eight.comm.beta_s_per_byte == pytest.approx(7 * two.comm.beta_s_per_byte)
    # ring all-reduce volume per rank saturates at 2x the tensor
    assert eight.dense.beta_s_per_byte == pytest.approx(2 * 7 / 8 / 117e6)
    assert default_profile("cpu", world_size=1).comm.alpha_s == 0.0


@pytest.mark.parametrize("args, problem", [
    (("tpu",), "device_type"),
    (("cpu", 0), "world_size"),
    (("cpu", True), "world_size"),
])
def test_default_profile_rejects_bad_arguments(args, problem):
    with pytest.raises(ValueError, match=problem):
        default_profile(*args)


# ------------------------------------------------------------ two link classes


TWO_LEVEL = dict(copy.deepcopy(VALID), world_size=4, ranks_per_node=2,
                 intra={"alpha_s": 2e-5, "beta_s_per_byte": 1e-11},
                 inter={"alpha_s": 3e-4, "beta_s_per_byte": 8e-9})


def test_two_level_profile_loads_and_gives_a_hierarchy(tmp_path):
    from omgs_hook.cost_model import Hierarchy, hierarchical_instance

    profile = load_profile(_write(tmp_path, TWO_LEVEL))
    assert profile.ranks_per_node == 2
    assert profile.intra == LinearCost(2e-5, 1e-11)
    assert profile.inter == LinearCost(3e-4, 8e-9)
    assert profile.hierarchy() == Hierarchy(2, LinearCost(2e-5, 1e-11), LinearCost(3e-4, 8e-9))
    flat = Instance((Unit(1000, 1e-3),), 4, 0.01, 0.0, profile.comm, profile.topk)
    h = profile.hierarchy()
    inst = hierarchical_instance(flat, h.ranks_per_node, h.intra, h.inter)
    assert simulate(inst, [[0]]) != simulate(flat, [[0]])


def test_flat_profile_has_no_hierarchy(tmp_path):
    profile = load_profile(_write(tmp_path, VALID))
    assert profile.ranks_per_node is None and profile.hierarchy() is None
    assert default_profile("cpu", 4).hierarchy() is None


@pytest.mark.parametrize("changes, field, message", [
    ({"inter": None}, "inter", "missing (a two-level profile needs all of"),
    ({"ranks_per_node": None}, "ranks_per_node", "missing"),
    ({"ranks_per_node": 3}, "ranks_per_node", "not divisible"),
    ({"ranks_per_node": 1}, "ranks_per_node", "integer >= 2"),
    ({"ranks_per_node": True}, "ranks_per_node", "integer >= 2"),
    ({"intra": {"alpha_s": -1, "beta_s_per_byte": 0}}, "intra.alpha_s", "non-negative"),
    ({"inter": [1, 2]}, "inter", "must be an object"),
])
def test_bad_two_level_fields_are_named(tmp_path, changes, field, message):
    document = dict(copy.deepcopy(TWO_LEVEL), **changes)
    document = {k: v for k, v in document.items() if v is not None}
    with pytest.raises(ProfileError) as info:
        load_profile(_write(tmp_path, document))
    assert info.value.field == field
    assert message in str(info.value)


# ------------------------------------------------------------ inter_dense


INTER_DENSE = {"alpha_s": 5e-4, "beta_s_per_byte": 3e-8}


def test_inter_dense_round_trips_and_prices_dense_groups(tmp_path):
    from omgs_hook.cost_model import Hierarchy, hierarchical_instance

    document = dict(copy.deepcopy(TWO_LEVEL), inter_dense=dict(INTER_DENSE))
    profile = load_profile(_write(tmp_path, document))
    assert profile.inter_dense == LinearCost(**INTER_DENSE)
    h = profile.hierarchy()
    assert h.inter_dense == LinearCost(**INTER_DENSE)
    assert Hierarchy.from_dict(h.to_dict()) == h  # and back through the instance format
    assert h.to_dict()["inter_dense"] == INTER_DENSE
    # a two-level instance built from it prices a dense group's inter-node all-reduce of
    # its shard (S = 500 of D = 1000, 4 bytes each) by inter_dense, not the flat dense
    flat = Instance((Unit(1000, 1e-3),), 4, 0.01, 0.0, profile.comm, profile.topk,
                    dense=profile.dense)
    inst = hierarchical_instance(flat, h.ranks_per_node, h.intra, h.inter, h.inter_dense)
    assert inst.inter_dense_cost() == LinearCost(**INTER_DENSE)
    assert inst.inter_allreduce_time(1000) == pytest.approx(5e-4 + 3e-8 * 4 * 500, rel=1e-12)
    derived = hierarchical_instance(flat, h.ranks_per_node, h.intra, h.inter)
    assert derived.inter_dense_cost() != inst.inter_dense_cost()
    expected = (1e-3 + profile.intra.time(2000) + LinearCost(**INTER_DENSE).time(2000)
                + profile.intra.time(2000))
    assert simulate(inst, [[0]], [True]).comm_end_s == pytest.approx(expected, rel=1e-12)
    assert simulate(derived, [[0]], [True]).comm_end_s != pytest.approx(expected, rel=1e-6)


def test_two_level_profile_without_inter_dense_still_loads(tmp_path):
    profile = load_profile(_write(tmp_path, TWO_LEVEL))
    assert profile.inter_dense is None and profile.hierarchy().inter_dense is None


@pytest.mark.parametrize("changes, field, message", [
    ({"inter_dense": {"alpha_s": -1, "beta_s_per_byte": 0}}, "inter_dense.alpha_s",
     "non-negative"),
    ({"inter_dense": {"alpha_s": 1e-4}}, "inter_dense.beta_s_per_byte", "missing"),
    ({"inter_dense": {"alpha_s": 1e-4, "beta_s_per_byte": "fast"}},
     "inter_dense.beta_s_per_byte", "must be a number"),
    ({"inter_dense": {"alpha_s": float("inf"), "beta_s_per_byte": 0}}, "inter_dense.alpha_s",
     "finite"),
    ({"inter_dense": [1, 2]}, "inter_dense", "must be an object"),
    # without the two link classes it has nothing to belong to
    ({"ranks_per_node": None, "intra": None, "inter": None}, "inter_dense",
     "needs the two link classes"),
])
def test_bad_inter_dense_is_named(tmp_path, changes, field, message):
    document = dict(copy.deepcopy(TWO_LEVEL), inter_dense=dict(INTER_DENSE))
    document.update(changes)
    document = {k: v for k, v in document.items() if v is not None}
    with pytest.raises(ProfileError) as info:
        profile_from_dict(json.loads(json.dumps(document, allow_nan=True)), "p.json")
    assert info.value.field == field
    assert message in str(info.value) and field in str(info.value)


BIG = "1" + "0" * 400  # 10**400: an integer no float holds


@pytest.mark.parametrize("keys, field", [
    (("comm", "alpha_s"), "comm.alpha_s"),
    (("dense", "beta_s_per_byte"), "dense.beta_s_per_byte"),
    (("topk", "c1"), "topk.c1"),
    (("topk_all", "torch", "c0"), "topk_all.torch.c0"),
    (("settings", "topk_density"), "settings.topk_density"),
])
def test_a_huge_json_integer_is_a_profile_error(tmp_path, keys, field):
    text = json.dumps(_mutate(keys, "@BIG@")).replace('"@BIG@"', BIG)
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as info:  # was OverflowError
        load_profile(path)
    assert info.value.field == field
    assert str(info.value).startswith(f"{path}: {field}: ")
    assert "an integer of 1329 bits" in str(info.value)  # not 401 digits


def test_an_integer_beyond_pythons_digit_limit_is_a_profile_error(tmp_path):
    text = json.dumps(VALID).replace("0.001", "1" + "0" * 5000)
    with pytest.raises(ProfileError, match="not a usable profile: .*4300 digits"):
        load_profile(_write(tmp_path, text))


def test_mismatches_compare_the_top_k_density():
    profile = profile_from_dict(VALID)  # timed at density 0.001
    problems = profile_mismatches(profile, 2, "gloo", "cpu", density=0.01)
    assert len(problems) == 1
    assert "density 0.001" in problems[0] and "density 0.01 " in problems[0]
    assert problems[0].endswith("run omgs-profile --density 0.01")
    assert len(profile_mismatches(profile, 2, "gloo", "cpu", density=0.0004)) == 1
    # within a factor of 2 either way, unknown, or dense (no top-k at all): nothing to say
    for density in (0.002, 0.0005, 0.001, None, 1.0):
        assert profile_mismatches(profile, 2, "gloo", "cpu", density=density) == []
    unknown = profile_from_dict({k: v for k, v in VALID.items() if k != "settings"})
    assert profile_mismatches(unknown, 2, "gloo", "cpu", density=0.01) == []
    # with the other differences, after them
    assert "density" in profile_mismatches(profile, 4, "nccl", "cuda", density=0.1)[3]
