"""Tests for the omgs-plan command (omgs_hook.cli_plan)."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omgs_hook import cli_plan
from omgs_hook.cost_model import Instance
from omgs_hook.planner import make_plan

SRC = str(Path(__file__).resolve().parents[1] / "src")

INSTANCE = {
    "layers": [
        {"numel": 1000, "backward_s": 0.0002},
        {"numel": 5_000_000, "backward_s": 0.004},
        {"numel": 300, "backward_s": 0.0001},
        {"numel": 2_000_000, "backward_s": 0.003},
    ],
    "world_size": 16,
    "density": 0.001,
    "forward_s": 0.01,
    "comm": {"alpha_s": 0.002, "beta_s_per_byte": 1.7e-8},
    "topk": {"c0": 1e-5, "c1": 2e-10, "c2": 0.0},
}
DENSE_INSTANCE = dict(INSTANCE, dense={"alpha_s": 0.001, "beta_s_per_byte": 1e-10})
KEYS = {"strategy", "groups", "predicted_iteration_s", "non_overlapped_s"}


def run_main(capsys, argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = cli_plan.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def write(tmp_path, data, name="inst.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# ----------------------------------------------------------------------- results


def test_single_instance_from_file(tmp_path, capsys):
    status, out, err = run_main(capsys, [write(tmp_path, INSTANCE)])
    assert status == 0 and err == ""
    result = json.loads(out)
    assert set(result) == KEYS  # no "dense" without a dense cost
    expected = make_plan(Instance.from_dict(INSTANCE)).to_dict(include_dense=False)
    assert result == expected
    assert result["strategy"] == "optimal"


def test_dense_flags_only_when_the_instance_has_a_dense_cost(tmp_path, capsys):
    status, out, _ = run_main(capsys, [write(tmp_path, DENSE_INSTANCE)])
    assert status == 0
    result = json.loads(out)
    assert set(result) == KEYS | {"dense"}
    assert len(result["dense"]) == len(result["groups"])


def test_an_instance_floor_sends_small_groups_dense(tmp_path, capsys):
    # layerwise: the 300- and 1000-element units are groups of their own; the dense
    # all-reduce is priced high, so only the floor sends them dense
    data = dict(INSTANCE, dense={"alpha_s": 1.0, "beta_s_per_byte": 1e-6})
    status, out, _ = run_main(capsys, [write(tmp_path, data), "--strategy", "layerwise"])
    assert status == 0 and json.loads(out)["dense"] == [False] * 4
    status, out, _ = run_main(capsys, [write(tmp_path, dict(data, min_sparse_numel=1024)),
                                       "--strategy", "layerwise"])
    assert status == 0 and json.loads(out)["dense"] == [True, False, True, False]
    status, out, err = run_main(capsys, [write(tmp_path, dict(data, min_sparse_numel=-1))])
    assert status == 2 and "min_sparse_numel" in err


def test_list_in_list_out_from_stdin(capsys, monkeypatch):
    data = [INSTANCE, DENSE_INSTANCE, INSTANCE]
    status, out, _ = run_main(capsys, ["-", "--strategy", "greedy"], json.dumps(data), monkeypatch)
    assert status == 0
    result = json.loads(out)
    assert isinstance(result, list) and len(result) == 3
    for item, source in zip(result, data):
        inst = Instance.from_dict(source)
        assert item == make_plan(inst, "greedy").to_dict(include_dense=inst.dense is not None)
    status, out, _ = run_main(capsys, [], "[]", monkeypatch)  # FILE omitted: stdin
    assert status == 0 and json.loads(out) == []


@pytest.mark.parametrize(
    "strategy, expected",
    [("layerwise", [[0], [1], [2], [3]]), ("single", [[0, 1, 2, 3]]),
     ("threshold:4e6", [[0, 1], [2, 3]]), (" Greedy ", None)],
)
def test_strategies(tmp_path, capsys, strategy, expected):
    status, out, _ = run_main(capsys, [write(tmp_path, INSTANCE), "--strategy", strategy])
    assert status == 0
    result = json.loads(out)
    assert result["strategy"] == strategy.strip().lower().replace("4e6", "4000000")
    if expected is not None:
        assert result["groups"] == expected


def test_indent_option(tmp_path, capsys):
    _, compact, _ = run_main(capsys, [write(tmp_path, INSTANCE)])
    _, indented, _ = run_main(capsys, [write(tmp_path, INSTANCE), "--indent", "2"])
    assert compact.count("\n") == 1 and indented.count("\n") > 3
    assert json.loads(compact) == json.loads(indented)


# ----------------------------------------------------------------------- errors


def _without(key):
    return {k: v for k, v in INSTANCE.items() if k != key}


BAD_INPUTS = [
    # (input text, text the one-line error must contain)
    (_without("comm"), "comm: missing"),
    (_without("layers"), "layers: missing"),
    (dict(INSTANCE, layers=[]), "layers: must contain at least one unit"),
    (dict(INSTANCE, world_size="16"), "world_size: must be a positive integer"),
    (dict(INSTANCE, density=0), "density: must be positive"),
    (dict(INSTANCE, density=1.5), "density: must be in (0, 1]"),
    (dict(INSTANCE, forward_s=-1), "forward_s: must be non-negative"),
    (dict(INSTANCE, layers=[{"numel": 10, "backward_s": -0.1}]), "layers[0].backward_s"),
    (dict(INSTANCE, layers=[{"numel": 1.5, "backward_s": 0.1}]), "layers[0].numel"),
    (dict(INSTANCE, topk={"c0": 0, "c1": 0}), "topk.c2: missing"),
    ([INSTANCE, dict(INSTANCE, comm={"alpha_s": -1, "beta_s_per_byte": 0})], "[1].comm.alpha_s"),
    ([INSTANCE, 7], "[1]: an instance must be a JSON object"),
    ("{\"layers\": [", "invalid JSON"),
    ("", "invalid JSON"),
    ("42", "input: an instance must be a JSON object"),
    # valid numbers whose sums the planner cannot form (no traceback, no Infinity out)
    (dict(INSTANCE, layers=[{"numel": 2**52, "backward_s": 0.1}] * 2),
     "layers: the total numel must be below 2**53"),
    (dict(INSTANCE, comm={"alpha_s": 1e-4, "beta_s_per_byte": 1e308}),
     "comm: prices a group of all"),
    (dict(INSTANCE, topk={"c0": 0, "c1": 1e306, "c2": 0}), "topk: prices a group of all"),
    (dict(DENSE_INSTANCE, dense={"alpha_s": 0, "beta_s_per_byte": 1e305}),
     "dense: prices a group of all"),
    (dict(INSTANCE, layers=[{"numel": 10, "backward_s": 1e308}] * 2),
     "layers: the backward times' sum overflows"),
    # integers no float holds, written out: were OverflowError / ValueError tracebacks
    (dict(INSTANCE, comm={"alpha_s": 10**400, "beta_s_per_byte": 0}),
     "comm.alpha_s: must be a finite number, got an integer of 1329 bits"),
    (dict(INSTANCE, world_size=10**400), "world_size: must be a finite number"),
    ([INSTANCE, dict(INSTANCE, layers=[{"numel": 10, "backward_s": 10**400}])],
     "[1].layers[0].backward_s: must be a finite number"),
    (json.dumps(INSTANCE).replace('"world_size": 16', '"world_size": 1' + "0" * 5000),
     "invalid JSON: Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize("data, message", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, data, message):
    status, out, err = run_main(capsys, [write(tmp_path, data)])
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("omgs-plan: error: ")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strategy", "fastest"], "--strategy: unknown strategy 'fastest'; valid choices"),
        (["--strategy", "threshold:0"], "positive integer"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, message):
    status, out, err = run_main(capsys, [write(tmp_path, INSTANCE)] + argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("plot, message", [
    ("{dir}", "is a directory; give a file path"),
    ("{dir}/timeline", "must end in .png, .svg or .pdf"),
    ("", "--plot '': must end in .png, .svg or .pdf"),
])
def test_a_plot_path_matplotlib_would_not_write_as_given_exits_2(tmp_path, capsys, plot,
                                                                  message):
    """matplotlib saves a name without a suffix - a directory's too - as NAME.png: the
    plot went to a file beside the one named (exit 0), and an empty name drew nothing."""
    pytest.importorskip("matplotlib")
    plot = plot.format(dir=tmp_path)
    status, out, err = run_main(capsys, [write(tmp_path, INSTANCE), "--plot", plot])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(
        tmp_path.name)) == [tmp_path.name]  # no "<dir>.png" beside the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inst.json"]


def test_unreadable_file(tmp_path, capsys):
    status, _, err = run_main(capsys, [str(tmp_path / "missing.json")])
    assert status == 2 and "cannot read" in err and "missing.json" in err
    status, _, err = run_main(capsys, [write(tmp_path, "x", name="dir.json") + "/nested"])
    assert status == 2 and err.count("\n") == 1


def test_budget_warning_is_one_line_on_stderr(tmp_path, capsys, monkeypatch):
    from omgs_hook import planner

    monkeypatch.setattr(planner, "SEARCH_BUDGET", 3)
    monkeypatch.setattr(planner, "EXACT_UNITS", 0)  # the valve at every size
    status, out, err = run_main(capsys, [write(tmp_path, INSTANCE)])
    assert status == 0 and json.loads(out)["groups"]
    assert err.startswith("omgs-plan: warning: ") and err.count("\n") == 1


# ----------------------------------------------------------------------- process level


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_command_runs_without_importing_torch(tmp_path):
    path = write(tmp_path, [INSTANCE, DENSE_INSTANCE])
    probe = (
        "import sys, json, io, contextlib\n"
        "from omgs_hook import cli_plan\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    status = cli_plan.main([{path!r}])\n"
        "assert status == 0, status\n"
        "assert len(json.loads(out.getvalue())) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_module_entry_point_exit_status(tmp_path):
    good = subprocess.run(
        [sys.executable, "-m", "omgs_hook.cli_plan", write(tmp_path, INSTANCE)],
        capture_output=True, text=True, env=_env(), timeout=60,
    )
    assert good.returncode == 0 and set(json.loads(good.stdout)) == KEYS
    bad = subprocess.run(
        [sys.executable, "-m", "omgs_hook.cli_plan", "-"],
        input='{"layers": []}', capture_output=True, text=True, env=_env(), timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


# ------------------------------------------------------------------ two-level instances

TWO_LEVEL = dict(INSTANCE, world_size=8, hierarchy={
    "ranks_per_node": 4,
    "intra": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-11},
    "inter": {"alpha_s": 1e-4, "beta_s_per_byte": 8.5e-9}})


def test_two_level_instance(tmp_path, capsys):
    from omgs_hook.cost_model import step_inter_node_bytes
    from omgs_hook.planner import relaxed_lower_bound

    status, out, err = run_main(capsys, [write(tmp_path, TWO_LEVEL)])
    assert status == 0 and err == ""
    result = json.loads(out)
    assert set(result) == KEYS | {"inter_node_bytes", "lower_bound_s"}
    inst = Instance.from_dict(TWO_LEVEL)
    plan = make_plan(inst)
    assert {k: result[k] for k in KEYS} == plan.to_dict(include_dense=False)
    assert result["inter_node_bytes"] == step_inter_node_bytes(inst, plan.groups)
    assert result["lower_bound_s"] == relaxed_lower_bound(inst)
    assert result["lower_bound_s"] <= result["predicted_iteration_s"]
    # the flat instance of the same numbers predicts something else
    status, out, _ = run_main(capsys, [write(tmp_path, dict(INSTANCE, world_size=8))])
    assert json.loads(out)["predicted_iteration_s"] != result["predicted_iteration_s"]


@pytest.mark.parametrize("hierarchy, message", [
    ({"ranks_per_node": 3, "intra": {"alpha_s": 0, "beta_s_per_byte": 0},
      "inter": {"alpha_s": 0, "beta_s_per_byte": 0}},
     "hierarchy.ranks_per_node: world_size 8 is not divisible by ranks_per_node 3"),
    ({"ranks_per_node": 4, "intra": {"alpha_s": 0, "beta_s_per_byte": 0}},
     "hierarchy.inter: missing"),
])
def test_bad_two_level_instance_exits_2(tmp_path, capsys, hierarchy, message):
    status, out, err = run_main(capsys, [write(tmp_path, dict(TWO_LEVEL, hierarchy=hierarchy))])
    assert status == 2 and out == ""
    assert err.strip() == f"omgs-plan: error: {message}"


def test_documented_two_level_example_plans(tmp_path, capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "cost-model.md").read_text()
    start = text.index("<!-- two-level example -->")
    block = text[text.index("```json", start) + len("```json"):]
    example = json.loads(block[: block.index("```")])
    assert "hierarchy" in example
    status, out, err = run_main(capsys, [write(tmp_path, example)])
    assert status == 0 and err == ""
    assert "inter_node_bytes" in json.loads(out)


def test_a_reader_that_stops_early_ends_it_quietly(tmp_path):
    """`omgs-plan many.json | head -c 10`: no BrokenPipeError traceback, as Unix tools."""
    path = write(tmp_path, INSTANCE)
    # --indent 100000: about a megabyte of output, far more than a pipe buffers
    child = subprocess.Popen(
        [sys.executable, "-m", "omgs_hook.cli_plan", path, "--indent", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
    )
    try:
        assert child.stdout.read(10).startswith(b"{")
        child.stdout.close()  # as head does once it has its bytes
        err = child.stderr.read().decode()
        status = child.wait(timeout=60)
    finally:
        child.kill()
        child.stderr.close()
    assert err == "" and status == cli_plan.EXIT_BROKEN_PIPE == 1


# ------------------------------------------------- scripts/simulate.py, the offline sibling


@pytest.mark.parametrize("option, target, message", [
    ("--json", "adir", "--json .*adir: is a directory; give a file path"),
    ("--markdown", "adir", "--markdown .*adir: is a directory"),
    ("--json", "nodir/out.json", "--json .*out.json: the folder .*nodir does not exist"),
    ("--update-doc", "missing.md", "--update-doc .*missing.md: not a file"),
])
@pytest.mark.parametrize("topology", [[], ["--topology", "2x4"]])
def test_simulate_refuses_unwritable_outputs_before_simulating(tmp_path, capsys, option, target,
                                                                message, topology):
    from script_loader import load_script

    simulate = load_script("simulate")
    (tmp_path / "adir").mkdir()
    argv = ["--models", "vgg16", "--world-sizes", "4", option, str(tmp_path / target)]
    assert simulate.main(argv + topology) == 2  # was an IsADirectoryError traceback
    captured = capsys.readouterr()
    assert captured.out == ""  # up front: no report printed before the failure
    assert re.match(f"simulate: error: {message}", captured.err), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
