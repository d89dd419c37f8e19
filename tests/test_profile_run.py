"""omgs-profile end to end: real gloo ranks under torchrun write a loadable profile and a PNG."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from omgs_hook import profile_run
from omgs_hook.cost_model import Hierarchy, Instance, Unit, hierarchical_instance
from omgs_hook.profile_file import SCHEMA_VERSION, load_profile, profile_mismatches
from omgs_hook.topk import available_backends, get_selector

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile.py"
CONSOLE_SCRIPT = Path(sys.executable).parent / "omgs-profile"
LAUNCH_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _clean_env():
    """The test process's environment without any launcher variables."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


def _run(command, cwd):
    result = subprocess.run(command, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *args]


def _check_collective(document, name, key, reps):
    """One collective section ``name`` of the sweep, and its fit ``key`` unless None."""
    sweep = document["sweep"]
    sizes = document["settings"]["sizes_bytes"]
    rows = document["samples"][name]
    record = sweep["sections"][name]
    # the measured sizes are a prefix of the planned ones, as recorded
    assert record["planned"] == sizes
    assert [r["bytes"] for r in rows] == record["measured"] == sizes[:len(rows)]
    assert [len(r["seconds"]) for r in rows] == record["reps"]
    if reps is not None:
        assert record["reps"] == [reps] * len(rows)
    assert all(min(r["seconds"]) > 0 for r in rows)
    if key is None:
        return
    assert [p["bytes"] for p in document["fit_errors"][key]] == record["measured"]
    assert set(document[key]) == {"alpha_s", "beta_s_per_byte"}
    # a collective costs something: the fitted line is positive at every size
    line = document[key]
    assert all(line["alpha_s"] + line["beta_s_per_byte"] * s > 0 for s in sizes)
    # the reported errors are those of the written fit against the median samples
    for row, point in zip(rows, document["fit_errors"][key]):
        assert point["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        predicted = line["alpha_s"] + line["beta_s_per_byte"] * row["bytes"]
        assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)


def _check_document(document, world_size, reps=None):
    """Everything a written profile must satisfy; ``reps`` = the fixed reps, or None (adaptive)."""
    cpu = torch.device("cpu")
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["world_size"] == world_size
    assert (document["backend"], document["device"]) == ("gloo", "cpu")
    assert document["torch_version"] == torch.__version__
    assert "cupy_version" in document
    assert document["created"].endswith("+00:00")
    # the default top-k backend is the one the hook picks on this device
    assert document["topk"]["backend"] == get_selector("auto", cpu).name
    sweep = document["sweep"]
    for name, key in (("all_gather", "comm"), ("all_reduce", "dense")):
        _check_collective(document, name, key, reps)
    if "intra" in document:  # a multi-GPU-node profile: its link sections (fits: below)
        for name in profile_run.LINK_SECTIONS:
            _check_collective(document, name, None, reps)
    for backend, rows in document["samples"]["topk"].items():
        record = sweep["sections"][f"topk:{backend}"]
        assert [r["numel"] for r in rows] == record["measured"]
        assert record["planned"] == document["settings"]["topk_numel"]
        assert [len(r["seconds"]) for r in rows] == record["reps"]
        if reps is not None:
            assert record["reps"] == [reps] * len(rows)
        assert len(document["fit_errors"]["topk"][backend]) == len(rows)
        c = document["topk_all"][backend]
        assert min(c[name] for name in ("c0", "c1", "c2")) >= 0
        assert c["form"] in ("linear", "n log n")
        for row, point in zip(rows, document["fit_errors"]["topk"][backend]):
            d = row["numel"]
            assert row["k"] == max(1, math.ceil(document["settings"]["topk_density"] * d))
            predicted = c["c0"] + c["c1"] * d + c["c2"] * d * math.log2(d)
            assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)
    # every truncated part says where and why it stopped
    for name, record in sweep["sections"].items():
        assert (name in sweep["truncated"]) == (not record["complete"])
        if not record["complete"]:
            assert record["stopped_before"] == record["planned"][len(record["measured"])]
            assert record["reason"] in ("budget", "probe") and record["message"]


# the keys of a flat profile (one node, or one rank per node): exactly those written before
# the two link classes existed
FLAT_KEYS = {"schema_version", "created", "world_size", "backend", "device", "device_name",
             "torch_version", "cupy_version", "comm", "dense", "topk", "topk_all", "settings",
             "sweep", "fit_errors", "samples"}


def _check_flat(document):
    assert set(document) == FLAT_KEYS
    assert set(document["samples"]) == {"all_gather", "all_reduce", "topk"}
    assert set(document["fit_errors"]) == {"comm", "dense", "topk"}
    assert not set(document["sweep"]["sections"]) & set(profile_run.LINK_SECTIONS)


@pytest.mark.multiprocess
def test_two_rank_quick_profile_via_torchrun(tmp_path):
    out = tmp_path / "profile.json"
    result = _run(_torchrun(2, str(SCRIPT), "--quick", "--out", str(out)), cwd=tmp_path)
    document = json.loads(out.read_text())
    _check_document(document, world_size=2, reps=profile_run.QUICK_REPS)
    _check_flat(document)  # LOCAL_WORLD_SIZE=2: one node
    assert document["settings"]["sizes_bytes"] == list(profile_run.QUICK_SIZES)
    # --quick keeps its fixed sweep: no budget, every size measured
    assert document["sweep"]["time_budget_s"] is None and document["sweep"]["truncated"] == []
    assert sorted(document["topk_all"]) == sorted(available_backends(torch.device("cpu")))

    profile = load_profile(out)
    assert profile.world_size == 2 and profile.path == str(out)
    assert profile.comm.alpha_s == document["comm"]["alpha_s"]
    assert profile.topk_backend == document["topk"]["backend"]
    assert profile_mismatches(profile, 2, "gloo", "cpu") == []

    png = tmp_path / "profile.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    assert "alpha =" in result.stdout and str(out) in result.stdout
    # one progress bar (rank 0 only): its first render, before any postfix, appears once
    assert result.stderr.count("?point/s]") == 1


