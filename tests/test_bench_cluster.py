"""Smoke tests of scripts/bench_cluster.py and scripts/convergence.py.

The report logic (statistics, speed-ups, target verdicts, doc rewriting, log parsing) is
checked on hand-made inputs everywhere; the end-to-end ``--quick`` runs need root,
``ip`` and ``tc`` for the emulated cluster (skipped with the reason otherwise), or just
torchrun on loopback for the convergence study.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"




bench = load_script("bench_cluster")
convergence = load_script("convergence")
netem_cluster = load_script("netem_cluster")
UNAVAILABLE = netem_cluster.unavailable_reason()


# ------------------------------------------------------------------ bench: pure logic


def _variant(median, spread=0.01, predicted=None, optimizer=0.0, replayed=None):
    rows = [(median - spread, optimizer, 0.0, 0.0), (median, optimizer, 0.0, 0.0),
            (median + spread, optimizer, 0.0, 0.0)]
    v = {"round_medians_s": [median]}
    v.update(bench.summarise_times(rows))
    if predicted is not None:
        v["hook"] = {"predicted_iteration_s": predicted, "replayed_prediction_s": replayed,
                     "num_groups": 2, "num_units": 5,
                     "plan_groups": [[0, 1, 2], [3, 4]], "plan_dense": [False, False]}
    return v


def _result(omgs=0.5, topk=0.8, lags=0.7, allreduce=1.2, compute=0.3, predicted=0.55,
            optimizer=0.05, replayed=0.45):
    return {
        "kind": "omgs-bench-cluster", "model": "resnet20", "params": 269722, "nodes": 4,
        "rate": "14 Mbit/s", "density": 0.001, "quick": False,
        "settings": {"rounds": 3, "steps": 5, "batch_size": 32, "warmup_steps": 5},
        "load_before": [1.1, 1, 1], "load_after": [1.2, 1, 1],
        "peak_rss_bytes_max_rank": 2 ** 30,
        "variants": {"compute": _variant(compute), "allreduce": _variant(allreduce),
                     "topk": _variant(topk), "lags": _variant(lags),
                     "omgs": _variant(omgs, predicted=predicted, optimizer=optimizer,
                                      replayed=replayed)},
    }


def test_quantile_interpolates_and_rejects_bad_input():
    assert bench.quantile([4, 1, 3, 2], 0.5) == 2.5
    assert bench.quantile([1, 2, 3, 4, 5], 0.25) == 2
    assert bench.quantile([7], 0.75) == 7
    with pytest.raises(ValueError, match="empty"):
        bench.quantile([], 0.5)
    with pytest.raises(ValueError, match="q must be"):
        bench.quantile([1], 1.5)


def test_summarise_times_uses_the_iteration_column():
    s = bench.summarise_times([(0.3, 0.01, 0.002, 0.01), (0.1, 0.03, 0.004, 0.03),
                               (0.2, 0.02, 0.0, 0.02)])
    assert s["median_s"] == 0.2 and s["min_s"] == 0.1 and s["max_s"] == 0.3
    assert s["optimizer_median_s"] == 0.02 and s["topk_median_s"] == 0.002
    assert s["hook_median_s"] == 0.02
    assert s["timed_steps"] == 3


def test_paced_medians_divide_each_step_by_the_hosts_pace():
    """``topk`` is 10% faster than ``default`` but all its steps ran in a slow phase
    (forwards 20% above the run's median): raw it reads slower, paced faster."""
    quick, slow = 0.05, 0.06
    rows = {"default": [(0.110, 0.0, 0.0, 0.0, quick)] * 4 + [(0.100, 0.0, 0.0, 0.0, quick)],
            "topk": [(0.100 * 1.2, 0.0, 0.0, 0.0, slow)] * 5,
            "topk_again": [(0.100, 0.0, 0.0, 0.0, quick)] * 5,
            "powersgd": [(0.2, 0.0, 0.0, 0.0, quick)] * 5}
    variants = {n: bench.summarise_times(r) for n, r in rows.items()}
    assert variants["topk"]["forward_s"] == [slow] * 5
    paced = bench.paced_medians(variants)
    # the run's median forward is the quick one
    assert paced["default"] == pytest.approx(0.110)
    assert paced["topk"] == pytest.approx(0.100)
    assert paced["topk_again"] == pytest.approx(0.100)
    # a pace beyond the clamp (a spell) is clamped
    spell = bench.paced_medians({"x": {"iteration_s": [0.2], "forward_s": [9.0]},
                                 "y": {"iteration_s": [0.1] * 2, "forward_s": [quick] * 2}})
    assert spell["x"] == pytest.approx(0.2 / bench.PACE_CLAMP) and spell["y"] == 0.1
    a = bench.analyse({**_result(), "variants": variants})
    assert a["default_vs_best_peer"] == pytest.approx(0.120 / 0.110)  # raw: ahead
    assert a["paced"]["default_best_peer"] == "topk"
    assert a["paced"]["default_vs_best_peer"] == pytest.approx(0.100 / 0.110)
    assert a["paced"]["aa_difference"] == pytest.approx(0.0)
    assert a["aa_difference"] == pytest.approx(0.100 / 0.120 - 1)
    # rows of a run before the forward column: no paced figures
    old = {n: bench.summarise_times([r[:4] for r in rs]) for n, rs in rows.items()}
    assert "forward_s" not in old["topk"] and bench.paced_medians(old) == {}
    assert "paced" not in bench.analyse({**_result(), "variants": old})


def test_analyse_speedups_and_prediction_error():
    a = bench.analyse(_result())
    assert a["best_sparse_peer"] == "lags"
    assert a["speedup_vs_best_sparse"] == pytest.approx(0.7 / 0.5)
    assert a["ceiling_vs_best_sparse"] == pytest.approx(0.7 / 0.3)
    assert a["speedup_vs_allreduce"] == pytest.approx(1.2 / 0.5)
    assert a["prediction_error"] == pytest.approx(0.1)
    assert "prediction_error_without_optimizer" not in a  # the model includes the tail now
    assert a["replayed_prediction_error"] == pytest.approx(-0.1)
    assert a["comm_compute_ratio"] == pytest.approx((1.2 - 0.3) / 0.3)


def test_render_reports_met_and_missed_targets():
    good = _result()
    bad = _result(omgs=0.65, predicted=0.9)
    bad["nodes"] = 2
    for r in (good, bad):
        r["analysis"] = bench.analyse(r)
    text = bench.render_tables([good, bad], "benchmarks.png")
    targets = text.split("### Targets")[1].split("###")[0]  # the OMGS targets table
    rows = [line for line in targets.splitlines() if line.startswith("| resnet20 N=")]
    assert len(rows) == 2
    good_row = next(r for r in rows if "N=4" in r)
    bad_row = next(r for r in rows if "N=2" in r)
    assert "1.40x (best: lags) met | 2.33x | 2.40x met" in good_row
    assert "+10% met" in good_row and good_row.endswith("| -10% met |")
    assert "1.08x (best: lags) **missed**" in bad_row and "+38% **missed**" in bad_row
    assert "OMGS-SGD (optimal merge): 2 groups of [3, 2]" in text


def _with_default(default=0.5, **medians):
    """A result with every variant, the library default among them."""
    r = _result()
    times = {"greedy": 0.6, "omgs_dense": 0.52, "powersgd": 0.55, **medians}
    for name, median in times.items():
        r["variants"][name] = _variant(median)
    predictions = {"topk": 0.872, "lags": 0.637, "omgs": 0.52, "omgs_dense": 0.52 * 1.2}
    for name, predicted in predictions.items():
        r["variants"][name] = _variant(r["variants"][name]["median_s"], predicted=predicted)
    r["variants"]["default"] = _variant(default, predicted=default * 0.95)
    r["variants"]["default"]["hook"].update(
        {"options": {"select": "measured", "allow_dense": True}, "plan_history": [{}, {}],
         "plan_changed_while_timed": False,
         "selection": {"select": "measured", "trial": None, "last_trial": {
             "start_step": 5, "decided_at": 21, "winner": "single", "candidates": [
                 {"name": "model", "groups": [[0], [1]], "dense": [True, False],
                  "predicted_s": 0.4, "measured_s": 0.61, "winner": False},
                 {"name": "single", "groups": [[0, 1]], "dense": [False],
                  "predicted_s": 0.45, "measured_s": 0.5, "winner": True}]}}})
    r["variants"]["default"]["warmup_steps"] = 30
    r["library"] = {"commit": "0123456789abcdef", "dirty": False}
    return r


def test_analyse_default_against_peers_candidates_and_powersgd():
    a = bench.analyse(_with_default())
    # better of TopK (0.8) and LAGS (0.7) is LAGS: 0.7 / 0.5
    assert a["default_best_peer"] == "lags"
    assert a["default_vs_best_peer"] == pytest.approx(1.4)
    assert set(a["default_slowdown"]) == set(bench.CANDIDATES)
    assert a["default_slowdown"]["omgs"] == pytest.approx(0.0)
    assert a["default_slowdown"]["omgs_dense"] == pytest.approx(0.5 / 0.52 - 1)
    assert a["default_worst_candidate"] == "omgs" and a["fastest_candidate"] == "omgs"
    assert a["default_vs_powersgd"] == pytest.approx(1.1)
    assert a["default_vs_allreduce"] == pytest.approx(2.4)
    errors = a["strategy_prediction_error"]
    assert set(errors) == {"single", "layerwise", "optimal", "optimal+dense"}
    assert errors["single"] == pytest.approx(0.09) and errors["layerwise"] == pytest.approx(-0.09)
    assert errors["optimal+dense"] == pytest.approx(0.2)
    assert a["default_prediction_error"] == pytest.approx(-0.05)
    # a slow default misses every target; results without a default have none of these
    slow = bench.analyse(_with_default(default=0.75))
    assert slow["default_vs_best_peer"] == pytest.approx(0.7 / 0.75)
    assert slow["default_worst_slowdown"] == pytest.approx(0.75 / 0.5 - 1)
    assert slow["default_vs_powersgd"] < 1
    assert "default_vs_best_peer" not in bench.analyse(_result())


def test_render_reports_the_defaults_targets_and_errors_per_strategy():
    good, slow = _with_default(), _with_default(default=0.75)
    slow["nodes"] = 8
    for r in (good, slow):
        r["analysis"] = bench.analyse(r)
    text = bench.render_tables([good, slow], "benchmarks.png")
    assert "| omgs_hook default | 500 |" in text and "| greedy merge | 600 |" in text
    assert "| OMGS-SGD + dense groups | 520 |" in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines()
            if line.startswith("| resnet20 N=") and "0123456" in line}
    assert set(rows) == {"| resnet20 N=4 d=0.001", "| resnet20 N=8 d=0.001"}
    good_row, slow_row = rows["| resnet20 N=4 d=0.001"], rows["| resnet20 N=8 d=0.001"]
    assert "1.40x (best: lags) met" in good_row and "omgs +0% met" in good_row
    assert "1.10x met" in good_row
    assert "0.93x (best: lags) **missed**" in slow_row and "omgs +50% **missed**" in slow_row
    assert "0.73x **missed**" in slow_row  # behind PowerSGD
    errors = [line for line in text.splitlines() if line.startswith("| resnet20 N=4 d=0.001 | +")]
    assert errors == ["| resnet20 N=4 d=0.001 | +9% met | -9% met | +4% met | +20% **missed** "
                      "| -5% met |"]
    assert "omgs_hook default: 2 groups of [3, 2] [select=measured, allow_dense=True, 30 " \
           "untimed warm-up steps, 2 plan(s) in its history]" in text
    assert "Default's selection trial (steps 5-21, predicted/measured ms per step, winner in " \
           "bold): model (2 groups, 1 dense) 400/610, **single (1 groups) 450/500**.\n" in text
    # a later trial says why it ran (a first trial does not)
    r = _with_default()
    r["variants"]["default"]["hook"]["selection"]["last_trial"]["reason"] = "regret"
    r["analysis"] = bench.analyse(r)
    assert "Default's regret selection trial (steps 5-21" in bench.render_tables([r], "b.png")
    # a trial that reports its steps and what they cost against its winner
    r = _with_default()
    r["variants"]["default"]["hook"]["selection"]["last_trial"].update(
        steps=22, excess_steps=1.234)
    r["analysis"] = bench.analyse(r)
    assert ("**single (1 groups) 450/500**. The trial ran 22 steps, lead included; against "
            "running its winner throughout they cost 1.2 steps of the winner "
            "(`excess_steps`).") in bench.render_tables([r], "benchmarks.png")


