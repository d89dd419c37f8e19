"""omgs-profile end to end: real gloo ranks under torchrun write a loadable profile and a PNG."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omgs_hook import profile_run
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


def _check_document(document, world_size, reps):
    cpu = torch.device("cpu")
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["world_size"] == world_size
    assert (document["backend"], document["device"]) == ("gloo", "cpu")
    assert document["torch_version"] == torch.__version__
    assert "cupy_version" in document
    assert document["created"].endswith("+00:00")
    # the default top-k backend is the one the hook picks on this device
    assert document["topk"]["backend"] == get_selector("auto", cpu).name
    assert sorted(document["topk_all"]) == sorted(available_backends(cpu))
    sizes = document["settings"]["sizes_bytes"]
    for name, key in (("all_gather", "comm"), ("all_reduce", "dense")):
        rows = document["samples"][name]
        assert [r["bytes"] for r in rows] == sizes
        assert all(len(r["seconds"]) == reps and min(r["seconds"]) > 0 for r in rows)
        assert [p["bytes"] for p in document["fit_errors"][key]] == sizes
        assert set(document[key]) == {"alpha_s", "beta_s_per_byte"}
        # a collective costs something: the fitted line is positive at every size
        line = document[key]
        assert all(line["alpha_s"] + line["beta_s_per_byte"] * s > 0 for s in sizes)
        # the reported errors are those of the written fit against the median samples
        for row, point in zip(rows, document["fit_errors"][key]):
            assert point["median_s"] == pytest.approx(statistics.median(row["seconds"]))
            predicted = line["alpha_s"] + line["beta_s_per_byte"] * row["bytes"]
            assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)
    for backend, rows in document["samples"]["topk"].items():
        assert [r["numel"] for r in rows] == document["settings"]["topk_numel"]
        assert all(len(r["seconds"]) == reps for r in rows)
        assert len(document["fit_errors"]["topk"][backend]) == len(rows)
        c = document["topk_all"][backend]
        assert min(c.values()) >= 0
        for row, point in zip(rows, document["fit_errors"]["topk"][backend]):
            d = row["numel"]
            assert row["k"] == max(1, math.ceil(document["settings"]["topk_density"] * d))
            predicted = c["c0"] + c["c1"] * d + c["c2"] * d * math.log2(d)
            assert point["rel_error"] == pytest.approx(predicted / point["median_s"] - 1)


@pytest.mark.multiprocess
def test_two_rank_quick_profile_via_torchrun(tmp_path):
    out = tmp_path / "profile.json"
    result = _run(_torchrun(2, str(SCRIPT), "--quick", "--out", str(out)), cwd=tmp_path)
    document = json.loads(out.read_text())
    _check_document(document, world_size=2, reps=profile_run.QUICK_REPS)
    assert document["settings"]["sizes_bytes"] == list(profile_run.QUICK_SIZES)

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


@pytest.mark.multiprocess
def test_single_rank_without_launcher(tmp_path):
    out = tmp_path / "single.json"
    result = _run([sys.executable, str(SCRIPT), "--quick", "--no-plot", "--out", str(out)],
                  cwd=tmp_path)
    assert "single rank" in result.stderr
    assert load_profile(out).world_size == 1


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
    (["--topk-backends", "nonsense"], "nonsense cannot run on cpu"),
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
    assert profile_run.DEFAULT_SIZES[0] == 1024 and profile_run.DEFAULT_SIZES[-1] == 8 * 2**20
    assert all(size % 8 == 0 for size in profile_run.DEFAULT_SIZES)
    topk_sizes = profile_run.DEFAULT_TOPK_SIZES
    assert topk_sizes[0] == 1000 and topk_sizes[-1] == 4_000_000
    assert len(profile_run.DEFAULT_SIZES) == len(profile_run.DEFAULT_TOPK_SIZES) == 8
