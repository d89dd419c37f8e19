#!/usr/bin/env python
"""Convergence study: does OMGS-SGD train as well as dense all-reduce?

ResNet-20 (``omgs_hook.examples.models.resnet20``) is trained on the real scikit-learn
digits data set (1,438 training / 359 test images, upsampled to 16x16) for a fixed number
of epochs on 2 ranks, once per (configuration, seed)::

    allreduce      DDP's dense all-reduce (the reference)
    omgs:0.001     OMGS-SGD hook at density 0.001 (the paper's setting)
    omgs:0.01      OMGS-SGD hook at density 0.01
    omgs:0.001@88  (optional) the same with a density warm-up over 88 steps after the
                   dense warm-up (``--density-warmup-steps``: DGC's exponential ramp
                   from 0.25 down to the density) - a change of the algorithm, reported
                   beside the plain runs, never instead of them

Every run is ``scripts/train.py`` under ``torchrun --standalone --nproc_per_node=2`` with
exactly the same options except ``--hook``/``--density``: same seed (model
initialisation, data order, dropout), same learning-rate schedule (linear warm-up, then
cosine to zero at the last epoch), same batch size; each run's ``--log-file`` JSON lines
(one line per step with the training loss, one per epoch with test accuracy and loss)
are read back. Nothing is tuned for one side: a configuration gets no option the
reference does not get.

Outputs: ``--results`` (JSON: every run's per-step losses, per-epoch evaluations and
summary; runs of the same (configuration, seed) are replaced, others kept, so seeds
can be added later), the generated section of ``--doc`` (final accuracy per seed,
mean and spread, difference to allreduce, the 1-percentage-point target) and
``--plot`` (training loss and test accuracy per epoch, mean over seeds with the
min-max band).

Usage::

    python scripts/convergence.py                        # 3 configs x 3 seeds, ~10 min
    python scripts/convergence.py --seeds 3,4 --epochs 20
    python scripts/convergence.py --report-only          # re-render doc + plot
    python scripts/convergence.py --quick --results /tmp/c.json --doc /tmp/c.md \
        --plot /tmp/c.png                                # smoke run

Options after ``--`` are passed to every ``train.py`` run unchanged (e.g.
``-- --batch-size 64``), so both sides always see them.

The cost model (``--profile``): the OMGS hook may send a group as a dense all-reduce
where its cost model says that is cheaper. Planned with the hook's default profile (a
1 GbE network) for a CPU-computed ResNet-20, almost every group would go dense - the
network is fast compared with a CPU, so the study would compare all-reduce with
all-reduce. The OMGS runs therefore plan with the profile measured on the emulated
ResNet-20 cluster of the benchmark (``docs/results/profile_resnet20_n2_d0.001.json``,
written by ``scripts/bench_cluster.py``): the plans are those the hook makes where it
pays, and the table reports the density each run really sent. ``--profile default``
uses the hook's default profile instead. The profile changes nothing but the plan (which
groups, dense or sparse); allreduce has no plan.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# scripts/profile.py would shadow the standard library's `profile` for anything that
# imports cProfile; this script needs nothing from its own folder.
_SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _SCRIPT_DIR]

from omgs_hook.cli_types import integer_at_least  # noqa: E402  (after the sys.path fix)
from omgs_hook.generated_docs import write_generated_section  # noqa: E402

REPO_ROOT = os.path.dirname(_SCRIPT_DIR)
TRAIN_SCRIPT = os.path.join(_SCRIPT_DIR, "train.py")
DEFAULT_PROFILE = os.path.join(REPO_ROOT, "docs", "results", "profile_resnet20_n2_d0.001.json")

DEFAULT_CONFIGS = ("allreduce", "omgs:0.001", "omgs:0.01")
REFERENCE = "allreduce"
COMPRESSING_HOOKS = ("omgs", "topk", "lags")
TARGET_GAP_PP = 1.0  # final accuracy within this many percentage points of allreduce
RESULTS_KIND = "omgs-convergence"


def parse_config(text):
    """``"allreduce"`` or ``"HOOK:DENSITY[@W]"`` -> (normalised name, hook, density or None,
    density warm-up steps). ``@W`` runs the hook with ``--density-warmup-steps W``."""
    text = text.strip()
    text, _, warmup_text = text.partition("@")
    hook, _, density_text = text.partition(":")
    if hook == REFERENCE:
        if density_text or warmup_text:
            raise ValueError(f"config {text!r}: allreduce takes no density")
        return REFERENCE, REFERENCE, None, 0
    if hook not in COMPRESSING_HOOKS:
        raise ValueError(f"config {text!r}: unknown hook {hook!r}; valid: {REFERENCE}, "
                         + ", ".join(f"{h}:DENSITY" for h in COMPRESSING_HOOKS))
    try:
        density = float(density_text)
    except ValueError:
        raise ValueError(f"config {text!r}: {hook} needs a density, e.g. {hook}:0.001") from None
    if not 0.0 < density <= 1.0:
        raise ValueError(f"config {text!r}: density must be in (0, 1], got {density}")
    if not warmup_text:
        return f"{hook}:{density:g}", hook, density, 0
    try:
        warmup = int(warmup_text)
    except ValueError:
        warmup = -1
    if warmup < 1:
        raise ValueError(f"config {text}@{warmup_text}: the density warm-up after '@' must be "
                         "a positive number of steps")
    return f"{hook}:{density:g}@{warmup}", hook, density, warmup


def _configs(text):
    try:
        configs = [parse_config(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not configs:
        raise argparse.ArgumentTypeError("no configurations given")
    return list({c[0]: c for c in configs}.values())


def _seeds(text):
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return list(dict.fromkeys(seeds))


_positive_int = integer_at_least(1)


def build_parser():
    parser = argparse.ArgumentParser(
        description="ResNet-20 on digits, allreduce vs OMGS: final accuracy and loss curves "
                    "(see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--configs", type=_configs, default=_configs(",".join(DEFAULT_CONFIGS)),
        help="comma separated: allreduce, omgs:DENSITY, topk:DENSITY, lags:DENSITY")
    add("--seeds", type=_seeds, default=[0, 1, 2])
    add("--epochs", type=_positive_int, default=20)
    add("--nproc", type=_positive_int, default=2, help="ranks (torchrun --nproc_per_node)")
    add("--model", default="resnet20", help="train.py --model")
    add("--profile", default=DEFAULT_PROFILE,
        help="cost-model profile for the compressing hooks' planner ('default': the hook's "
             "built-in 1 GbE profile); see the module docstring")
    add("--results", default=os.path.join(REPO_ROOT, "docs", "results", "convergence.json"))
    add("--doc", default=os.path.join(REPO_ROOT, "docs", "convergence.md"))
    add("--plot", default=os.path.join(REPO_ROOT, "docs", "convergence.png"))
    add("--report-only", action="store_true", help="re-render --doc and --plot from --results")
    add("--quick", action="store_true",
        help="smoke run: 1 epoch, seed 0, allreduce and omgs:0.01")
    add("--timeout", type=float, default=1800.0, help="seconds one training run may take")
    add("train_args", nargs=argparse.REMAINDER,
        help="-- followed by options passed to every train.py run")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    reserved = {"--hook", "--density", "--seed", "--epochs", "--log-file", "--log", "--model",
                "--steps", "--profile"}
    clash = [a for a in args.train_args if a.split("=")[0] in reserved]
    if clash:
        parser.error(f"options {', '.join(clash)} are set by convergence.py itself")
    if args.profile == "default":
        args.profile = None
    elif not args.report_only:
        if not os.path.exists(args.profile):
            parser.error(f"--profile {args.profile}: no such file (run scripts/bench_cluster.py "
                         f"first, give another profile, or pass --profile default)")
        from omgs_hook.profile_file import ProfileError, load_profile

        try:
            load_profile(args.profile)
        except ProfileError as exc:
            parser.error(f"--profile: {exc}")
        args.profile = os.path.abspath(args.profile)
    if args.quick:
        args.epochs, args.seeds = 1, [0]
        args.configs = _configs("allreduce,omgs:0.01")
    return args


# =====================================================================================
# running train.py
# =====================================================================================


def train_command(hook, density, seed, epochs, log_path, args, density_warmup=0):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", TRAIN_SCRIPT, "--model", args.model,
               "--hook", hook, "--epochs", str(epochs), "--seed", str(seed),
               "--log-file", log_path, "--no-progress"]
    if density is not None:
        command += ["--density", repr(density)]
    if density_warmup:
        command += ["--density-warmup-steps", str(density_warmup)]
    if hook in COMPRESSING_HOOKS and args.profile is not None:
        command += ["--profile", args.profile]
    return command + list(args.train_args)


def read_log(path):
    """Split a train.py JSON-lines log into (steps, evaluations, summary)."""
    steps, evaluations, summary = [], [], None
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if record.get("summary"):
                summary = record
            elif "test_accuracy" in record:
                evaluations.append(record)
            elif "loss" in record:
                steps.append(record)
    if summary is None:
        raise ValueError(f"{path}: no summary line (did the run finish?)")
    return steps, evaluations, summary


def run_one(name, hook, density, seed, args, workdir, density_warmup=0):
    log_path = os.path.join(workdir, f"{name.replace(':', '_').replace('@', '_w')}_seed{seed}.jsonl")
    command = train_command(hook, density, seed, args.epochs, log_path, args, density_warmup)
    print(f"convergence: {name} seed {seed}: {' '.join(command[3:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"convergence: {name} seed {seed} failed (exit {proc.returncode}):\n"
                         + proc.stdout[-4000:])
    steps, evaluations, summary = read_log(log_path)
    hook_stats = summary.get("hook_stats") or {}
    plan = hook_stats.get("plan") or {}
    total = hook_stats.get("total") or {}
    last = hook_stats.get("last") or {}
    return {
        "config": name, "hook": hook, "density": density, "density_warmup_steps": density_warmup,
        "seed": seed, "epochs": args.epochs,
        "profile": None if hook not in COMPRESSING_HOOKS else (
            os.path.relpath(args.profile, REPO_ROOT) if args.profile else "default"),
        "nproc": args.nproc, "model": args.model, "train_args": list(args.train_args),
        "wall_s": elapsed,
        "step_loss": [float(f"{s['loss']:.5g}") for s in steps],  # 5 digits keep the file small
        "step_epoch": [s["epoch"] for s in steps],
        "evaluations": [{"epoch": e["epoch"], "step": e["step"],
                         "test_accuracy": e["test_accuracy"], "test_loss": e["test_loss"]}
                        for e in evaluations],
        "final_test_accuracy": summary["test_accuracy"],
        "final_test_loss": summary["test_loss"],
        "bytes_sent_per_step": summary.get("bytes_sent_per_step"),
        "median_iter_s": summary.get("median_iter_s"),
        "plan_groups": len(plan.get("groups") or []) or None,
        "achieved_density": total.get("density"),  # dense warm-up steps included
        "last_step_density": last.get("density"),
        "nonfinite_steps": total.get("nonfinite_steps"),
        # every plan the run used (train.py's summary): the grouping changes the math
        "plan_history": [_plan_entry(e) for e in summary.get("plan_history") or []],
    }


def _plan_entry(entry):
    """A plan-history entry, compact: first step, strategy, reason, group sizes in
    buckets, dense flags."""
    plan = entry.get("plan") if isinstance(entry.get("plan"), dict) else entry
    groups = plan.get("groups") or []
    return {"step": entry.get("step", plan.get("made_at_step")),
            "strategy": plan.get("strategy"), "reason": entry.get("reason"),
            "group_sizes": [len(g) if isinstance(g, (list, tuple)) else g for g in groups],
            "dense": [bool(d) for d in plan.get("dense") or []]}


def load_results(path):
    if not os.path.exists(path):
        return {"kind": RESULTS_KIND, "version": 1, "runs": []}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if data.get("kind") != RESULTS_KIND:
        raise SystemExit(f"convergence: {path} is not a convergence results file")
    return data


def save_results(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, separators=(",", ":"))
    os.replace(tmp, path)


def merge_run(data, run):
    """Replace the run of the same (config, seed, epochs), keep every other."""
    key = (run["config"], run["seed"], run["epochs"])
    data["runs"] = [r for r in data["runs"] if (r["config"], r["seed"], r["epochs"]) != key]
    data["runs"].append(run)


# =====================================================================================
# analysis and report
# =====================================================================================


def epoch_curves(run):
    """Per epoch: mean training loss of its steps, test accuracy and loss at its end."""
    by_epoch = {}
    for loss, epoch in zip(run["step_loss"], run["step_epoch"]):
        by_epoch.setdefault(int(epoch), []).append(loss)
    train = [statistics.fmean(by_epoch[e]) for e in sorted(by_epoch)]
    evals = sorted(run["evaluations"], key=lambda e: e["step"])
    return {"train_loss": train,
            "test_accuracy": [e["test_accuracy"] for e in evals],
            "test_loss": [e["test_loss"] for e in evals]}


def summarise(runs, epochs):
    """Per configuration: seeds, final accuracies, mean/std, paired gap to allreduce."""
    runs = [r for r in runs if r["epochs"] == epochs]
    configs = {}
    for run in runs:
        configs.setdefault(run["config"], []).append(run)
    reference = {r["seed"]: r["final_test_accuracy"] for r in configs.get(REFERENCE, [])}
    reference_mean = statistics.fmean(reference.values()) if reference else None
    rows = []
    for name, group in configs.items():
        group.sort(key=lambda r: r["seed"])
        accuracy = [r["final_test_accuracy"] for r in group]
        paired = [r["final_test_accuracy"] - reference[r["seed"]] for r in group
                  if r["seed"] in reference]
        mean = statistics.fmean(accuracy)
        rows.append({
            "config": name,
            "seeds": [r["seed"] for r in group],
            "accuracy": accuracy,
            "mean_accuracy": mean,
            "std_accuracy": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
            "mean_test_loss": statistics.fmean(r["final_test_loss"] for r in group),
            "gap_pp": None if reference_mean is None else 100 * (mean - reference_mean),
            "paired_gaps_pp": [100 * g for g in paired],
            "bytes_sent_per_step": statistics.fmean(
                r["bytes_sent_per_step"] for r in group if r["bytes_sent_per_step"] is not None)
            if any(r["bytes_sent_per_step"] is not None for r in group) else None,
            "median_iter_s": statistics.median(r["median_iter_s"] for r in group
                                               if r["median_iter_s"] is not None)
            if any(r["median_iter_s"] is not None for r in group) else None,
            "nonfinite_steps": sum(r.get("nonfinite_steps") or 0 for r in group),
            "last_step_density": [r.get("last_step_density") for r in group],
            "plan_groups": [r.get("plan_groups") for r in group],
            "profile": group[0].get("profile"),
        })
    order = {REFERENCE: 0}
    rows.sort(key=lambda row: (order.get(row["config"], 1), row["config"]))
    return rows


def target_met(row):
    """OMGS's mean final accuracy at most TARGET_GAP_PP below allreduce's (better is fine)."""
    return row["gap_pp"] is not None and row["gap_pp"] >= -TARGET_GAP_PP


def epoch_counts(data):
    """The schedule lengths (epochs) that have runs, ascending."""
    return sorted({r["epochs"] for r in data["runs"]})


def render(data, plot_name):
    """The generated Markdown: the plot, then one table per schedule length."""
    if not data["runs"]:
        return "_No convergence results yet: run `python scripts/convergence.py`._\n"
    sections = [f"![loss and accuracy curves]({plot_name})\n"]
    for epochs in epoch_counts(data):
        sections.append(render_epochs(data, epochs))
    return "\n".join(sections)


def render_epochs(data, epochs):
    runs = [r for r in data["runs"] if r["epochs"] == epochs]
    rows = summarise(runs, epochs)
    first = runs[0]
    out = [f"### {epochs} epochs\n",
           f"{first['model']} on digits, {first['nproc']} ranks, {epochs} epochs"
           + (f", extra train.py options `{' '.join(first['train_args'])}`"
              if first["train_args"] else ", train.py defaults otherwise")
           + ". Accuracy is on the 359 held-out test images (one image = 0.28 percentage "
             "points).\n",
           "| configuration | seeds | final test accuracy per seed (%) | mean (std) | "
           "gap to allreduce | paired gaps per seed (pp) | final test loss | "
           "density sent (last step) | groups | sent per step (mean over run) | "
           "target (within 1 pp) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        per_seed = ", ".join(f"{100 * a:.2f}" for a in row["accuracy"])
        paired = ", ".join(f"{g:+.2f}" for g in row["paired_gaps_pp"]) \
            if row["config"] != REFERENCE else "-"
        gap = "-" if row["config"] == REFERENCE or row["gap_pp"] is None \
            else f"{row['gap_pp']:+.2f} pp"
        verdict = "-" if row["config"] == REFERENCE else \
            ("met" if target_met(row) else "**missed**")
        sent = row["bytes_sent_per_step"]
        densities = [d for d in row["last_step_density"] if d is not None]
        density = "-" if not densities else \
            f"{min(densities):.4g}" + ("" if max(densities) == min(densities)
                                       else f"-{max(densities):.4g}")
        groups = sorted({g for g in row["plan_groups"] if g})
        out.append(
            f"| {row['config']} | {', '.join(map(str, row['seeds']))} | {per_seed} | "
            f"{100 * row['mean_accuracy']:.2f} ({100 * row['std_accuracy']:.2f}) | {gap} | "
            f"{paired} | {row['mean_test_loss']:.4f} | {density} | "
            f"{', '.join(map(str, groups)) or '-'} | "
            f"{'-' if sent is None else f'{sent / 1e3:.1f} kB'} | {verdict} |")
    out.append("")
    planned = [r for r in runs if r.get("plan_history")]
    if planned:
        out.append("Plans each run used (first step: strategy, groups of buckets, dense "
                   "groups, how it was chosen); a run is reproducible bit for bit on the same "
                   "machine when its plan is pinned (`--plan`, the hook's `plan=`):\n")
        for run in sorted(planned, key=lambda r: (r["config"], r["seed"])):
            steps = "; ".join(
                f"step {e['step']}: {e['strategy']} {len(e['group_sizes'])} groups"
                f" ({sum(e['dense'])} dense, {e['reason']})" for e in run["plan_history"])
            out.append(f"- {run['config']} seed {run['seed']}: {steps}")
        out.append("")
    profiles = {}
    for run in runs:
        costs = run.get("profile_costs")
        if costs:
            profiles[(costs["path"], costs.get("created"))] = costs
    for (path, created), costs in sorted(profiles.items(), key=lambda item: str(item[0])):
        comm, dense = costs.get("comm") or {}, costs.get("dense") or {}
        out.append(f"Compressing hooks planned with profile `{path}` as measured {created}: "
                   f"all-gather alpha {1e3 * comm.get('alpha_s', float('nan')):.3g} ms, "
                   f"beta {1e9 * comm.get('beta_s_per_byte', float('nan')):.3g} ns/B; "
                   f"all-reduce alpha {1e3 * dense.get('alpha_s', float('nan')):.3g} ms, "
                   f"beta {1e9 * dense.get('beta_s_per_byte', float('nan')):.3g} ns/B.\n")
    return "\n".join(out) + "\n"


def plot(data, path):
    """One row of panels (training loss, test loss, test accuracy) per schedule length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = epoch_counts(data)
    fig, grid = plt.subplots(len(counts), 3, figsize=(16, 4.6 * len(counts)), squeeze=False)
    panels = (("train_loss", "training loss (epoch mean)", True),
              ("test_loss", "test loss", True),
              ("test_accuracy", "test accuracy", False))
    palette = {}
    for axes, epochs in zip(grid, counts):
        plot_row(data, epochs, axes, panels, palette)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_row(data, epochs, axes, panels, palette):
    import numpy as np

    configs = {}
    for run in data["runs"]:
        if run["epochs"] == epochs:
            configs.setdefault(run["config"], []).append(epoch_curves(run))
    colors = ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for name in sorted(configs, key=lambda c: (c != REFERENCE, c)):
        # the same configuration keeps its colour in every row
        color = palette.setdefault(name, colors[len(palette) % len(colors)])
        curves = configs[name]
        for ax, (key, title, log) in zip(axes, panels):
            length = min(len(c[key]) for c in curves)
            if length == 0:
                continue
            table = np.array([c[key][:length] for c in curves])
            x = np.arange(1, length + 1)
            ax.plot(x, table.mean(axis=0), color=color,
                    label=f"{name} (mean of {len(curves)} seeds)")
            ax.fill_between(x, table.min(axis=0), table.max(axis=0), color=color, alpha=0.2)
            ax.set_title(f"{title}, {epochs}-epoch schedule")
            ax.set_xlabel("epoch")
            if log:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[2].set_ylim(0.8, 1.0)
    axes[2].legend(fontsize=8, loc="lower right")