def test_the_model_check_on_its_own_steps_is_reported_beside_the_timed_error():
    r = _with_default()
    checks = {"topk": -0.02, "lags": 0.15, "omgs": None, "default": 0.01}
    for name, error in checks.items():
        if error is not None:
            r["variants"][name]["hook"]["model_check"] = {"kind": "settled", "error": error}
    a = bench.analyse(r)
    assert a["strategy_check_error"] == {"single": -0.02, "layerwise": 0.15, "default": 0.01}
    r["analysis"] = a
    text = bench.render_tables([r], "benchmarks.png")
    rows = text.split("the steps it was made from")[1].splitlines()
    assert "| resnet20 N=4 d=0.001 | -2% met | +15% **missed** | - | - | +1% met |" in rows
    # results without model checks have no such entry
    assert "strategy_check_error" not in bench.analyse(_result())


def test_the_prediction_replayed_from_the_timed_steps_is_reported_per_strategy():
    r = _with_default()
    medians = {name: r["variants"][name]["median_s"] for name in ("topk", "lags", "default")}
    replayed = {"topk": medians["topk"] * 1.04, "lags": medians["lags"] * 0.85,
                "default": medians["default"] * 1.01}
    for name, value in replayed.items():
        r["variants"][name]["hook"]["replayed_prediction_s"] = value
    a = bench.analyse(r)
    assert a["strategy_replayed_error"] == pytest.approx(
        {"single": 0.04, "layerwise": -0.15, "default": 0.01})
    r["analysis"] = a
    text = bench.render_tables([r], "benchmarks.png")
    rows = text.split("made from the timed steps themselves")[1].splitlines()
    assert "| resnet20 N=4 d=0.001 | +4% met | -15% **missed** | - | - | +1% met |" in rows
    # OMGS-SGD's alone (0.45 s replayed, 0.5 s measured); none without replayed predictions
    assert bench.analyse(_result())["strategy_replayed_error"] == {"optimal": pytest.approx(-0.1)}
    assert "strategy_replayed_error" not in bench.analyse(_result(replayed=None))