@pytest.mark.multiprocess
def test_four_rank_console_script_with_custom_sweep(tmp_path):
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    out = tmp_path / "sub" / "p4.json"
    _run(_torchrun(4, "--no-python", str(CONSOLE_SCRIPT), "--out", str(out), "--no-plot",
                   "--sizes", "1K,20000,64K", "--topk-sizes", "1e3,5000,2e4",
                   "--topk-backends", "torch", "--reps", "2", "--warmup", "0", "--no-progress"),
         cwd=tmp_path)
    document = json.loads(out.read_text())
    assert document["world_size"] == 4
    # sizes are rounded up to whole 8-byte packed entries
    assert document["settings"]["sizes_bytes"] == [1024, 20000, 65536]
    assert list(document["topk_all"]) == ["torch"]
    assert document["topk"]["backend"] == "torch"  # auto's choice was not measured
    assert not list(out.parent.glob("*.png"))
    assert load_profile(out).world_size == 4
    # one node of 4 ranks (torchrun's LOCAL_WORLD_SIZE=4): flat, exactly as before
    _check_flat(document)
    assert load_profile(out).hierarchy() is None


@pytest.mark.multiprocess
def test_single_rank_without_launcher(tmp_path):
    out = tmp_path / "single.json"
    result = _run([sys.executable, str(SCRIPT), "--quick", "--no-plot", "--out", str(out)],
                  cwd=tmp_path)
    assert "single rank" in result.stderr
    assert load_profile(out).world_size == 1
    _check_flat(json.loads(out.read_text()))


@pytest.mark.multiprocess
def test_two_nodes_of_two_ranks_measure_both_link_classes(tmp_path):
    # 4 gloo ranks on loopback as 2 "nodes" x 2 ranks (--ranks-per-node 2; torchrun's
    # LOCAL_WORLD_SIZE is 4 here). Sizes large enough that the per-byte term shows (up
    # to 2M, one of the three link fits came out at beta = 0 now and then, with 4 ranks
    # on 2 cores: the bytes were lost in the latency noise).
    out = tmp_path / "two_level.json"
    result = _run(_torchrun(4, str(SCRIPT), "--out", str(out), "--no-progress",
                            "--ranks-per-node", "2", "--sizes", "4K,256K,8M",
                            "--topk-sizes", "1e3,1e4,1e5",
                            "--reps", "3", "--warmup", "1"), cwd=tmp_path)
    document = json.loads(out.read_text())
    _check_document(document, world_size=4, reps=3)
    assert set(document) == FLAT_KEYS | {"ranks_per_node", "intra", "inter", "inter_dense",
                                         "topology", "intra_parts"}
    assert document["ranks_per_node"] == 2
    assert document["topology"] == {"kind": "hierarchical", "nodes": 2, "ranks_per_node": 2,
                                    "requested": "auto"}
    sizes = document["settings"]["sizes_bytes"]
    for name in profile_run.LINK_SECTIONS:
        assert [r["bytes"] for r in document["samples"][name]] == sizes
    for key in ("intra", "inter", "inter_dense"):
        line = document[key]
        assert set(line) == {"alpha_s", "beta_s_per_byte"}
        assert line["alpha_s"] >= 0 and line["beta_s_per_byte"] > 0
    # inter_dense: the fit of the inter-node all-reduce of a dense shard, at its bytes
    for point, row in zip(document["fit_errors"]["inter_dense"],
                          document["samples"]["inter_all_reduce"]):
        assert point["bytes"] == row["bytes"]
        assert point["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        predicted = (document["inter_dense"]["alpha_s"]
                     + document["inter_dense"]["beta_s_per_byte"] * row["bytes"])
        assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)
    # intra is one line through both intra-node collectives' points, at the bytes each
    # rank contributes; each collective's own line is kept as a record
    assert set(document["intra_parts"]) == {"reduce_scatter", "all_gather"}
    points = document["fit_errors"]["intra"]
    assert [p["collective"] for p in points] == ["reduce_scatter"] * 3 + ["all_gather"] * 3
    assert [p["bytes"] for p in points] == sizes * 2
    for point, row in zip(points, document["samples"]["intra_reduce_scatter"]
                          + document["samples"]["intra_all_gather"]):
        assert point["median_s"] == pytest.approx(statistics.median(row["seconds"]))
        predicted = document["intra"]["alpha_s"] + document["intra"]["beta_s_per_byte"] * row[
            "bytes"]
        assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)
    assert [p["bytes"] for p in document["fit_errors"]["inter"]] == sizes
    assert "two link classes: 2 nodes x 2 ranks" in result.stdout
    assert re.search(r"inter_dense +alpha = ", result.stdout), result.stdout
    assert (tmp_path / "two_level.png").read_bytes()[:8] == PNG_MAGIC

    profile = load_profile(out)
    assert profile.ranks_per_node == 2
    assert profile.intra.beta_s_per_byte == document["intra"]["beta_s_per_byte"]
    assert profile.inter.alpha_s == document["inter"]["alpha_s"]
    hierarchy = profile.hierarchy()
    assert isinstance(hierarchy, Hierarchy)
    assert (hierarchy.ranks_per_node, hierarchy.intra, hierarchy.inter) == (
        2, profile.intra, profile.inter)
    assert hierarchy.inter_dense == profile.inter_dense
    assert profile.inter_dense.beta_s_per_byte == document["inter_dense"]["beta_s_per_byte"]
    # and it prices a two-level instance
    flat = Instance(layers=[Unit(numel=100_000, backward_s=1e-3)], world_size=4,
                    density=0.01, forward_s=1e-3, comm=profile.comm, topk=profile.topk)
    two_level = hierarchical_instance(flat, hierarchy.ranks_per_node, hierarchy.intra,
                                      hierarchy.inter, hierarchy.inter_dense)
    assert two_level.inter_allgather_time(100_000) == pytest.approx(
        profile.inter.alpha_s + profile.inter.beta_s_per_byte * 8 * 500)
    # a dense group's inter-node all-reduce of its 50,000-element shard: by inter_dense
    assert two_level.inter_allreduce_time(100_000) == pytest.approx(
        profile.inter_dense.alpha_s + profile.inter_dense.beta_s_per_byte * 4 * 50_000)