def write_doc(path, generated):
    """Rewrite the generated section of ``path`` (see :mod:`omgs_hook.generated_docs`)."""
    write_generated_section(path, generated, "scripts/convergence.py",
                            "Convergence: OMGS-SGD against dense all-reduce")


def report(args, data):
    plot_name = os.path.relpath(os.path.abspath(args.plot),
                                os.path.dirname(os.path.abspath(args.doc)))
    write_doc(args.doc, render(data, plot_name))
    if data["runs"]:
        plot(data, args.plot)
    for epochs in epoch_counts(data):
        for row in summarise(data["runs"], epochs):
            gap = "" if row["gap_pp"] is None or row["config"] == REFERENCE else \
                f", gap {row['gap_pp']:+.2f} pp"
            print(f"convergence: {epochs} epochs, {row['config']}: final accuracy "
                  f"{100 * row['mean_accuracy']:.2f}% (std {100 * row['std_accuracy']:.2f}, "
                  f"seeds {row['seeds']}){gap}", flush=True)


def profile_record(path):
    """The cost figures of the profile file the compressing hooks plan with (or None)."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    return {"path": os.path.relpath(path, REPO_ROOT), "created": document.get("created"),
            **{key: document.get(key) for key in ("world_size", "comm", "dense", "topk")}}


def main(argv=None):
    args = parse_args(argv)
    data = load_results(args.results)
    if not args.report_only:
        # the file may be re-measured later: every run keeps the figures it planned with
        record = profile_record(args.profile)
        with tempfile.TemporaryDirectory(prefix="omgs-convergence-") as workdir:
            # seed-major order: a slow drift of the machine hits every configuration alike
            for seed in args.seeds:
                for name, hook, density, density_warmup in args.configs:
                    run = run_one(name, hook, density, seed, args, workdir, density_warmup)
                    if hook in COMPRESSING_HOOKS:
                        run["profile_costs"] = record
                    merge_run(data, run)
                    save_results(args.results, data)  # keep finished runs if a later one fails
    report(args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