def test_quick_runs_on_a_faster_link_unless_a_rate_is_given():
    # the smoke run's dense warm-up steps would take most of its time at 20 Mbit/s
    assert bench.parse_args(["--quick"]).rate == {("resnet20", 2): bench.QUICK_RATE}
    assert bench.parse_args([]).rate == {}
    given = bench.parse_args(["--quick", "--rate", "resnet20:2=20mbit"]).rate
    assert given == {("resnet20", 2): "20mbit"}


def test_the_benchmark_rates_give_the_measured_rows_a_ratio_of_four():
    # the rows the rates were re-derived from (compute-only and all-reduce medians, ms,
    # at the old rate; BENCH_RATES's comment), through netem_cluster.matching_rate
    netem = load_script("netem_cluster")
    rows = {("resnet20", 2): (64.2, 529.7, 20e6), ("resnet20", 4): (146.3, 1273.2, 14e6),
            ("resnet20", 8): (342.5, 3803.7, 5e6), ("vgg16", 4): (806.5, 6047.0, 185e6)}
    for (model, nodes), (compute, iteration, rate) in rows.items():
        derived = netem.matching_rate(compute, iteration, rate, target_ratio=4)
        chosen = netem.parse_rate(bench.default_rate(model, nodes))
        assert abs(chosen - derived) / derived < 0.02, (model, nodes, chosen, derived)
    # configurations without a re-derived rate keep the older tables
    assert bench.default_rate("vgg16", 2) == bench.VGG16_RATES[2]
    assert bench.default_rate("resnet20", 3) is None


