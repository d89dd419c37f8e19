"""A model with a zero-element parameter (its own DDP bucket with bucket_cap_mb=0) trains
under the hook, and the reports work whatever plan holds that bucket: a group of zero
elements (layerwise, or the trial's all-dense and layerwise candidates) made
``summary()`` raise ``ValueError: math domain error`` (log2 of 0 in the top-k cost),
while the model itself prices an empty bucket as one element."""

import pytest
import torch
import torch.nn as nn

from ddp_harness import run_ranks

pytestmark = pytest.mark.multiprocess


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.empty = nn.Parameter(torch.zeros(0))
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.empty.sum()


def reports_worker(rank, world_size, out_dir):
    import omgs_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = WithEmpty()
    ddp = DDP(model, bucket_cap_mb=0)
    state = omgs_hook.register(ddp, density=0.05, strategy="layerwise", select="model",
                               warmup_steps=2, log_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    plan = state.stats()["plan"]
    text = state.summary()
    state.plot_timeline(f"{out_dir}/timeline{rank}.png")
    state.close()
    return plan, text


@pytest.mark.timeout(120)
def test_summary_with_a_group_of_zero_elements(tmp_path):
    for plan, text in run_ranks("test_zero_element_reports", "reports_worker",
                                world_size=2, timeout=100, out_dir=str(tmp_path)):
        assert ["empty"] in plan["group_keys"], plan  # the empty bucket is a group of its own
        assert " 0 elements" in text, text