@pytest.mark.parametrize("env, option, ranks_per_node, expected", [
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "auto", None, (2, 2)),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "auto", None, None),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "auto", 2, (2, 2)),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "auto", None, None),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "flat", None, None),
    ({"WORLD_SIZE": "4", "RANK": "0"}, "auto", None, None),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "hierarchical", None, (1, 4)),
    ({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_WORLD_SIZE": "4"}, "auto", None, (2, 4)),
])
def test_which_worlds_measure_the_two_link_classes(env, option, ranks_per_node, expected):
    topo = profile_run.resolve_link_topology(option, ranks_per_node, env=env)
    if expected is None:
        assert topo is None
    else:
        assert (topo.nodes, topo.ranks_per_node) == expected and topo.hierarchical
        assert topo.rank == int(env["RANK"])


@pytest.mark.parametrize("env, option, ranks_per_node, message", [
    ({"WORLD_SIZE": "4", "RANK": "0"}, "auto", 3, "--ranks-per-node=3 does not divide"),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "auto", None,
     r"--ranks-per-node \(from LOCAL_WORLD_SIZE\)=3 does not divide"),
    ({"WORLD_SIZE": "4", "RANK": "0"}, "hierarchical", None, "--ranks-per-node: .*needs"),
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "hierarchical", None,
     "at least 2 ranks per node"),
])
def test_bad_topologies_are_clear_errors(env, option, ranks_per_node, message):
    with pytest.raises(SystemExit, match=message):
        profile_run.resolve_link_topology(option, ranks_per_node, env=env)


def test_bad_topology_options_are_rejected_before_launching(monkeypatch, capsys):
    for name, value in (("WORLD_SIZE", "4"), ("RANK", "0"), ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match="--ranks-per-node=3 does not divide the world size 4"):
        profile_run.main(["--quick", "--ranks-per-node", "3"])
    with pytest.raises(SystemExit) as info:
        profile_run.main(["--topology", "nodes"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        profile_run.main(["--ranks-per-node", "0"])
    assert info.value.code == 2


def test_the_intra_fit_is_one_line_through_both_collectives_at_contributed_bytes():
    # both intra-node collectives on the same line (per byte each rank contributes),
    # the inter-node all-gather on another: the fits recover them
    sizes = [1024, 8192, 65536, 524288]
    intra, inter = (2e-5, 1e-10), (3e-4, 8e-9)

    def rows(alpha, beta, scale=1.0):
        return [{"bytes": b, "seconds": [scale * (alpha + beta * b)] * 3} for b in sizes]

    inter_dense = (4e-4, 2e-8)
    samples = {"all_gather": rows(*inter), "all_reduce": rows(*inter),
               "intra_reduce_scatter": rows(*intra), "intra_all_gather": rows(*intra),
               "inter_all_gather": rows(*inter), "inter_all_reduce": rows(*inter_dense),
               "topk": {"torch": [{"numel": d, "k": 1, "seconds": [1e-4 + 1e-9 * d]}
                                  for d in (1000, 10000, 100000)]}}
    fits, errors = profile_run.fit_samples(samples)
    assert fits["intra"].alpha_s == pytest.approx(intra[0], rel=1e-6)
    assert fits["intra"].beta_s_per_byte == pytest.approx(intra[1], rel=1e-6)
    assert fits["inter"].beta_s_per_byte == pytest.approx(inter[1], rel=1e-6)
    for part in ("reduce_scatter", "all_gather"):
        assert fits["intra_parts"][part].beta_s_per_byte == pytest.approx(intra[1], rel=1e-6)
    assert len(errors["intra"]) == 2 * len(sizes) and len(errors["inter"]) == len(sizes)
    # the inter-node all-reduce of a dense shard gets its own line, inter_dense
    assert fits["inter_dense"].alpha_s == pytest.approx(inter_dense[0], rel=1e-6)
    assert fits["inter_dense"].beta_s_per_byte == pytest.approx(inter_dense[1], rel=1e-6)
    assert [p["bytes"] for p in errors["inter_dense"]] == sizes
    # samples from before it was measured still give intra and inter, and no inter_dense
    older = {k: v for k, v in samples.items() if k != "inter_all_reduce"}
    fits_older, _ = profile_run.fit_samples(older)
    assert "inter" in fits_older and "inter_dense" not in fits_older
    # a slower reduce-scatter pulls the joint line between the two collectives' lines
    samples["intra_reduce_scatter"] = rows(*intra, scale=2.0)
    fits, _ = profile_run.fit_samples(samples)
    assert (fits["intra_parts"]["all_gather"].beta_s_per_byte < fits["intra"].beta_s_per_byte
            < fits["intra_parts"]["reduce_scatter"].beta_s_per_byte)
    # a flat sweep's samples fit as before: no link classes
    flat = {k: v for k, v in samples.items() if k not in profile_run.LINK_SECTIONS}
    fits, errors = profile_run.fit_samples(flat)
    assert "intra" not in fits and "inter" not in errors and "inter_dense" not in fits


def test_a_two_level_document_writes_inter_dense_and_loads_it_back(tmp_path):
    # simulated samples through the real fit, document, validation, file and plot code
    from omgs_hook.topology import Topology

    sizes = [1024, 8192, 65536, 524288]

    def rows(alpha, beta):
        return [{"bytes": b, "seconds": [alpha + beta * b] * 3} for b in sizes]

    samples = {"all_gather": rows(3e-4, 8e-9), "all_reduce": rows(3e-4, 6e-9),
               "intra_reduce_scatter": rows(2e-5, 1e-10), "intra_all_gather": rows(2e-5, 1e-10),
               "inter_all_gather": rows(3e-4, 8e-9), "inter_all_reduce": rows(4e-4, 2e-8),
               "topk": {"torch": [{"numel": d, "k": 1, "seconds": [1e-4 + 1e-9 * d] * 3}
                                  for d in (1000, 10000, 100000)]}}
    fits, errors = profile_run.fit_samples(samples)
    document = profile_run.build_document(
        samples=samples, fits=fits, errors=errors, default_backend="torch", world_size=4,
        backend="gloo", device=torch.device("cpu"), settings={"topk_density": 0.01},
        topo=Topology("hierarchical", 2, 2, 0))
    assert document["inter_dense"] == fits["inter_dense"].to_cost().to_dict()
    out = tmp_path / "two_level.json"
    profile_run.write_json_atomically(out, document)
    profile = load_profile(out)
    assert profile.inter_dense.alpha_s == pytest.approx(4e-4, rel=1e-6)
    assert profile.inter_dense.beta_s_per_byte == pytest.approx(2e-8, rel=1e-6)
    assert profile.hierarchy().inter_dense == profile.inter_dense
    summary = profile_run._summary(document, str(out), None, 1.0)
    assert "inter_dense" in summary
    pytest.importorskip("matplotlib")
    profile_run.plot_profile(document, tmp_path / "two_level.png")
    assert (tmp_path / "two_level.png").read_bytes()[:8] == PNG_MAGIC
    # a document of an older two-level sweep (no inter-node all-reduce) has no inter_dense
    older = {k: v for k, v in samples.items() if k != "inter_all_reduce"}
    fits, errors = profile_run.fit_samples(older)
    document = profile_run.build_document(
        samples=older, fits=fits, errors=errors, default_backend="torch", world_size=4,
        backend="gloo", device=torch.device("cpu"), settings={"topk_density": 0.01},
        topo=Topology("hierarchical", 2, 2, 0))
    assert "inter_dense" not in document
    assert load_profile(out).inter_dense is not None
    profile_run.plot_profile(document, tmp_path / "older.png")


def test_script_does_not_shadow_the_stdlib_profile_module():
    # Every script in scripts/ runs with that folder first on sys.path; torch imports
    # cProfile, which imports `profile`: it must get the standard library's module.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "import cProfile, profile\n"
        "assert callable(profile.run) and callable(cProfile.run)\n"
        "print(profile.__file__)\n"
    )
    result = _run([sys.executable, "-c", code], cwd=ROOT)
    assert Path(result.stdout.strip()) != SCRIPT
    assert "scripts" not in Path(result.stdout.strip()).parts


@pytest.mark.parametrize("text, expected", [
    ("1024", 1024), ("64K", 65536), ("8M", 8 * 2**20), ("4e6", 4_000_000), ("1g", 2**30),
])
def test_parse_size(text, expected):
    assert profile_run.parse_size(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "abc"], "bad size"),
    (["--sizes", "0.5"], "positive whole number"),
    (["--reps", "0"], "must be >= 1"),
    (["--density", "2"], r"\(0, 1\]"),
    (["--device", "tpu"], "invalid choice"),
])
def test_bad_options_are_rejected_before_launching(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        profile_run.main(argv)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1K"], "at least 2 distinct sizes"),
    (["--topk-sizes", "1000,2000"], "at least 3 distinct sizes"),
    (["--topk-backends", "nonsense"], r"unknown backend nonsense \(known: torch, sampled, cupy\)"),
    (["--device", "cpu", "--topk-backends", "torch,cupy"], "cupy cannot run on cpu"),
    (["--backend", "carrier-pigeon"], "--backend carrier-pigeon: not available"),
])
def test_unfittable_sweeps_are_rejected_before_launching(argv, message, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=message):
        profile_run.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(SystemExit, match="CUDA is not available"):
        profile_run.main(["--backend", "nccl"])