def _rows(model, nodes, density, compute, allreduce, rate_bps):
    r = _result(compute=compute, allreduce=allreduce)
    r.update(model=model, nodes=nodes, density=density, rate_bps=rate_bps)
    return r


def test_matched_rates_give_each_measured_configuration_a_ratio_of_four():
    netem = load_script("netem_cluster")
    results = [_rows("resnet20", 2, 0.001, 0.12, 0.38, 36e6),   # ratio 2.17 on a slow host
               _rows("resnet20", 2, 0.01, 0.11, 0.40, 36e6),
               _rows("resnet20", 4, 0.001, 0.25, 1.50, 14e6)]
    no_allreduce = _rows("resnet20", 8, 0.001, 0.5, 2.0, 7e6)
    del no_allreduce["variants"]["allreduce"]
    loopback = _rows("vgg16", 4, 0.001, 1.0, 0.9, 1e9)  # no communication visible
    rates = bench.matched_rates(results + [no_allreduce, loopback])
    assert set(rates) == {("resnet20", 2), ("resnet20", 4)}
    # a configuration's densities averaged, each through netem_cluster.matching_rate
    expected = (netem.matching_rate(0.12, 0.38, 36e6) + netem.matching_rate(0.11, 0.40, 36e6)) / 2
    bps, ratios = rates[("resnet20", 2)]
    assert bps == pytest.approx(expected) and bps < 0.7 * 36e6  # ratio ~2.4 of 4: ~0.6 x rate
    assert ratios == pytest.approx([0.26 / 0.12, 0.29 / 0.11])
    # at the matched rate the same communication takes four times the compute step
    bps4, _ = rates[("resnet20", 4)]
    assert (1.25 * 14e6 / bps4) / 0.25 == pytest.approx(4.0)
    # the printed arguments are accepted by --rate and name the same rates
    arguments = bench.matched_rate_arguments(rates)
    assert arguments[0].startswith("--rate resnet20:2=") and arguments[0].endswith("kbit")
    for argument in arguments:
        key, rate = bench._rate_override(argument.split(" ", 1)[1])
        assert netem.parse_rate(rate) == pytest.approx(rates[key][0], abs=500)


