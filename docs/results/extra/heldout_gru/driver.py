#!/usr/bin/env python
"""Driver: builds the emulated cluster, profiles, runs variants interleaved. Raw output -> raw/ beside this file."""
import argparse, json, os, sys, time, statistics
sys.path.append("/work/main/scripts")
from netem_cluster import Cluster  # noqa: E402

PY = "/work/main/.venv/bin/python"
HERE = os.path.dirname(os.path.abspath(__file__))  # raw output: raw/ beside this file
TRAIN = os.path.join(HERE, "train_heldout.py")
PROFILE = "/work/main/scripts/profile.py"


def run(cluster, argv, name, timeout):
    t0 = time.time()
    res = cluster.run_ranks(argv, timeout=timeout, cwd=HERE)
    with open(os.path.join(HERE, "raw", name + ".log"), "w") as f:
        for r in range(len(res.returncodes)):
            f.write(f"===== rank {r} rc={res.returncodes[r]} =====\n--- stdout\n{res.stdout[r]}\n--- stderr\n{res.stderr[r]}\n")
    if not res.ok:
        print(f"[{name}] FAILED: {res.summary()}", flush=True)
        return None
    line = [l for l in res.stdout[0].splitlines() if l.startswith("RESULT_JSON ")]
    d = json.loads(line[-1].split(" ", 1)[1]) if line else None
    if d is not None:
        with open(os.path.join(HERE, "raw", name + ".json"), "w") as f:
            json.dump(d, f, indent=1)
        print(f"[{name}] {time.time()-t0:.0f}s median {d['median_step_s']:.4f} (window from {d['window_start']}, "
              f"{d['window_steps']} steps) after100 {d['median_step_s_after100']}", flush=True)
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["calib", "bench"])
    ap.add_argument("--rate", required=True)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=170)
    ap.add_argument("--ar-steps", type=int, default=60)
    ap.add_argument("--cap", default="0.4")
    ap.add_argument("--profile-budget", default="40")
    ap.add_argument("--variants", default="allreduce,default,sparse_model,topk,lags,topk_again")
    ap.add_argument("--nodes", type=int, default=4, help="ranks (one per namespace)")
    ap.add_argument("--window-start", type=int, default=100,
                    help="first timed step of the hook's variants (after the trial)")
    args = ap.parse_args()
    # (a run with other than 4 ranks tags its files with the rank count)
    nodes_tag = "" if args.nodes == 4 else f"n{args.nodes}_"
    with Cluster(nodes=args.nodes, rate=args.rate) as cl:
        tp = cl.measure_throughput(0, 1, seconds=1.0)
        print(f"throughput 0->1: {tp.bits_per_s/1e6:.1f} Mbit/s", flush=True)
        if args.mode == "calib":
            for v in ("compute", "allreduce"):
                run(cl, [PY, TRAIN, "--variant", v, "--steps", "40", "--window-start", "10",
                         "--bucket-cap-mb", args.cap], f"calib_{nodes_tag}{args.rate}_{v}", 300)
            return
        tag = f"{nodes_tag}{args.rate}_d{args.density}"
        prof = os.path.join(HERE, f"profile_{tag}.json")
        if not os.path.exists(prof):
            t0 = time.time()
            res = cl.run_ranks([PY, PROFILE, "--density", str(args.density), "--out", prof,
                                "--time-budget", args.profile_budget, "--max-topk-size", "2000000",
                                "--no-plot", "--no-progress"], timeout=400, cwd=HERE)
            with open(os.path.join(HERE, "raw", f"profile_{tag}.log"), "w") as f:
                for r in range(args.nodes):
                    f.write(f"== rank {r} rc={res.returncodes[r]}\n{res.stdout[r]}\n{res.stderr[r]}\n")
            print(f"profile: {res.summary()} in {time.time()-t0:.0f}s", flush=True)
            res.check()
        variants = args.variants.split(",")
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for v in order:
                real = "topk" if v == "topk_again" else v
                steps, ws = ((args.ar_steps, 20) if v == "allreduce"
                             else (args.steps, args.window_start))
                argv = [PY, TRAIN, "--variant", real, "--density", str(args.density),
                        "--steps", str(steps), "--window-start", str(ws), "--bucket-cap-mb", args.cap,
                        "--tag", v]
                if real != "allreduce":
                    argv += ["--profile", prof]
                run(cl, argv, f"{tag}_r{rnd}_{v}", 400)


if __name__ == "__main__":
    main()
