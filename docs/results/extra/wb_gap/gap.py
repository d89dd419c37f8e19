"""Where does layerwise's predicted step miss? 2 gloo ranks on loopback, ResNet-20,
one bucket per parameter, select=model. Per step (rank 0): the send windows the meter
excludes from backward, against the model's compute-side per-group work."""
import os, sys, time, json, statistics
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def run(rank, world, strategy, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import omgs_hook
    from omgs_hook import measurements, cost_model
    from omgs_hook.examples.models import build_model
    torch.manual_seed(0)
    model = build_model("resnet20")
    ddp = DDP(model, bucket_cap_mb=0, broadcast_buffers=False)
    state = omgs_hook.register(ddp, density=0.001, strategy=strategy, select="model",
                               allow_dense=False, warmup_steps=5, replan_every=1000)
    windows = []
    orig = measurements.BackwardMeter.end_step
    def end_step(self, layout, step=None):
        windows.append(sum(b - a for a, b in zip(self._send_start, self._send_end)))
        return orig(self, layout, step)
    measurements.BackwardMeter.end_step = end_step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 3, 32, 32); y = torch.randint(0, 10, (32,))
    rows = []
    for s in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        last = state.stats()["last"]
        rows.append((time.perf_counter() - t0, last.get("hook_s"), last.get("topk_s")))
    inst = state.measured_instance()
    st = state.stats()
    if rank == 0:
        plan = st.get("plan") or {}
        groups = state._plan.groups if hasattr(state, "_plan") else None
        res = {"strategy": strategy, "model_check": st.get("model_check"),
               "planned_with": st.get("planned_with"),
               "rows": rows[-20:], "windows": windows[-20:]}
        # the model's compute-side per-group work for the plan in use
        try:
            groups = st["plan"]["groups"]
        except Exception:
            groups = None
        res["groups"] = groups
        if groups:
            numels = [sum(inst.layers[u].numel for u in g) for g in groups]
            res["model_group_work_s"] = sum(inst.topk_time(n) for n in numels)
            tl = cost_model.simulate(inst, groups)
            res["predicted_s"] = tl.predicted_iteration_s
            res["backward_s"] = sum(l.backward_s for l in inst.layers)
            res["forward_s"] = inst.forward_s; res["tail_s"] = inst.tail_s
            res["compute_end_s"] = tl.compute_end_s; res["comm_end_s"] = tl.comm_end_s
        json.dump(res, open(out, "w"), default=str)
    dist.barrier(); state.close()
    import gc; del ddp, state; gc.collect()  # no DDP model alive at destroy (gloo aborts)
    dist.destroy_process_group()

if __name__ == "__main__":
    strategy, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(run, args=(2, strategy, steps, out), nprocs=2, join=True)