def test_matched_rates_read_a_results_directory_and_say_when_it_has_none(tmp_path, capsys):
    path = tmp_path / "bench_resnet20_n2_d0.001.json"
    path.write_text(json.dumps(_rows("resnet20", 2, 0.001, 0.1, 0.3, 20e6)))
    assert bench.main(["--matched-rates", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "resnet20 N=2: measured comm/compute 2.00 -> 10 Mbit/s for 4" in out
    assert out.strip().endswith("--rate resnet20:2=10000kbit")
    with pytest.raises(SystemExit, match="--matched-rates: no result in .* has both"):
        bench.main(["--matched-rates", "--results-dir", str(tmp_path / "empty")])


def test_the_a_a_control_is_on_request_and_reported_as_the_noise_floor():
    # not run unless asked for: the default hooks leave it out, --hooks can name it
    assert "topk_again" not in bench.parse_args([]).hooks
    assert bench.parse_args(["--hooks", "topk,topk_again"]).hooks == ["topk", "topk_again"]
    r = _with_default(topk_again=0.84)  # TopK-SGD itself runs at 0.8
    r["analysis"] = bench.analyse(r)
    assert r["analysis"]["aa_difference"] == pytest.approx(0.05)
    # the control is not a plan the default chooses among
    assert "topk_again" not in r["analysis"]["default_slowdown"]
    text = bench.render_tables([r], "benchmarks.png")
    assert "| TopK-SGD again (A/A control) | 840 |" in text
    assert "A/A control (`topk_again`" in text and "resnet20 N=4 d=0.001 +5%." in text
    plain = _with_default()
    plain["analysis"] = bench.analyse(plain)
    assert "aa_difference" not in plain["analysis"]
    assert "A/A control" not in bench.render_tables([plain], "benchmarks.png")


def test_each_round_draws_its_own_order_the_same_on_every_rank():
    orders = [bench.round_order(10, i, seed=0) for i in range(12)]
    assert all(sorted(o) == list(range(10)) for o in orders)
    # a function of (seed, round) alone: what every rank computes on its own
    assert orders == [bench.round_order(10, i, seed=0) for i in range(12)]
    assert bench.round_order(10, 3, seed=1) != orders[3]
    # not a rotation: a variant does not always follow the same one
    followers = {}
    for o in orders:
        for a, b in zip(o, o[1:]):
            followers.setdefault(a, set()).add(b)
    assert all(len(f) > 1 for f in followers.values())
    assert len({o[0] for o in orders}) > 3  # and the round's first place moves


def test_the_round_order_is_the_same_in_another_interpreter():
    code = ("import sys; sys.path.insert(0, 'scripts'); import bench_cluster as b; "
            "print([b.round_order(9, i, 5) for i in range(4)])")
    runs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, check=True,
                           stdout=subprocess.PIPE, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(runs) == 1 and runs == {str([bench.round_order(9, i, 5) for i in range(4)]) + "\n"}


def test_ratio_targets_are_judged_against_the_a_a_difference():
    v = bench.ratio_verdict
    # without a control: plain met / missed at the target
    assert v(0.98, 0.98) == "met" and v(0.979, 0.98) == "**missed**"
    # "ahead of PowerSGD" is strict: level is not ahead
    assert v(1.0, 1.0, strict=True) == "**missed**" and v(1.001, 1.0, strict=True) == "met"
    # with an A/A difference of 5%: only a margin larger than it decides, either way
    assert v(0.98 * 1.05, 0.98, 0.05) == "met"
    assert v(0.98 * 1.049, 0.98, 0.05) == bench.WITHIN_NOISE
    assert v(0.98 / 1.05, 0.98, -0.05) == bench.WITHIN_NOISE  # the sign does not matter
    assert v(0.98 / 1.051, 0.98, 0.05) == "**missed**"
    assert v(0.99, 0.98, 0.0) == "met" and v(0.97, 0.98, 0.0) == "**missed**"
    # in the default's table: a 4% slower default with a 10% A/A pair is not a miss,
    # a 50% slower one is; without the control the 4% reads as missed
    close = _with_default(default=0.52, topk_again=0.88)
    far = _with_default(default=0.75, topk_again=0.88)
    far["nodes"] = 8
    plain = _with_default(default=0.52)
    plain["nodes"] = 2
    for r in (close, far, plain):
        r["analysis"] = bench.analyse(r)
    text = bench.render_tables([close, far, plain], "benchmarks.png")
    rows = {line.split(" | ")[0]: line for line in text.splitlines()
            if line.startswith("| resnet20 N=") and "0123456" in line}
    assert f"omgs +4% {bench.WITHIN_NOISE}" in rows["| resnet20 N=4 d=0.001"]
    assert "omgs +50% **missed**" in rows["| resnet20 N=8 d=0.001"]
    assert "omgs +4% **missed**" in rows["| resnet20 N=2 d=0.001"]
    assert "met or missed only by more than that difference" in text


def test_a_running_selection_trial_is_recognised():
    running = bench._selection_in_progress
    assert running({"selection": {"select": "measured", "trial": {"candidates": []}}})
    assert not running({"selection": {"select": "measured", "trial": None,
                                      "last_trial": {"winner": "single"}}})
    assert not running({"plan": {}})  # a library without measured selection
    assert running({"trial": {"active": True}}) and not running({"trial": {"done": True}})


def test_the_default_is_timed_after_its_settled_model_check():
    settled = bench._prediction_settled
    plan = {"made_at_step": 37}
    assert not settled({"plan": plan, "model_check": None})
    assert not settled({"plan": plan, "model_check": {"kind": "first", "step": 42}})
    # a settled check of an earlier plan is not this plan's
    assert not settled({"plan": plan, "model_check": {"kind": "settled", "step": 30}})
    assert settled({"plan": plan, "model_check": {"kind": "settled", "step": 57}})
    assert settled({"plan": {}})  # a library without a model check


class _SettlingState:
    """A hook that runs a trial until step 12, then keeps one plan (made at step 12)
    whose settled model check comes 20 steps later; counts the harness's stats() calls."""

    class _Plan:
        dense = (False,)

        @staticmethod
        def unit_groups():
            return [[0]]

    def __init__(self):
        self.step, self.stats_calls, self.plan = 0, 0, self._Plan()

    def stats(self):
        self.stats_calls += 1
        trial = {"candidates": []} if self.step < 12 else None
        check = None
        if self.step >= 12 + 20:
            check = {"kind": "settled", "step": 12 + 20}
        elif self.step >= 12 + 5:
            check = {"kind": "first", "step": 12 + 5}
        return {"step": self.step, "selection": {"trial": trial}, "model_check": check,
                "plan": {"made_at_step": 12}}


def test_the_default_settles_until_its_settled_check_with_plain_steps_between():
    import torch.distributed as dist
    from ddp_harness import free_port

    state = bench.Variant("default", None, None, None, hook_state=_SettlingState())

    def step(variant, batch):
        variant.steps_run += 1
        variant.hook_state.step += 1
        return (0.1, 0.0, 0.0, 0.0)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        extra = bench.settle_default(state, [None], 80, 3, step)
        # the trial ended at step 12, the plan was stable 3 steps later; the settled
        # check came at step 32 and the harness stopped right after it
        assert state.hook_state.step == extra == 12 + 20 + 1
        # phase 2 (steps 16-33) ran as plain steps: a stats() call per batch of them
        assert state.hook_state.stats_calls <= 15 + 3
        assert len(state.warmup_rows) == extra
        # the cap holds
        capped = bench.Variant("default", None, None, None, hook_state=_SettlingState())
        assert bench.settle_default(capped, [None], 20, 3, step) == 20
    finally:
        dist.destroy_process_group()


def test_write_doc_keeps_text_outside_the_markers(tmp_path):
    doc = tmp_path / "b.md"
    bench.write_doc(str(doc), "first table\n")
    text = doc.read_text()
    doc.write_text("my analysis\n" + text + "closing words\n")
    bench.write_doc(str(doc), "second table\n")
    text = doc.read_text()
    assert "my analysis" in text and "closing words" in text
    assert "second table" in text and "first table" not in text
    doc.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="markers"):
        bench.write_doc(str(doc), "x")


@pytest.mark.parametrize("argv, message", [
    (["--rate", "vgg16:4"], "MODEL:N=RATE"),
    (["--rate", "alexnet:4=1gbit"], "unknown model"),
    (["--rate", "user:4=220"], "has no unit"),
    (["--rate", "resnet20:4=10mbps"], "bytes/s"),
    (["--models", "resnet20", "--rate", "vgg16:4=1gbit"], "not being run"),
    (["--densities", "1.0"], "density must be in"),
    (["--hooks", "allreduce,dgc"], "unknown hook dgc"),
    (["--nodes", "1"], "node count must be >= 2"),
    (["--warmup-steps", "1"], "at least 2"),
])
def test_bad_arguments_are_rejected_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_user_model_must_name_an_existing_builder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "user"])  # no --user-model
    assert "go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--user-model", str(tmp_path / "none.py") + ":build", "--models", "user"])
    assert "no such file" in capsys.readouterr().err
    path = tmp_path / "heldout.py"
    path.write_text("import torch.nn as nn\n"
                    "def build():\n"
                    "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))\n")
    with pytest.raises(SystemExit):
        bench.parse_args(["--user-model", f"{path}:missing", "--models", "user"])
    assert "no function 'missing'" in capsys.readouterr().err
    args = bench.parse_args(["--user-model", f"{path}:build", "--models", "user",
                             "--nodes", "4", "--rate", "user:4=50mbit"])
    assert args.models == ["user"] and args.rate == {("user", 4): "50mbit"}
    # the workers build it from the config, like the shipped models
    model = bench.build_model({"model": "user", "user_model": f"{path}:build"})
    assert sum(p.numel() for p in model.parameters()) == 3 * 32 * 32 * 10 + 10