def test_default_sweep_matches_the_documented_ranges():
    args = profile_run.build_parser().parse_args([])
    settings = profile_run.resolve_settings(args)
    assert settings.adaptive and settings.time_budget_s == profile_run.DEFAULT_TIME_BUDGET_S
    assert settings.sizes[0] == 1024 and settings.sizes[-1] == 8 * 2**20
    assert all(size % 8 == 0 for size in settings.sizes)
    assert all(b / a == pytest.approx(2) for a, b in zip(settings.sizes, settings.sizes[1:]))
    assert settings.topk_sizes[0] == 1000 and settings.topk_sizes[-1] == 4_000_000
    ratios = [b / a for a, b in zip(settings.topk_sizes, settings.topk_sizes[1:])]
    assert all(1.9 < r <= 2.0 for r in ratios)
    assert (settings.reps, settings.warmup, settings.min_reps) == (20, 5, profile_run.MIN_REPS)


# ---------------------------------------------------------------------------------------
# settings: adaptive by default, explicit sweeps unchanged
# ---------------------------------------------------------------------------------------


def _settings(*argv):
    return profile_run.resolve_settings(profile_run.build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv, budget, adaptive", [
    ([], profile_run.DEFAULT_TIME_BUDGET_S, True),
    (["--time-budget", "12.5"], 12.5, True),
    (["--time-budget", "0"], None, True),                  # 0 = no budget
    (["--sizes", "1K,64K"], None, False),                  # explicit lists: all measured
    (["--topk-sizes", "1e3,1e4,1e5"], None, False),
    (["--sizes", "1K,64K", "--time-budget", "3"], 3.0, False),
    (["--quick"], None, False),
])
def test_time_budget_applies_to_the_adaptive_sweep_or_when_asked(argv, budget, adaptive):
    settings = _settings(*argv)
    assert settings.time_budget_s == budget
    assert settings.adaptive is adaptive


def test_quick_and_explicit_sweeps_keep_their_sizes_and_reps():
    quick = _settings("--quick")
    assert quick.sizes == profile_run.QUICK_SIZES
    assert quick.topk_sizes == profile_run.QUICK_TOPK_SIZES
    assert (quick.reps, quick.warmup) == (profile_run.QUICK_REPS, profile_run.QUICK_WARMUP)
    explicit = _settings("--sizes", "1K,20000", "--reps", "3")
    assert explicit.sizes == (1024, 20000) and explicit.reps == 3 and explicit.min_reps == 3


