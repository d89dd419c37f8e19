#!/usr/bin/env python3
"""Generate the layer profiles in src/omgs_hook/data/ (ResNet-50, VGG-16, Inception-v3).

A layer profile lists, in gradient-ready order (the order backward produces them), every
layer that has parameters, with

* ``numel``: its number of parameters - EXACT, counted from the torch module
  definitions below (written here from the papers; torchvision is not used). The totals
  are checked against the published counts: ResNet-50 25,557,032, VGG-16 138,357,544,
  Inception-v3 without the auxiliary classifier 23,834,568.
* ``backward_s``: the time from the previous layer's gradient being ready to this
  layer's gradient being ready - an ESTIMATE for a V100-class GPU (below).

Timing model (a roofline estimate, stated so that it can be challenged):

* The network is traced on the ``meta`` device (shapes only, no arithmetic) with one
  forward hook per leaf module, which records every operation with its input and
  output shapes in execution order.
* Each operation costs ``max(flops / FLOPS, bytes / BANDWIDTH) + kernels * LAUNCH_S``
  per pass, with FLOPS = 10 TFLOP/s (64% of a Tesla V100's 15.7 TFLOP/s fp32 peak, what
  cuDNN convolutions typically reach), BANDWIDTH = 700 GB/s (78% of its 900 GB/s HBM2)
  and LAUNCH_S = 5 us per kernel. Calibration check: ResNet-50 then trains at about
  290 images/s (0.221 s per batch of 64), somewhat below the roughly 350-400 images/s
  that tuned fp32 V100 benchmarks report - the estimate errs on the slow side.
* Convolution and linear layers: forward 2*MACs FLOPs; backward twice that (gradient of
  the input and of the weight), except the first layer, which needs no input gradient.
  Batch norm, ReLU, pooling, dropout, residual add and concatenation are memory-bound:
  their cost is the bytes they read and write (counts per op below).
* Backward runs the operations in reverse forward order. The backward time of
  parameter-free operations (ReLU, pooling, ...) is charged to the next layer whose
  gradient becomes ready after them, so the per-layer ``backward_s`` sum to the whole
  backward pass. ``forward_s`` is the sum of the forward costs.
* Batch size 64 per GPU, fp32, ImageNet resolution (224x224; 299x299 for Inception).

Usage::

    python scripts/make_layer_profiles.py                 # rewrite src/omgs_hook/data/*.json
    python scripts/make_layer_profiles.py --check         # verify the shipped files are current
"""

import argparse
import json
import os
import sys
from pathlib import Path

# Running a file from scripts/ puts that folder first on sys.path, where scripts/profile.py
# shadows the standard library's `profile` (imported by cProfile, which torch's meta-device
# batch norm pulls in). This script imports nothing from scripts/, so drop the entry.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

DATA_DIR = Path(__file__).resolve().parents[1] / "src" / "omgs_hook" / "data"

GPU = "NVIDIA Tesla V100-class GPU, fp32"
FLOPS = 10e12  # achieved FLOP/s for convolutions and matrix products
BANDWIDTH = 700e9  # achieved bytes/s for memory-bound operations
LAUNCH_S = 5e-6  # per kernel launch
BATCH_SIZE = 64
FLOAT_BYTES = 4

# published parameter counts the definitions below must reproduce
EXPECTED_NUMEL = {"resnet50": 25_557_032, "vgg16": 138_357_544, "inception_v3": 23_834_568}


# ------------------------------------------------------------------ model definitions


class Add(nn.Module):
    """Residual addition as a module, so the tracer sees (and times) it."""

    def forward(self, a, b):
        return a + b


class Concat(nn.Module):
    """Channel concatenation as a module, so the tracer sees (and times) it."""

    def forward(self, *tensors):
        return torch.cat(tensors, dim=1)