def test_profile_sweep_spans_the_sparse_messages_and_the_dense_gradient():
    sizes, topk_sizes = bench.profile_sweep(20_000_000, 0.001, quick=False)
    largest_message = 4 * (2 * 20_000 + 1)
    # up to the whole fp32 gradient: a dense group's all-reduce is priced from measured
    # sizes, not extrapolated from latency-bound ones
    assert sizes[0] == 64 and sizes[-1] == 4 * 20_000_000 and len(sizes) == 8
    assert any(largest_message <= s <= 4 * largest_message for s in sizes)
    assert sizes == sorted(set(sizes))
    assert topk_sizes[0] == 1000 and topk_sizes[-1] == 20_000_000
    # the smoke run keeps to the sparse sizes
    quick, _ = bench.profile_sweep(20_000_000, 0.001, quick=True)
    assert quick[-1] == 2 * largest_message and len(quick) == 3


# ------------------------------------------------------------ convergence: pure logic


@pytest.mark.parametrize("text, expected", [
    ("allreduce", ("allreduce", "allreduce", None, 0, False)),
    ("omgs:0.001", ("omgs:0.001", "omgs", 0.001, 0, False)),
    (" lags:0.0100 ", ("lags:0.01", "lags", 0.01, 0, False)),
    ("omgs:0.001@88", ("omgs:0.001@88", "omgs", 0.001, 88, False)),
    ("omgs:0.001+clip", ("omgs:0.001+clip", "omgs", 0.001, 0, True)),
    ("omgs:0.001@106+clip", ("omgs:0.001@106+clip", "omgs", 0.001, 106, True)),
])
def test_parse_config(text, expected):
    assert convergence.parse_config(text) == expected


def test_convergence_help_names_one_default_per_option():
    # --epochs said "(default: 20; 7 for lstm) (default: None)": the formatter appended
    # argparse's None to options whose help already gives the real default
    text = " ".join(convergence.build_parser().format_help().split())
    assert "(default: None)" not in text
    assert "schedule length (default: 20; 7 for lstm)" in text
    assert "(default: 2)" in text  # --nproc: defaults that argparse knows are still shown


