"""Tests for scripts/simulate.py, scripts/make_layer_profiles.py and the shipped profiles."""

import json
import math
import sys

import pytest
from script_loader import load_script

from omgs_hook.cost_model import Instance, LinearCost, selected_k





simulate = load_script("simulate")

PUBLISHED_NUMEL = {"resnet50": 25_557_032, "vgg16": 138_357_544, "inception_v3": 23_834_568}
FIRST_READY = {"resnet50": "fc", "vgg16": "classifier.6", "inception_v3": "fc"}


# --------------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", simulate.MODEL_NAMES)
def test_shipped_profiles_load_as_valid_instances(name):
    profile = simulate.load_layer_profile(name)
    layers = profile["layers"]
    assert profile["model"] == name
    assert sum(layer["numel"] for layer in layers) == profile["total_numel"]
    assert profile["total_numel"] == PUBLISHED_NUMEL[name]
    assert layers[0]["name"] == FIRST_READY[name]  # gradient-ready order: classifier first
    assert all(layer["backward_s"] > 0 for layer in layers)
    assert math.isclose(sum(layer["backward_s"] for layer in layers), profile["backward_s"],
                        rel_tol=1e-6)
    # backward costs about twice the forward pass (roofline model, memory-bound ops included)
    assert 1.5 < profile["backward_s"] / profile["forward_s"] < 2.2
    inst = simulate.build_instance(profile, 16)
    assert inst.num_units == len(layers) and inst.world_size == 16
    assert Instance.from_dict(inst.to_dict()) == inst
    dense = simulate.build_instance(profile, 16, with_dense=True)
    assert dense.dense == simulate.NetworkModel().allreduce(16)


def test_shipped_profiles_are_what_the_generator_produces(capsys):
    generator = load_script("make_layer_profiles")
    assert generator.main(["--check"]) == 0, capsys.readouterr().err


def test_generator_check_detects_a_stale_profile(tmp_path, capsys):
    generator = load_script("make_layer_profiles")
    assert generator.main(["--out", str(tmp_path), "vgg16"]) == 0
    path = tmp_path / "vgg16.json"
    profile = json.loads(path.read_text())
    profile["layers"][3]["numel"] += 1
    path.write_text(json.dumps(profile))
    assert generator.main(["--out", str(tmp_path), "--check", "vgg16"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_bad_profiles_and_options_raise_clear_errors(tmp_path):
    with pytest.raises(simulate.SimulationError, match="unknown model 'alexnet'.*resnet50"):
        simulate.load_layer_profile("alexnet")
    with pytest.raises(simulate.SimulationError, match="file not found"):
        simulate.load_layer_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x", "forward_s": 0.1,
                               "layers": [{"numel": 10, "backward_s": 0.1},
                                          {"numel": -3, "backward_s": 0.1}]}))
    with pytest.raises(simulate.SimulationError, match=r"layers\[1\]\.numel"):
        simulate.load_layer_profile(str(bad))
    bad.write_text("{not json")
    with pytest.raises(simulate.SimulationError, match="not valid JSON"):
        simulate.load_layer_profile(str(bad))
    with pytest.raises(simulate.SimulationError, match="world size"):
        simulate.NetworkModel().allgather(1)
    with pytest.raises(simulate.SimulationError, match="density"):
        simulate.run(["vgg16"], [4], density=0.0)
    with pytest.raises(simulate.SimulationError, match="bandwidth"):
        simulate.NetworkModel(bandwidth_bps=0)


# ------------------------------------------------------------------ cluster model


def test_ring_collective_costs_follow_the_stated_formulas():
    net = simulate.NetworkModel(bandwidth_bps=1e9, alpha0_s=100e-6)
    beta0 = 8 / (1e9 * 1448 / 1538)
    assert math.isclose(net.beta0_s_per_byte, beta0)
    assert net.allgather(2) == LinearCost(100e-6, beta0)
    gather = net.allgather(16)
    assert math.isclose(gather.alpha_s, 15 * 100e-6) and math.isclose(gather.beta_s_per_byte,
                                                                      15 * beta0)
    reduce = net.allreduce(16)
    assert math.isclose(reduce.alpha_s, 30 * 100e-6)
    assert math.isclose(reduce.beta_s_per_byte, 30 / 16 * beta0)
    # 1 GbE, 16 workers, ResNet-50 dense: about 1.6 s (the ratio quoted in the docs)
    assert 1.5 < reduce.time(4 * PUBLISHED_NUMEL["resnet50"]) < 1.75