class Bottleneck(nn.Module):
    """ResNet-50 bottleneck: 1x1 reduce, 3x3 (carrying the stride), 1x1 expand (x4)."""

    def __init__(self, in_channels, width, stride):
        super().__init__()
        out_channels = 4 * width
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride,
                                                      bias=False), nn.BatchNorm2d(out_channels))
        self.add = Add()
        self.relu3 = nn.ReLU()

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu3(self.add(out, shortcut))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016, table 1): stages of 3, 4, 6, 3 bottlenecks."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, channels = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(channels, width, stride if i == 0 else 1))
                channels = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(self.flatten(self.pool(self.blocks(self.stem(x)))))


class VGG16(nn.Module):
    """VGG-16, configuration D of Simonyan & Zisserman (2015), without batch norm."""

    LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M")

    def __init__(self, num_classes=1000):
        super().__init__()
        layers, channels = [], 3
        for item in self.LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1), nn.ReLU()]
                channels = item
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, num_classes))

    def forward(self, x):
        return self.classifier(self.flatten(self.features(x)))


class ConvBN(nn.Sequential):
    """Inception's basic unit: convolution without bias, batch norm (eps 1e-3), ReLU."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__(nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding,
                                   bias=False),
                         nn.BatchNorm2d(out_channels, eps=1e-3), nn.ReLU())


class Branches(nn.Module):
    """Runs parallel branches on the same input and concatenates their outputs."""

    def __init__(self, *branches):
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.concat = Concat()

    def forward(self, x):
        return self.concat(*(branch(x) for branch in self.branches))


def _pool_branch(in_channels, out_channels):
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), ConvBN(in_channels, out_channels, 1))


def inception_a(in_channels, pool_features):
    return Branches(
        ConvBN(in_channels, 64, 1),
        nn.Sequential(ConvBN(in_channels, 48, 1), ConvBN(48, 64, 5, padding=2)),
        nn.Sequential(ConvBN(in_channels, 64, 1), ConvBN(64, 96, 3, padding=1),
                      ConvBN(96, 96, 3, padding=1)),
        _pool_branch(in_channels, pool_features))


def inception_b(in_channels):
    return Branches(
        ConvBN(in_channels, 384, 3, stride=2),
        nn.Sequential(ConvBN(in_channels, 64, 1), ConvBN(64, 96, 3, padding=1),
                      ConvBN(96, 96, 3, stride=2)),
        nn.MaxPool2d(3, 2))


def inception_c(in_channels, c7):
    return Branches(
        ConvBN(in_channels, 192, 1),
        nn.Sequential(ConvBN(in_channels, c7, 1), ConvBN(c7, c7, (1, 7), padding=(0, 3)),
                      ConvBN(c7, 192, (7, 1), padding=(3, 0))),
        nn.Sequential(ConvBN(in_channels, c7, 1), ConvBN(c7, c7, (7, 1), padding=(3, 0)),
                      ConvBN(c7, c7, (1, 7), padding=(0, 3)),
                      ConvBN(c7, c7, (7, 1), padding=(3, 0)),
                      ConvBN(c7, 192, (1, 7), padding=(0, 3))),
        _pool_branch(in_channels, 192))


def inception_d(in_channels):
    return Branches(
        nn.Sequential(ConvBN(in_channels, 192, 1), ConvBN(192, 320, 3, stride=2)),
        nn.Sequential(ConvBN(in_channels, 192, 1), ConvBN(192, 192, (1, 7), padding=(0, 3)),
                      ConvBN(192, 192, (7, 1), padding=(3, 0)),
                      ConvBN(192, 192, 3, stride=2)),
        nn.MaxPool2d(3, 2))


def inception_e(in_channels):
    return Branches(
        ConvBN(in_channels, 320, 1),
        nn.Sequential(ConvBN(in_channels, 384, 1),
                      Branches(ConvBN(384, 384, (1, 3), padding=(0, 1)),
                               ConvBN(384, 384, (3, 1), padding=(1, 0)))),
        nn.Sequential(ConvBN(in_channels, 448, 1), ConvBN(448, 384, 3, padding=1),
                      Branches(ConvBN(384, 384, (1, 3), padding=(0, 1)),
                               ConvBN(384, 384, (3, 1), padding=(1, 0)))),
        _pool_branch(in_channels, 192))


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al. 2016) for 299x299 inputs, without the auxiliary head."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 32, 3, stride=2), ConvBN(32, 32, 3), ConvBN(32, 64, 3, padding=1),
            nn.MaxPool2d(3, 2), ConvBN(64, 80, 1), ConvBN(80, 192, 3), nn.MaxPool2d(3, 2))
        self.mixed = nn.Sequential(
            inception_a(192, 32), inception_a(256, 64), inception_a(288, 64),
            inception_b(288),
            inception_c(768, 128), inception_c(768, 160), inception_c(768, 160),
            inception_c(768, 192),
            inception_d(768), inception_e(1280), inception_e(2048))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        return self.fc(self.flatten(self.dropout(self.pool(self.mixed(self.stem(x))))))


MODELS = {
    "resnet50": (ResNet50, (3, 224, 224), "ResNet-50 (He et al. 2016), ImageNet 224x224"),
    "vgg16": (VGG16, (3, 224, 224), "VGG-16 configuration D (Simonyan & Zisserman 2015), "
                                    "ImageNet 224x224"),
    "inception_v3": (InceptionV3, (3, 299, 299), "Inception-v3 (Szegedy et al. 2016) without "
                                                 "the auxiliary classifier, 299x299"),
}


# ------------------------------------------------------------------------- tracing


def trace(model, input_shape, batch_size):
    """Run one forward pass on the meta device; return the leaf-module calls in order.

    Each entry: (qualified name, module, [input shapes], output shape).
    """
    calls = []
    names = {module: name for name, module in model.named_modules()}

    def record(module, inputs, output):
        calls.append((names[module], module, [tuple(t.shape) for t in inputs],
                      tuple(output.shape)))

    handles = [m.register_forward_hook(record) for m in model.modules()
               if not list(m.children())]
    try:
        with torch.no_grad():
            model(torch.empty((batch_size,) + tuple(input_shape), device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def op_costs(module, in_shapes, out_shape, needs_input_grad=True):
    """(forward, backward) cost of one op as (flops, bytes, kernels) tuples."""
    inp = _numel(in_shapes[0]) if in_shapes else 0
    out = _numel(out_shape)
    weights = sum(p.numel() for p in module.parameters(recurse=False))
    fb = FLOAT_BYTES
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            macs = out * (module.in_channels // module.groups) * kh * kw
        else:
            macs = out * module.in_features
        fwd = (2 * macs, fb * (inp + out + weights), 1)
        # weight gradient always; input gradient unless this is the network's first op
        passes = 2 if needs_input_grad else 1
        bwd = (passes * 2 * macs, fb * (passes * (inp + out) + 2 * weights), passes)
        return fwd, bwd
    if isinstance(module, nn.BatchNorm2d):
        # forward: statistics pass (read x), normalise pass (read x, write y)
        # backward: reduction pass (read x, dy), gradient pass (read x, dy, write dx)
        return (8 * inp, fb * 3 * inp, 2), (12 * inp, fb * 5 * inp, 2)
    if isinstance(module, (nn.ReLU, nn.Dropout)):
        extra = inp if isinstance(module, nn.Dropout) else 0  # the dropout mask
        return (inp, fb * (2 * inp + extra), 1), (inp, fb * (3 * inp), 1)
    if isinstance(module, nn.MaxPool2d):
        # forward writes int64 argmax indices; backward zero-fills dx and scatters into it
        return (inp, fb * (inp + out) + 8 * out, 1), (out, fb * (inp + out) + 8 * out, 2)
    if isinstance(module, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
        return (inp, fb * (inp + out), 1), (inp, fb * (inp + out), 1)
    if isinstance(module, Add):
        # backward: the gradient forks; it is summed where the two paths met (x)
        return (out, fb * 3 * out, 1), (out, fb * 3 * out, 1)
    if isinstance(module, Concat):
        # forward copies every input; backward hands out views of the gradient (free)
        return (0, fb * 2 * out, len(in_shapes)), (0, 0, 0)
    if isinstance(module, (nn.Flatten, nn.Identity)):
        return (0, 0, 0), (0, 0, 0)
    raise TypeError(f"no cost rule for {type(module).__name__}")


def seconds(cost):
    flops, nbytes, kernels = cost
    return max(flops / FLOPS, nbytes / BANDWIDTH) + kernels * LAUNCH_S


def build_profile(name):
    """Trace model ``name`` and return its profile dict (see the module docstring)."""
    cls, input_shape, description = MODELS[name]
    with torch.device("meta"):
        model = cls()
    model.train()
    calls = trace(model, input_shape, BATCH_SIZE)
    forward_s = 0.0
    backward_ops = []
    for index, (qualname, module, in_shapes, out_shape) in enumerate(calls):
        fwd, bwd = op_costs(module, in_shapes, out_shape, needs_input_grad=index > 0)
        forward_s += seconds(fwd)
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        backward_ops.append((qualname, type(module).__name__, numel, seconds(bwd)))
    layers, pending = [], 0.0
    for qualname, kind, numel, bwd_s in reversed(backward_ops):
        pending += bwd_s
        if numel:
            layers.append({"name": qualname, "type": kind, "numel": numel,
                           "backward_s": round(pending, 9)})
            pending = 0.0
    total = sum(layer["numel"] for layer in layers)
    if total != sum(p.numel() for p in model.parameters()):
        raise AssertionError(f"{name}: a module with parameters was not traced")
    if total != EXPECTED_NUMEL[name]:
        raise AssertionError(f"{name}: {total} parameters, published count is "
                             f"{EXPECTED_NUMEL[name]}")
    backward_s = sum(layer["backward_s"] for layer in layers)
    return {
        "model": name,
        "description": description,
        "order": "gradient-ready order: layers[0] is the first gradient backward produces",
        "sources": {
            "numel": "exact: parameters of each layer of the torch module definition in "
                     "scripts/make_layer_profiles.py (matches the published total)",
            "backward_s": "estimate: roofline cost of each traced op on the GPU below; "
                          "parameter-free ops are charged to the next layer ready after them",
            "forward_s": "estimate: sum of the forward roofline costs",
        },
        "timing_model": {"gpu": GPU, "flops_per_s": FLOPS, "bytes_per_s": BANDWIDTH,
                         "kernel_launch_s": LAUNCH_S, "batch_size": BATCH_SIZE,
                         "input_shape": list(input_shape), "dtype": "float32"},
        "total_numel": total,
        "forward_s": round(forward_s, 9),
        "backward_s": round(backward_s, 9),
        "layers": layers,
    }


def profile_to_json(profile):
    """JSON text of a profile: header fields indented, one line per layer (diffable)."""
    header = {key: value for key, value in profile.items() if key != "layers"}
    text = json.dumps(header, indent=1)[:-2]  # drop the closing "\n}"
    layers = ",\n".join("  " + json.dumps(layer) for layer in profile["layers"])
    return f'{text},\n "layers": [\n{layers}\n ]\n}}\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR,
                        help=f"output directory (default {DATA_DIR})")
    parser.add_argument("--check", action="store_true",
                        help="do not write; fail if the files in --out differ from a rebuild")
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models to build, any of {', '.join(MODELS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    stale = []
    for name in args.models or list(MODELS):
        profile = build_profile(name)
        text = profile_to_json(profile)
        path = args.out / f"{name}.json"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"{path}: {len(profile['layers'])} layers, {profile['total_numel']:,} parameters, "
              f"forward {profile['forward_s'] * 1e3:.1f} ms, backward "
              f"{profile['backward_s'] * 1e3:.1f} ms at batch {BATCH_SIZE}")
    if stale:
        print("out of date (rerun scripts/make_layer_profiles.py): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