@pytest.mark.parametrize("text, message", [
    ("omgs", "needs a density"), ("omgs:2", "must be in"), ("dgc:0.1", "unknown hook"),
    ("allreduce:0.1", "takes no density"), ("allreduce@5", "takes no density"),
    ("omgs:0.001@0", "positive number of steps"), ("omgs:0.001@x", "positive number of steps"),
    ("omgs:0.001+dgc", "only suffix"), ("allreduce+clip", "takes no"),
])
def test_parse_config_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        convergence.parse_config(text)


def test_read_log_and_paired_summary(tmp_path):
    log = tmp_path / "run.jsonl"
    lines = [{"step": 1, "epoch": 0, "loss": 2.0, "iter_s": 0.1, "lr": 0.1},
             {"step": 2, "epoch": 0, "loss": 1.0, "iter_s": 0.1, "lr": 0.1},
             {"epoch": 0, "step": 2, "test_accuracy": 0.9, "test_loss": 0.3},
             {"summary": True, "test_accuracy": 0.9, "test_loss": 0.3}]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps, evaluations, summary = convergence.read_log(str(log))
    assert [s["loss"] for s in steps] == [2.0, 1.0] and len(evaluations) == 1
    assert summary["test_accuracy"] == 0.9
    log.write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match="no summary"):
        convergence.read_log(str(log))

    def run(config, seed, accuracy):
        return {"config": config, "seed": seed, "epochs": 5, "final_test_accuracy": accuracy,
                "final_test_loss": 0.1, "bytes_sent_per_step": 100.0, "median_iter_s": 0.1,
                "step_loss": [1.0, 0.5], "step_epoch": [0, 1], "evaluations": []}
    runs = [run("allreduce", 0, 0.98), run("allreduce", 1, 0.96),
            run("omgs:0.001", 0, 0.97), run("omgs:0.001", 1, 0.93)]
    rows = {r["config"]: r for r in convergence.summarise(runs, 5)}
    omgs = rows["omgs:0.001"]
    assert omgs["gap_pp"] == pytest.approx(-2.0)
    assert omgs["paired_gaps_pp"] == pytest.approx([-1.0, -3.0])
    assert not convergence.target_met(omgs)
    assert convergence.epoch_curves(runs[0])["train_loss"] == [1.0, 0.5]


# ------------------------------------------------------------------ end to end


@pytest.mark.netns
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"emulated cluster: {UNAVAILABLE}")
def test_bench_cluster_quick_run(tmp_path):
    results, doc, png = tmp_path / "results", tmp_path / "bench.md", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_cluster.py"), "--quick",
         "--results-dir", str(results), "--doc", str(doc), "--plot", str(png),
         "--timeout", "150"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=160)
    assert proc.returncode == 0, proc.stdout[-3000:]
    files = list(results.glob("bench_resnet20_n2_d0.001.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert set(result["variants"]) == set(bench.VARIANTS) - set(bench.ON_REQUEST)
    for name, v in result["variants"].items():
        assert v["timed_steps"] == 2 and v["median_s"] > 0, name
    omgs = result["variants"]["omgs"]
    assert omgs["hook"]["predicted_iteration_s"] > 0
    assert omgs["hook"]["num_groups"] >= 1 and omgs["topk_median_s"] > 0
    assert omgs["hook_median_s"] > omgs["topk_median_s"]
    assert omgs["hook"]["replayed_prediction_s"] > 0
    assert result["profile"]["comm"]["beta_s_per_byte"] > 0
    default = result["variants"]["default"]
    assert default["hook"]["num_groups"] >= 1 and default["hook"]["predicted_iteration_s"] > 0
    assert default["warmup_steps"] >= result["variants"]["omgs"]["warmup_steps"]
    # the default's settling steps keep every timer, one value per step
    settle = [default["settle_" + key] for key in bench.STEP_COLUMNS]
    assert settle[0] and len({len(column) for column in settle}) == 1
    assert all(s > 0 for s in settle[0])
    assert result["variants"]["omgs_dense"]["hook"]["options"]["allow_dense"] is True
    assert result["variants"]["omgs"]["hook"]["options"]["allow_dense"] is False
    assert result["library"]["commit"] and "density" in result["library"]["defaults"]
    # each round ran every variant once, in the order round_order drew for it
    orders = result["round_orders"]
    assert len(orders) == result["settings"]["rounds"]
    assert all(sorted(o) == sorted(result["variants"]) for o in orders)
    analysis = result["analysis"]
    assert analysis["default_vs_best_peer"] > 0 and "default_vs_powersgd" in analysis
    assert set(analysis["default_slowdown"]) == set(bench.CANDIDATES)
    text = doc.read_text()
    assert "| OMGS-SGD (optimal merge) |" in text and "| resnet20 N=2 d=0.001 |" in text
    assert "| omgs_hook default |" in text and "### Prediction error per strategy" in text
    assert png.stat().st_size > 1000


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_convergence_quick_run(tmp_path):
    results, doc, png = tmp_path / "c.json", tmp_path / "c.md", tmp_path / "c.png"
    # a 20 Mbit/s network like the benchmark's ResNet-20 cluster: sparse groups pay there
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({
        "schema_version": 1, "world_size": 2, "backend": "gloo", "device": "cpu",
        "comm": {"alpha_s": 7e-4, "beta_s_per_byte": 4e-7},
        "dense": {"alpha_s": 5e-4, "beta_s_per_byte": 4e-7},
        "topk": {"backend": "sampled", "c0": 2e-4, "c1": 3e-9, "c2": 0.0}}))
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "convergence.py"), "--quick", "--results", str(results),
         "--doc", str(doc), "--plot", str(png), "--profile", str(profile),
         # every group sparse: with dense groups allowed the plan (with the hook's measured
         # selection: timed on loopback, where dense is cheap) may send everything dense
         "--", "--no-allow-dense"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:]
    runs = json.loads(results.read_text())["runs"]
    assert sorted(r["config"] for r in runs) == ["allreduce", "omgs:0.01"]
    for run in runs:
        assert 0.0 <= run["final_test_accuracy"] <= 1.0 and len(run["step_loss"]) == 22
    omgs = next(r for r in runs if r["config"] == "omgs:0.01")
    # the hook really compressed: ~1% of the entries went out in the last step
    assert 0.005 < omgs["last_step_density"] < 0.02
    assert "| omgs:0.01 | 0 |" in doc.read_text() and png.stat().st_size > 1000