def test_ddp_bucket_groups_cover_every_layer_in_order_within_the_cap():
    inst = simulate.build_instance(simulate.load_layer_profile("vgg16"), 4)
    groups = simulate.ddp_bucket_groups(inst, bucket_bytes=25 * 2 ** 20)
    assert [u for g in groups for u in g] == list(range(inst.num_units))
    for group in groups:
        nbytes = sum(4 * inst.layers[u].numel for u in group)
        assert nbytes <= 25 * 2 ** 20 or len(group) == 1  # the 411 MB FC layer stands alone


# -------------------------------------------------------------------- simulation


def test_small_simulation_is_consistent():
    profiles, rows = simulate.run(["vgg16", "resnet50"], [4, 16])
    table = {(r["model"], r["world_size"], r["strategy"]): r for r in rows}
    assert len(rows) == 2 * 2 * 6
    for model, profile in profiles.items():
        units = len(profile["layers"])
        for w in (4, 16):
            best = table[(model, w, "optimal")]
            for other in ("single", "layerwise", "greedy", "dense"):
                assert best["iteration_s"] <= table[(model, w, other)]["iteration_s"] * (1 + 1e-9)
            # nothing beats computing alone; the optimum over sparse AND dense modes
            # beats every all-sparse plan and DDP's all-dense buckets
            assert best["iteration_s"] >= best["compute_s"] * (1 - 1e-9)
            hybrid = table[(model, w, "optimal+dense")]["iteration_s"]
            assert hybrid <= table[(model, w, "dense")]["iteration_s"] * (1 + 1e-9)
            assert hybrid <= best["iteration_s"] * (1 + 1e-9)
            assert table[(model, w, "single")]["groups"] == 1
            assert table[(model, w, "layerwise")]["groups"] == units
            # TopK-SGD by hand: backward, one top-k, one all-gather of k values + indices
            numel = profile["total_numel"]
            net = simulate.NetworkModel()
            by_hand = (best["compute_s"] + simulate.DEFAULT_TOPK.time(numel)
                       + net.allgather(w).time(8 * selected_k(numel, simulate.DEFAULT_DENSITY)))
            assert math.isclose(table[(model, w, "single")]["iteration_s"], by_hand,
                                rel_tol=1e-9)
        # on 1 GbE at 16 workers sparsification must beat dense all-reduce by far
        assert table[(model, 16, "dense")]["iteration_s"] > 3 * table[(model, 16, "optimal")][
            "iteration_s"]