def test_max_sizes_bound_the_adaptive_grid():
    settings = _settings("--max-size", "64K", "--max-topk-size", "1e5")
    assert settings.sizes == (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert settings.topk_sizes[0] == 1000 and settings.topk_sizes[-1] == 100_000


@pytest.mark.parametrize("argv, message", [
    (["--time-budget", "-1"], ">= 0"),
    (["--time-budget", "soon"], "bad time budget"),
])
def test_bad_time_budgets_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        profile_run.build_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_geometric_sizes():
    assert profile_run.geometric_sizes(1024, 8192, multiple=8) == [1024, 2048, 4096, 8192]
    sizes = profile_run.geometric_sizes(1000, 4_000_000)
    assert sizes[0] == 1000 and sizes[-1] == 4_000_000 and len(sizes) == 13
    assert profile_run.geometric_sizes(10, 10) == [10]
    assert all(s % 8 == 0 for s in profile_run.geometric_sizes(100, 10_000, multiple=8))
    with pytest.raises(ValueError):
        profile_run.geometric_sizes(10, 5)


# ---------------------------------------------------------------------------------------
# the adaptive decisions (pure functions)
# ---------------------------------------------------------------------------------------

SETTINGS = profile_run.SweepSettings(sizes=(), topk_sizes=(), reps=20, warmup=5,
                                     time_budget_s=10.0, adaptive=True)


def _plan(index=6, size=2048, previous=(1024, 0.1), spent=0.0, budget=10.0, settings=SETTINGS):
    return profile_run.plan_point(index=index, size=size, previous=previous, spent_s=spent,
                                  budget_s=budget, settings=settings)


def test_plan_point_without_budget_measures_everything_in_full():
    plan = _plan(previous=(1024, 1e3), spent=1e6, budget=None)
    assert plan == profile_run.PointPlan(warmup=5)


def test_plan_point_stops_growing_when_the_cheapest_measurement_does_not_fit():
    # 2048 B predicted at 0.2 s per call; cheapest = (2 warm-up + 5 reps) * 0.2 = 1.4 s
    assert isinstance(_plan(spent=8.5), profile_run.PointPlan)      # 1.5 s left
    stop = _plan(spent=8.7)                                          # 1.3 s left
    assert isinstance(stop, profile_run.Stop)
    assert stop.size == 2048 and stop.reason == "budget"
    assert "1.4 s" in stop.message and "1.3 s" in stop.message and "10 s budget" in stop.message


def test_plan_point_always_measures_the_first_points():
    for index in range(SETTINGS.min_points):
        assert isinstance(_plan(index=index, spent=100.0), profile_run.PointPlan)
    assert isinstance(_plan(index=SETTINGS.min_points, spent=100.0), profile_run.Stop)
    assert _plan(index=0, previous=None, spent=100.0) == profile_run.PointPlan(warmup=5)


def test_plan_point_shortens_warm_up_for_expensive_points():
    # a point may use POINT_SHARE of the 10 s budget; its warm-up a quarter of that
    warm_allowance = 0.25 * 10.0 * profile_run.POINT_SHARE
    assert _plan(previous=(1024, 1e-4)).warmup == 5                   # cheap: full warm-up
    # predicted per call = 2x the previous (twice the size)
    assert _plan(previous=(1024, warm_allowance / 3.5 / 2)).warmup == 3
    expensive = _plan(previous=(1024, 0.1))
    assert expensive.warmup == profile_run.PROBE_CALLS                # never below the probe
    assert expensive.predicted_s == pytest.approx(0.2)


def test_choose_reps_clamps_between_the_floor_and_the_most():
    assert profile_run.choose_reps(0.01, 1.0, 20, 5) == 20
    assert profile_run.choose_reps(0.1, 1.0, 20, 5) == 10
    assert profile_run.choose_reps(1.0, 1.0, 20, 5) == 5
    assert profile_run.choose_reps(None, 1.0, 20, 5) == 20


def test_reps_after_probe_adapts_and_abandons_a_jump():
    plan = profile_run.PointPlan(warmup=2, predicted_s=0.1)
    reps = dict(plan=plan, spent_s=0.0, budget_s=10.0, settings=SETTINGS)
    # allowance = min(10 s * POINT_SHARE, left / 2): cheap calls get every rep, dearer ones
    # as many as fit
    allowance = 10.0 * profile_run.POINT_SHARE
    assert profile_run.reps_after_probe(index=6, probe_s=0.01, **reps) == 20
    assert profile_run.reps_after_probe(index=6, probe_s=allowance / 10.5, **reps) == 10
    assert profile_run.reps_after_probe(index=6, probe_s=allowance / 2, **reps) == 5
    # a probe 20x the prediction: 5 reps of 2 s no longer fit in the 6 s left
    assert profile_run.reps_after_probe(index=6, probe_s=2.0, **reps) == 0
    # ... but one of the first points is measured anyway, with the fewest reps
    assert profile_run.reps_after_probe(index=1, probe_s=2.0, **reps) == SETTINGS.min_reps
    assert profile_run.reps_after_probe(index=6, probe_s=2.0, plan=plan, spent_s=0.0,
                                        budget_s=None, settings=SETTINGS) == 20


def test_section_budgets_hand_unused_time_to_later_parts():
    assert profile_run.section_budgets([0.4, 0.3, 0.3], 0.0, 30.0) == pytest.approx(12.0)
    # the first part used only 2 s of its 12: the next gets 0.3/0.6 of the 28 s left
    assert profile_run.section_budgets([0.3, 0.3], 2.0, 30.0) == pytest.approx(14.0)
    assert profile_run.section_budgets([1.0], 40.0, 30.0) == 0.0
    assert profile_run.section_budgets([1.0], 0.0, None) is None


class ScriptedSource:
    """A timing source whose every call costs ``per_call(size)`` exactly (a virtual clock)."""

    def __init__(self, per_call, probe_factor=1.0):
        self.per_call, self.probe_factor, self.clock, self.calls = per_call, probe_factor, 0.0, []

    def __call__(self, size, warmup, reps_for):
        t = self.per_call(size)
        probe = t * self.probe_factor if warmup else None
        reps = reps_for(probe)
        self.calls.append((size, warmup, reps))
        wall = warmup * (probe or 0.0) + reps * t
        self.clock += wall
        return profile_run.Measurement(seconds=(t,) * reps, wall_s=wall, probe_s=probe)


def test_run_section_stops_growing_within_its_budget_and_records_why():
    sizes = profile_run.geometric_sizes(1024, 8 * 2**20, multiple=8)
    source = ScriptedSource(lambda b: 1e-3 + 1e-7 * b)   # 0.84 s per call at 8 MiB
    rows, record = profile_run.run_section("all_gather", sizes, source, 5.0, SETTINGS)
    assert not record["complete"] and record["reason"] == "budget"
    measured = [size for size, _ in rows]
    assert measured == sizes[:len(measured)] == record["measured"]
    assert SETTINGS.min_points <= len(measured) < len(sizes)
    assert record["stopped_before"] == sizes[len(measured)]
    assert record["spent_s"] == pytest.approx(source.clock) and source.clock <= 5.0
    assert not record["over_budget"]
    # cheap points get every rep, expensive ones fewer (never below the floor)
    assert record["reps"][0] == 20 and SETTINGS.min_reps <= record["reps"][-1] < 20
    assert record["planned"] == sizes and len(record["warmup"]) == len(measured)
    (note,) = profile_run.truncation_notes({"all_gather": record})
    assert f"measured {len(measured)} of {len(sizes)} sizes" in note
    assert "extrapolates beyond the largest measured size" in note


def test_a_part_over_its_budget_says_so():
    # a budget too small even for the first points: they are measured anyway, and noted
    sizes = [1000, 2000, 4000, 8000, 16000, 32000]
    rows, record = profile_run.run_section("topk:x", sizes, ScriptedSource(lambda d: 0.05),
                                           0.5, SETTINGS)
    assert len(rows) == SETTINGS.min_points and record["over_budget"]
    notes = profile_run.truncation_notes({"topk:x": record})
    assert len(notes) == 2 and "over its 0.5 s budget" in notes[1]
    _rows, empty = profile_run.run_section("topk:y", sizes, ScriptedSource(lambda d: 0.01),
                                           0.0, SETTINGS)
    assert "with none of the budget left" in profile_run.truncation_notes({"topk:y": empty})[1]


def test_run_section_completes_when_everything_fits():
    sizes = [1000, 2000, 4000, 8000, 16000]
    source = ScriptedSource(lambda d: 1e-5)
    rows, record = profile_run.run_section("topk:x", sizes, source, 5.0, SETTINGS)
    assert record["complete"] and record["stopped_before"] is None and record["reason"] is None
    assert [size for size, _ in rows] == sizes and record["reps"] == [20] * 5
    assert profile_run.truncation_notes({"topk:x": record}) == []


def test_run_section_abandons_a_point_whose_probe_jumps():
    # linear up to 32 KiB, then 100x more expensive: the prediction misses, the probe not
    sizes = profile_run.geometric_sizes(1024, 1024 * 2**10, multiple=8)
    source = ScriptedSource(lambda b: 1e-4 * b / 1024 * (100 if b > 32768 else 1))
    rows, record = profile_run.run_section("all_reduce", sizes, source, 3.0, SETTINGS)
    assert record["reason"] == "probe" and record["stopped_before"] == 65536
    assert record["measured"][-1] == 32768
    # the abandoned point ran only its (cheaply predicted, so full) warm-up calls
    assert source.calls[-1] == (65536, SETTINGS.warmup, 0)
    assert "warm-up calls took" in record["message"]


def test_decisions_depend_only_on_the_agreed_times():
    # two ranks see identical agreed measurements (MAX-all-reduced) and must therefore
    # choose identical sizes, warm-ups and reps - the property that prevents deadlocks
    sizes = profile_run.geometric_sizes(1024, 8 * 2**20, multiple=8)
    runs = []
    for _rank in range(2):
        source = ScriptedSource(lambda b: 2e-3 + 3e-7 * b, probe_factor=1.3)
        profile_run.run_section("all_gather", sizes, source, 4.0, SETTINGS)
        runs.append(source.calls)
    assert runs[0] == runs[1] and len(runs[0]) < len(sizes)


def test_run_sweep_shares_the_budget_and_rolls_over_what_a_part_leaves():
    cheap = ScriptedSource(lambda s: 1e-5)
    dear = ScriptedSource(lambda s: 1e-3 * s / 1000)
    parts = [("all_gather", 0.5, (1000, 2000, 4000, 8000), cheap),
             ("topk:torch", 0.5, tuple(profile_run.geometric_sizes(1000, 2**20)), dear)]
    _rows, records, spent = profile_run.run_sweep(parts, 10.0, SETTINGS)
    assert records["all_gather"]["budget_s"] == 5.0 and records["all_gather"]["complete"]
    left = 10.0 - records["all_gather"]["spent_s"]
    assert records["topk:torch"]["budget_s"] == pytest.approx(left)
    assert not records["topk:torch"]["complete"]
    assert spent == pytest.approx(cheap.clock + dear.clock) and spent <= 10.0


# ---------------------------------------------------------------------------------------
# fits stable between runs, on a simulated timing source
# ---------------------------------------------------------------------------------------


class SimulatedCluster:
    """A noisy timing source with a virtual clock, standing in for a real process group.

    Every call costs ``truth(size)`` on each of ``ranks`` ranks times log-normal noise
    (sigma), now and then an outlier (``outlier_p`` per rank and call, 2-8x), and the
    first call of every point is ``cold_x`` times slower (connection set-up, caches).
    The reported time is the slowest rank's, as the real timer reports after MAX.
    """

    def __init__(self, truth, seed, ranks=4, sigma=0.15, outlier_p=0.03, cold_x=4.0):
        self.truth, self.ranks, self.sigma = truth, ranks, sigma
        self.rng = np.random.default_rng(seed)
        self.outlier_p, self.cold_x, self.clock = outlier_p, cold_x, 0.0

    def _call(self, size, cold):
        t = self.truth(size) * np.exp(self.sigma * self.rng.standard_normal(self.ranks))
        hit = self.rng.random(self.ranks) < self.outlier_p
        t = np.where(hit, t * self.rng.uniform(2, 8, self.ranks), t)
        seconds = float(t.max()) * (self.cold_x if cold else 1.0)
        self.clock += seconds + 1e-4  # the barrier before each call
        return seconds

    def __call__(self, size, warmup, reps_for):
        start = self.clock
        calls = [self._call(size, cold=(i == 0)) for i in range(warmup)]
        probe = min(calls[-profile_run.PROBE_CALLS:]) if calls else None
        reps = reps_for(probe)
        seconds = tuple(self._call(size, cold=(warmup == 0 and i == 0)) for i in range(reps))
        return profile_run.Measurement(seconds=seconds, wall_s=self.clock - start, probe_s=probe)


BYTES = tuple(profile_run.geometric_sizes(1024, 8 * 2**20, multiple=8))
NUMEL = tuple(profile_run.geometric_sizes(1000, 4_000_000))
# (truth, sizes, budget of the part): loopback-like and 50 Mbit/s-like collectives (the
# latter cut short by the budget), and the three top-k shapes
SIMULATED = {
    "all_gather loopback": (lambda b: 4e-4 + 2.3e-9 * b, BYTES, 12.0),
    "all_gather 50 Mbit/s": (lambda b: 5e-3 + 4.8e-7 * b, BYTES, 12.0),
    "all_reduce 50 Mbit/s": (lambda b: 5e-3 + 2.4e-7 * b, BYTES, 9.0),
    "topk linear": (lambda d: 1e-4 + 3e-9 * d, NUMEL, 4.5),
    "topk n log n": (lambda d: 7e-5 + 2e-10 * d * np.log2(d), NUMEL, 4.5),
    "topk all three": (lambda d: 2e-5 + 1e-9 * d + 1e-10 * d * np.log2(d), NUMEL, 4.5),
}


def _simulated_profile(name, seed, naive=False):
    """One simulated sweep and fit: (fitted curve, measured sizes, record, virtual seconds)."""
    truth, sizes, budget = SIMULATED[name]
    source = SimulatedCluster(truth, seed)
    if naive:
        # what the stability measures replace: few sizes, 3 reps, no warm-up, the mean,
        # plain least squares and a free three-term top-k fit
        settings = profile_run.SweepSettings(sizes=(), topk_sizes=(), reps=3, warmup=0,
                                             time_budget_s=None, adaptive=False, min_reps=3)
        rows, record = profile_run.run_section(name, sizes[::2], source, None, settings)
        statistic = lambda v: float(np.mean(v))  # noqa: E731
    else:
        rows, record = profile_run.run_section(name, sizes, source, budget, SETTINGS)
        statistic = statistics.median
    x = [size for size, _ in rows]
    t = [statistic(seconds) for _, seconds in rows]
    samples = {"all_gather": [], "all_reduce": [], "topk": {}}
    if name.startswith("topk"):
        samples["topk"]["sim"] = [{"numel": d, "k": 1, "seconds": [v]} for d, v in zip(x, t)]
        samples["all_gather"] = samples["all_reduce"] = [
            {"bytes": b, "seconds": [1.0]} for b in (1, 2)]
    else:
        samples["all_gather"] = samples["all_reduce"] = [
            {"bytes": b, "seconds": [v]} for b, v in zip(x, t)]
        samples["topk"]["sim"] = [{"numel": d, "k": 1, "seconds": [1.0]} for d in (1, 2, 4)]
    if naive:
        from omgs_hook.fitting import fit_linear_relative, fit_topk

        if name.startswith("topk"):
            f = fit_topk(x, t, log_term=True)
            curve = lambda d: f.c0 + f.c1 * d + f.c2 * d * np.log2(d)  # noqa: E731
        else:
            f = fit_linear_relative(x, t)
            curve = lambda b: f.alpha_s + f.beta_s_per_byte * b  # noqa: E731
    else:
        fits, _errors = profile_run.fit_samples(samples)  # exactly the command's fits
        if name.startswith("topk"):
            c = fits["topk_all"]["sim"]
            curve = lambda d: c.c0 + c.c1 * d + c.c2 * d * np.log2(d)  # noqa: E731
        else:
            line = fits["comm"]
            curve = lambda b: line.alpha_s + line.beta_s_per_byte * b  # noqa: E731
    return curve, x, record, source.clock


def _worst_deviation_from_median(name, seeds, naive=False):
    """Worst |fit / median of the runs' fits - 1| over every size any of the runs measured."""
    curves, measured = [], set()
    for seed in seeds:
        curve, x, _record, _clock = _simulated_profile(name, seed, naive)
        curves.append(curve)
        measured.update(x)
    points = sorted(measured)
    predicted = np.array([[curve(p) for p in points] for curve in curves])
    return float(np.max(np.abs(predicted / np.median(predicted, axis=0) - 1)))


@pytest.mark.parametrize("name", sorted(SIMULATED))
def test_simulated_fits_agree_within_20_percent_between_three_runs(name):
    for trial in range(5):
        seeds = [100 * trial + run for run in range(3)]
        worst = _worst_deviation_from_median(name, seeds)
        assert worst <= 0.20, f"{name}, seeds {seeds}: a fitted point is {worst:.0%} off the median"


def test_the_stability_test_can_fail():
    # the same check on what the robust sweep replaced: it fails on most shapes, so the
    # 20 % bound above is not met by accident
    failing = [name for name in sorted(SIMULATED)
               if max(_worst_deviation_from_median(name, [100 * t + r for r in range(3)],
                                                   naive=True) for t in range(5)) > 0.20]
    assert len(failing) >= 4, failing


@pytest.mark.parametrize("name", sorted(SIMULATED))
def test_simulated_sweep_stays_near_its_budget(name):
    _truth, sizes, budget = SIMULATED[name]
    for seed in range(5):
        _curve, x, record, clock = _simulated_profile(name, seed)
        assert record["spent_s"] == pytest.approx(clock)
        # the budget is kept up to the misprediction of one point's noisy reps
        assert clock <= 1.25 * budget, (seed, clock)
        assert len(x) >= SETTINGS.min_points
        if name.endswith("50 Mbit/s"):
            # an 8 MiB message takes seconds: the sweep must stop growing long before
            assert not record["complete"] and x[-1] <= 2**20
            assert record["reason"] in ("budget", "probe")


# ---------------------------------------------------------------------------------------
# the real command with a small budget
# ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_rank_profile_with_a_small_budget_stops_growing_and_says_why(tmp_path):
    out = tmp_path / "budget.json"
    result = _run(_torchrun(2, str(SCRIPT), "--out", str(out), "--no-plot", "--no-progress",
                            "--time-budget", "1"), cwd=tmp_path)
    document = json.loads(out.read_text())
    _check_document(document, world_size=2)
    sweep = document["sweep"]
    assert sweep["adaptive"] and sweep["time_budget_s"] == 1.0
    # 1 s cannot hold a 20-rep sweep to 8 MiB (about 2 s for the all-gather alone here):
    # the all-gather stopped growing, and the file says what was measured and why
    assert "all_gather" in sweep["truncated"]
    record = sweep["sections"]["all_gather"]
    assert len(record["measured"]) < len(record["planned"])
    assert record["measured"][-1] < 8 * 2**20
    assert any(n.startswith("all_gather: the time budget cut") for n in sweep["notes"])
    # rank 0 prints it, once
    assert result.stdout.count("WARNING all_gather: the time budget cut the sweep short") == 1
    assert "extrapolates beyond the largest measured size" in result.stdout
    # every part received a budget and the budgets add up to at most the total
    assert sum(r["budget_s"] for r in sweep["sections"].values()) <= 1.0 + 1e-9 + sum(
        r["spent_s"] for r in sweep["sections"].values())
    profile = load_profile(out)
    assert profile.world_size == 2 and profile.comm.alpha_s == document["comm"]["alpha_s"]


def _never_measure(*args, **kwargs):
    raise AssertionError("the sweep must not start")


@pytest.mark.parametrize("where", ["a directory", "below a file", "plot below a file"])
def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch,
                                                                     where):
    """--out (or --plot) pointing at a directory, or below a file, fails at once with
    a message naming the option - not after a sweep of minutes, with a traceback."""
    from omgs_hook import profile_run

    monkeypatch.setattr(profile_run, "measure", _never_measure)
    monkeypatch.setattr(profile_run.dist, "init_process_group", _never_measure)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    argv = {"a directory": ["--out", str(tmp_path)],
            "below a file": ["--out", str(blocker / "p.json")],
            "plot below a file": ["--out", str(tmp_path / "p.json"),
                                  "--plot", str(blocker / "p.png")]}[where]
    with pytest.raises(SystemExit) as caught:
        profile_run.main(argv + ["--quick"])
    message = str(caught.value)
    option = "--plot" if where.startswith("plot") else "--out"
    assert message.startswith(f"omgs-profile: {option}: "), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # no probe left


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    from omgs_hook import profile_run

    target = tmp_path / "profile.json"
    target.mkdir()  # os.replace onto a directory fails
    with pytest.raises(OSError):
        profile_run.write_json_atomically(str(target), {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


@pytest.mark.parametrize("argv, option, message", [
    # the plot over the profile: an image name for --out, or the very same file
    (["--out", "r.png"], "--out", r"r\.png is an image name.*--out r\.json, which plots to "
                                  r"r\.png"),
    (["--out", "r.svg", "--plot", "x.png"], "--out", r"is an image name.*--out r\.json$"),
    (["--out", "b.json", "--plot", "b.json"], "--plot", "b.json is the --out file"),
    (["--out", "b.json", "--plot", "sub/../b.json"], "--plot", "is the --out file"),
    (["--out", "p.json"], "--plot", "p.png is the --out file"),  # p.png links to p.json
    # formats matplotlib refuses (or renames: noext -> noext.png) only after the sweep
    (["--out", "r.json", "--plot", "r.xyz"], "--plot", r"must end in \.png, \.svg or \.pdf"),
    (["--out", "r.json", "--plot", "noext"], "--plot", r"must end in \.png, \.svg or \.pdf"),
    # the default plot path is a folder
    (["--out", "pp.json"], "--plot", r"pp\.png is a directory.*--plot PATH or --no-plot"),
    # paths that name no file
    (["--out", ""], "--out", "empty path"),
    (["--out", "newdir/"], "--out", "newdir/ names a directory"),
    (["--out", "r.json", "--plot", ""], "--plot", "empty path"),
    (["--out", "r.json", "--plot", "plots/"], "--plot", "plots/ names a directory"),
])
def test_output_paths_that_would_fail_after_the_sweep_are_refused_up_front(
        tmp_path, monkeypatch, argv, option, message):
    """Each of these passed the old up-front check and then, after the whole sweep, wrote
    the plot over the profile or ended in a traceback."""
    monkeypatch.setattr(profile_run, "measure", _never_measure)
    monkeypatch.setattr(profile_run.dist, "init_process_group", _never_measure)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pp.png").mkdir()
    (tmp_path / "p.png").symlink_to("p.json")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as caught:
        profile_run.main(argv + ["--quick"])
    text = str(caught.value)
    assert text.startswith(f"omgs-profile: {option}: "), text
    assert re.search(message, text), text
    assert "\n" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created


def test_output_paths_resolve_to_the_files_written():
    resolve = profile_run.resolve_output_paths
    assert resolve("runs/r.json", None, False) == ("runs/r.json", "runs/r.png")
    assert resolve("r", None, False) == ("r", "r.png")
    assert resolve("r.json", "t.SVG", False) == ("r.json", "t.SVG")
    assert resolve("r.json", "t.pdf", False) == ("r.json", "t.pdf")
    assert resolve("r.json", "anything", True) == ("r.json", None)  # --no-plot: no plot