def test_convergence_rejects_a_missing_profile(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convergence.parse_args(["--profile", str(tmp_path / "nope.json")])
    assert "no such file" in capsys.readouterr().err


def test_convergence_lstm_defaults_and_the_local_clip_replaces_the_global_one():
    args = convergence.parse_args(["--model", "lstm"])
    assert [c[0] for c in args.configs] == list(convergence.LSTM_CONFIGS)
    assert args.epochs == convergence.LSTM_EPOCHS and args.profile is None
    assert args.results.endswith("convergence_lstm.json")
    assert "--no-allow-dense" in args.train_args
    # the study's model and corpus, unless the user gives their own after --
    for option, value in convergence.LSTM_STUDY_OPTIONS:
        assert args.train_args[args.train_args.index(option) + 1] == value
    own = convergence.parse_args(["--model", "lstm", "--", "--lstm-hidden-size", "64"])
    assert own.train_args.count("--lstm-hidden-size") == 1
    assert own.train_args[own.train_args.index("--lstm-hidden-size") + 1] == "64"
    assert "--text-corpus" in own.train_args
    clip = convergence.train_command("omgs", 0.001, 0, 8, "log", args, local_clip=True)
    assert clip[clip.index("--local-clip-norm") + 1] == "1.0"
    # the last --clip-grad-norm wins in train.py: the averaged update is not clipped again
    assert clip[-2:] == ["--clip-grad-norm", "0"] and "--track-staleness" in clip
    plain = convergence.train_command("omgs", 0.001, 0, 8, "log", args)
    assert "--local-clip-norm" not in plain and "--clip-grad-norm" not in plain
    dense = convergence.train_command("allreduce", None, 0, 8, "log", args)
    assert "--track-staleness" not in dense
    # a +clip run of a model without a default threshold needs one
    with pytest.raises(SystemExit):
        convergence.parse_args(["--configs", "omgs:0.01+clip", "--profile", "default"])


def test_convergence_bits_per_character_summary_and_targets():
    import math

    def run(config, seed, bits, density):
        loss = bits * math.log(2)
        return {"config": config, "seed": seed, "epochs": 2, "density": density,
                "model": "lstm", "nproc": 2, "train_args": [], "final_test_loss": loss, "bytes_sent_per_step": 10.0, "median_iter_s": 0.1,
                "step_loss": [loss] * 4, "step_epoch": [0, 0, 1, 1],
                "evaluations": [{"epoch": 0, "step": 2, "test_loss": loss, "test_accuracy": 0.5},
                                {"epoch": 1, "step": 4, "test_loss": loss, "test_accuracy": 0.5}],
                "error_feedback": {"residual_to_gradient": 2.0},
                "staleness": {"step": 4, "max": 3, "mean": 1.5}}
    runs = [run("allreduce", 0, 2.0, None), run("allreduce", 1, 2.2, None),
            run("omgs:0.001", 0, 2.05, 0.001), run("omgs:0.001", 1, 2.25, 0.001),
            run("omgs:0.01", 0, 2.05, 0.01), run("omgs:0.01", 1, 2.25, 0.01)]
    rows = {r["config"]: r for r in convergence.summarise_text(runs, 2)}
    sparse = rows["omgs:0.001"]
    assert sparse["gap_pct"] == pytest.approx(100 * (2.15 / 2.1 - 1))
    assert sparse["paired_gaps_pct"] == pytest.approx([2.5, 100 * (2.25 / 2.2 - 1)])
    assert sparse["target_pct"] == 3.0 and convergence.text_target_met(sparse)
    assert rows["omgs:0.01"]["target_pct"] == 1.0 and not convergence.text_target_met(rows["omgs:0.01"])
    assert convergence.text_curves(runs[0])["eval_epoch"] == [1.0, 2.0]
    text = convergence.render({"runs": runs}, "p.png", text=True)
    assert "### LSTM, 2 epochs (4 steps)" in text and "within 3%: met" in text
    assert "within 1%: **missed**" in text and "| 2 | 2.1000 |" in text