def test_cli_writes_table_json_plot_and_updates_the_doc(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{simulate.DOC_BEGIN}\nold table\n{simulate.DOC_END}\noutro\n")
    out_json, out_md, out_png = tmp_path / "r.json", tmp_path / "t.md", tmp_path / "p.png"
    code = simulate.main(["--models", "vgg16", "--world-sizes", "2", "16", "--json", str(out_json),
                          "--markdown", str(out_md), "--plot", str(out_png),
                          "--update-doc", str(doc)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "The paper's setting: 16 workers" in printed and "| vgg16 |" in printed
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"optimal", "greedy", "layerwise", "single", "dense",
                                             "optimal+dense"}
    assert out_md.read_text().strip() == printed.strip()
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert "TopK-SGD (single)" in text
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_bad_input(capsys):
    assert simulate.main(["--models", "alexnet"]) == 2
    assert "unknown model 'alexnet'" in capsys.readouterr().err
    assert simulate.main(["--world-sizes", "1"]) == 2
    assert "world size must be an integer >= 2" in capsys.readouterr().err


# ------------------------------------------------------------- two-level topology


def test_topology_collective_costs_follow_the_stated_formulas():
    net = simulate.NetworkModel(bandwidth_bps=25e9, alpha0_s=50e-6)
    topo = simulate.TopologyModel(16, 8, net, intra_alpha_s=10e-6, intra_bandwidth_Bps=150e9)
    assert topo.world_size == 128
    assert topo.flat_allgather() == net.allgather(128)
    inter = topo.inter_allgather()
    assert math.isclose(inter.alpha_s, 15 * 50e-6)
    assert math.isclose(inter.beta_s_per_byte, 15 * 8 * net.beta0_s_per_byte)
    intra = topo.intra_collective()
    assert intra.alpha_s == 10e-6 and math.isclose(intra.beta_s_per_byte, 7 / 150e9)
    # the shared NIC: the node's 8 concurrent inter-node all-gathers of m/8 bytes take
    # as long on the wire as one flat all-gather of m among 16 single-GPU nodes
    m = 1e6
    assert math.isclose(inter.time(m / 8) - inter.alpha_s, net.allgather(16).time(m)
                        - net.allgather(16).alpha_s)
    with pytest.raises(simulate.SimulationError, match="ranks_per_node"):
        simulate.TopologyModel(16, 1)
    assert simulate.parse_topology("16x8") == (16, 8)
    with pytest.raises(simulate.SimulationError, match="NODESxRANKS"):
        simulate.parse_topology("16-8")


def test_topology_instances_and_row_are_consistent():
    from omgs_hook.planner import make_plan

    profile = simulate.load_layer_profile("resnet50")
    topo = simulate.TopologyModel(4, 4)
    flat, two_level = simulate.build_topology_instances(profile, topo)
    assert flat.hierarchy is None and two_level.hierarchy.ranks_per_node == 4
    assert two_level.hierarchy.inter == topo.inter_allgather()
    assert flat.comm == two_level.comm == topo.flat_allgather()
    row = simulate.simulate_topology(profile, topo)
    assert row["flat_s"] == make_plan(flat).predicted_iteration_s
    assert row["hierarchical_s"] == make_plan(two_level).predicted_iteration_s
    assert math.isclose(row["speedup"], row["flat_s"] / row["hierarchical_s"])
    # both plans hide at most the compute; inter-node bytes are cut by about L * L
    # (count: each payload per remote rank) and the NIC's bytes by about L
    assert row["hierarchical_s"] >= row["compute_s"] * (1 - 1e-9)
    assert 12 < row["flat_inter_node_bytes"] / row["hierarchical_inter_node_bytes"] <= 16 * 1.01
    assert 4 < row["flat_nic_bytes"] / row["hierarchical_nic_bytes"] < 6


def test_two_level_beats_flat_at_16x8_on_1_gbe_and_never_loses():
    rows = simulate.run_topology(["resnet50", "vgg16"], (16, 8), (1.0, 25.0))
    assert len(rows) == 4
    for row in rows:
        assert row["hierarchical_s"] <= row["flat_s"]
        if row["inter_gbit"] == 1.0:
            assert row["speedup"] > 1.2  # the flat all-gather is far beyond 20% of backward
            assert row["flat_allgather_share_of_backward"] > 0.2


def test_topology_cli_updates_its_own_markers(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"a\n{simulate.DOC_BEGIN}\nkeep\n{simulate.DOC_END}\n"
                   f"{simulate.TOPOLOGY_BEGIN}\nSTALE\n{simulate.TOPOLOGY_END}\nz\n")
    out_json = tmp_path / "t.json"
    code = simulate.main(["--topology", "4x2", "--models", "vgg16", "--inter-gbit", "1",
                          "--update-doc", str(doc), "--json", str(out_json)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| vgg16 | 1 GbE |" in printed
    text = doc.read_text()
    assert "keep" in text and "STALE" not in text and "| vgg16 | 1 GbE |" in text
    assert json.loads(out_json.read_text())["topology"] == [4, 2]
    assert simulate.main(["--topology", "4", "--models", "vgg16"]) == 2
    assert "NODESxRANKS" in capsys.readouterr().err
    assert simulate.main(["--topology", "4x2", "--inter-gbit", "0"]) == 2
    assert "bandwidth" in capsys.readouterr().err
