#!/usr/bin/env python
"""Data-parallel training with a choice of gradient-communication hooks.

Launch with torchrun (one process per rank)::

    torchrun --nproc_per_node=2 scripts/train.py --model resnet20 --hook omgs --steps 150

or without torchrun for a single-process run (world size 1, handy for debugging).

Hooks (``--hook``):

``allreduce``  DDP's default dense all-reduce (no hook registered).
``powersgd``   PyTorch's built-in ``powerSGD_hook`` (rank ``--powersgd-rank``, error feedback,
               ``--warmup-steps`` dense steps first). On gloo all gradients are put into ONE
               DDP bucket: the stock hook issues a collective inside a future callback, which
               deadlocks gloo as soon as a second bucket is in flight (docs/training.md).
``topk``       TopK-SGD: one group of all gradients, top-k at ``--density`` with error
               feedback (``omgs_hook.register(ddp, strategy="single")``).
``lags``       LAGS-SGD: one group per DDP bucket/layer (``strategy="layerwise"``).
``omgs``       OMGS-SGD: groups chosen by the planner (``strategy="optimal"``, or
               ``--strategy``).

Data: scikit-learn's bundled digits for the CNNs, Python's own standard-library source
text for the LSTM, or ``--synthetic`` random tensors; nothing is downloaded
(``omgs_hook.examples.data``). Optimiser: momentum SGD with a linear learning-rate
warm-up over ``--lr-warmup-steps`` and then a cosine decay to zero at the end of
``--epochs``; ``--steps N`` stops early after N steps without changing that schedule,
so an interrupted and a resumed run follow the same learning rates.

Outputs: a tqdm progress bar on rank 0, ``--log FILE`` JSON lines (one per step with
``step``, ``epoch``, ``loss``, ``iter_s``, ``lr``; one per evaluation with ``epoch``,
``step``, ``test_accuracy``, ``test_loss``; for the omgs hooks one ``"event": "plan"``
line per entry of the hook's plan history, written at the step it appeared; a final
``summary`` line with the whole ``plan_history``; spelled ``--log-file`` under torchrun,
whose parser rejects ``--log``), and a final ``summary:`` line on stdout followed by the
plan history. ``--checkpoint PATH`` writes the model, optimiser and step
to PATH (rank 0) and every rank's hook state and RNG state to ``PATH.rank{r}``, replacing
the previous set only once every rank's new files are written (a rank's previous file
is kept as ``PATH.rank{r}.prev`` until ``PATH`` is replaced, last); ``--resume`` continues
from them, and cuts the ``--log-file`` back to the checkpoint's step first (the records
an interrupted run wrote after it, and its summary line, would otherwise appear twice).
"""

import argparse
import gc
import inspect
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time

# Python puts this script's directory first on sys.path, and scripts/ holds other tools
# whose names can shadow standard-library modules (scripts/profile.py hides `profile`,
# which torch imports via cProfile). train.py imports nothing from scripts/.
_SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _SCRIPT_DIR]

import torch  # noqa: E402  (after the sys.path fix above)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from omgs_hook.cli_types import DefaultsHelpFormatter  # noqa: E402
from omgs_hook.examples import data as example_data  # noqa: E402
from omgs_hook.examples.models import MODEL_NAMES, build_model, count_parameters  # noqa: E402
from omgs_hook.topk import BACKENDS as TOPK_BACKENDS  # noqa: E402

HOOKS = ("allreduce", "powersgd", "topk", "lags", "omgs")
SELECT_CHOICES = ("measured", "model")
TOPK_CHOICES = ("auto",) + tuple(TOPK_BACKENDS)
# what torch.distributed.init_process_group accepts by name (anything else: AssertionError)
PG_BACKENDS = ("gloo", "nccl", "mpi", "ucc")
# planner strategy behind each omgs_hook-based --hook choice
HOOK_STRATEGIES = {"topk": "single", "lags": "layerwise", "omgs": "optimal"}
# the papers' baselines: every group sparse unless --allow-dense asks otherwise
SPARSE_BASELINES = ("topk", "lags")
CHECKPOINT_FORMAT = "omgs-hook-train-checkpoint"
CHECKPOINT_VERSION = 1
# Image size per CNN when training on digits: ResNet-20 learns the 8x8 originals fine
# upsampled to 16x16 at a quarter of the 32x32 cost; VGG-16's five pools need 32x32.
DEFAULT_IMAGE_SIZE = {"resnet20": 16, "vgg16": 32}
# Per-model defaults of options left unset: plain SGD needs a much larger step size for
# the LSTM, which also needs gradient clipping and no weight decay on its embeddings.
MODEL_DEFAULTS = {
    "resnet20": {"lr": 0.1, "weight_decay": 5e-4, "clip_grad_norm": None},
    "vgg16": {"lr": 0.05, "weight_decay": 5e-4, "clip_grad_norm": None},
    "lstm": {"lr": 1.0, "weight_decay": 0.0, "clip_grad_norm": 1.0},
}
# Steps whose time the summary leaves out besides the hook's dense warm-up: DDP's
# first iteration (one bucket) and the bucket rebuild in the second.
DDP_SETUP_STEPS = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--model", choices=MODEL_NAMES, default="resnet20")
    add("--hook", choices=HOOKS, default="omgs",
        help="gradient communication: allreduce (DDP's own, no hook), powersgd (PyTorch's "
             "powerSGD_hook), topk (TopK-SGD: one group), lags (LAGS-SGD: a group per "
             "bucket), omgs (OMGS-SGD: planned groups); topk and lags send every group "
             "sparse unless --allow-dense; see docs/training.md")
    add("--synthetic", action="store_true",
        help="random CIFAR-shaped images / random tokens instead of the real data")
    add("--image-size", type=int, default=None,
        help="image side length: digits are upsampled to it, synthetic images drawn at it "
             "(default: 16 for resnet20 on digits, 32 for vgg16 and synthetic images)")
    add("--seq-len", type=int, default=64, help="characters per LSTM training sequence")
    add("--text-corpus", choices=tuple(example_data.TEXT_CORPORA), default="small",
        help="LSTM text: 'small' (5 standard-library modules, ~485 KB) or 'large' (20, "
             "~1.75 MB; the convergence study's)")
    add("--lstm-hidden-size", type=int, default=None,
        help="LSTM hidden units per layer (default 256)")
    add("--lstm-embedding-dim", type=int, default=None,
        help="LSTM character embedding size (default 128)")
    # optimisation
    add("--epochs", type=int, default=6, help="length of the learning-rate schedule")
    add("--steps", type=int, default=None, help="stop after this many steps in total")
    add("--batch-size", type=int, default=32, help="samples per rank and step")
    add("--lr", type=float, default=None,
        help="peak learning rate (default: 0.1 for resnet20, 0.05 for vgg16, 1.0 for lstm)")
    add("--lr-warmup-steps", type=int, default=20,
        help="learning rate rises linearly from lr/steps to lr over these steps")
    add("--lr-schedule", choices=("cosine", "constant"), default="cosine",
        help="after the warm-up: cosine decay to 0 at the end of --epochs, or constant")
    add("--momentum", type=float, default=0.9)
    add("--weight-decay", type=float, default=None,
        help="L2 penalty (default: 5e-4 for the CNNs, 0 for lstm)")
    add("--clip-grad-norm", type=float, default=None,
        help="clip the averaged gradient to this norm; 0 = off (default: 1.0 for lstm, "
             "off for the CNNs)")
    # communication
    add("--density", type=float, default=0.01,
        help="fraction of gradient entries sent by topk/lags/omgs (1.0 = dense all-reduce)")
    add("--strategy", default=None,
        help="planner strategy for --hook omgs: optimal (default), greedy, layerwise, "
             "single or threshold:BYTES")
    add("--warmup-steps", type=int, default=5,
        help="dense all-reduce steps before compressing (omgs hooks: while profiling; "
             "powersgd: start_powerSGD_iter, at least 2)")
    add("--density-warmup-steps", type=int, default=0,
        help="omgs hooks: after the dense warm-up, lower the density exponentially from "
             "0.25 to --density over this many steps (DGC's warm-up; 0 = off)")
    add("--replan-every", type=int, default=100, help="omgs hooks: steps between re-plans")
    add("--topology", choices=("auto", "flat", "hierarchical"), default="auto",
        help="omgs hooks: flat, hierarchical (two-level: dense reduce-scatter inside a node, "
             "sparse all-gather between nodes) or auto (hierarchical with more than one node "
             "and more than one rank per node; docs/hierarchical.md)")
    add("--ranks-per-node", type=int, default=None,
        help="omgs hooks: ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")
    add("--profile", default=None, help="omgs hooks: cost-model profile JSON (omgs-profile)")
    add("--topk-backend", choices=TOPK_CHOICES, default="auto",
        help="omgs hooks: top-k backend")
    add("--allow-dense", action=argparse.BooleanOptionalAction, default=None,
        help="omgs hooks: let the planner send a group as a dense all-reduce where that is "
             "cheaper (allow_dense); --no-allow-dense sparsifies every group, as the paper "
             "does (default: off for topk and lags, the library's default for omgs)")
    # SUPPRESS: the default is --allow-dense's (None: the library's), not store_false's True
    add("--no-dense-groups", dest="allow_dense", action="store_false", default=argparse.SUPPRESS,
        help="omgs hooks: the same as --no-allow-dense (older spelling)")
    add("--min-sparse-numel", type=int, default=None,
        help="omgs hooks: with dense groups allowed, send sparse groups of fewer elements "
             "dense (min_sparse_numel; 0 = off; default: the library's default, 1024)")
    add("--select", choices=SELECT_CHOICES, default=None,
        help="omgs hooks: how the plan is chosen: 'measured' (a short trial of candidate "
             "plans, the fastest measured one wins) or 'model' (the cost model's optimum); "
             "default: the library's default. Needs an omgs_hook with the select option")
    add("--plan", default=None, metavar="FILE",
        help="omgs hooks: pin this plan (saved from a previous run's plan history or "
             "written by omgs-plan) instead of planning; needs an omgs_hook with the plan "
             "option")
    add("--local-clip-norm", type=float, default=None,
        help="omgs hooks: DGC's local gradient clipping - clip each rank's gradient of a "
             "group before it joins the residual, to this norm scaled by "
             "sqrt(group share) / sqrt(world size) (default: off)")
    add("--track-staleness", action="store_true",
        help="omgs hooks: count per element the steps since it was last sent "
             "(stats()['staleness'])")
    add("--refit-online", action="store_true",
        help="omgs hooks: refit the communication model from measured collectives")
    add("--hook-log-every", type=int, default=100,
        help="omgs hooks: steps between log lines (0: none)")
    add("--powersgd-rank", type=int, default=2, help="powersgd: matrix approximation rank")
    add("--bucket-cap-mb", type=float, default=0.1,
        help="DDP bucket size in MiB; small buckets give the planner units to merge "
             "(0.1: 9 buckets for resnet20, 16 for vgg16, 5 for lstm; 0: one bucket per "
             "parameter)")
    add("--no-broadcast-buffers", action="store_true",
        help="do not broadcast BatchNorm buffers from rank 0 at every forward")
    # runtime
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--backend", choices=PG_BACKENDS, default=None,
        help="process-group backend (default: gloo on cpu, nccl on cuda)")
    add("--threads", type=int, default=1, help="torch intra-op threads per rank")
    add("--seed", type=int, default=0)
    # "--log" alone works only without torchrun: torchrun's own argument parser rejects it
    # as an ambiguous abbreviation of its --log-dir/--logs-specs (Python 3.11 argparse).
    add("--log-file", "--log", dest="log", default=None,
        help="write JSON lines (steps, evaluations, summary) here; use --log-file under "
             "torchrun")
    add("--checkpoint", default=None,
        help="checkpoint path (rank files: PATH.rank{r}); written at every epoch end, every "
             "--checkpoint-every steps and at the end")
    add("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    add("--resume", action="store_true", help="continue from --checkpoint")
    add("--resume-if-present", action="store_true",
        help="continue from --checkpoint when it exists, else start afresh (for elastic "
             "restarts: torchrun --max-restarts relaunches the same command)")
    add("--fail-at-step", type=int, default=None,
        help="fault injection for tests: the last rank exits abruptly after this step, on "
             "the first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--no-gc-freeze", action="store_true",
        help="leave Python's garbage collector as it is (by default everything built "
             "before the first step is frozen out of its full passes, see docs/training.md)")
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def _validate(parser, args):
    """Reject inconsistent options before any process group is created."""
    def positive(name):
        value = getattr(args, name.replace("-", "_"))
        if value is not None and not 0 < value < math.inf:  # (NaN fails it too)
            parser.error(f"--{name}: must be a positive finite number, got {value}")

    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("epochs", "steps", "batch-size", "lr", "threads", "seq-len", "replan-every",
                 "checkpoint-every", "powersgd-rank", "lstm-hidden-size",
                 "lstm-embedding-dim"):
        positive(name)
    # 0 is meaningful for these two: one DDP bucket per parameter, no hook log lines
    for name in ("bucket-cap-mb", "hook-log-every"):
        value = getattr(args, name.replace("-", "_"))
        if value < 0 or not math.isfinite(value):
            parser.error(f"--{name}: must be >= 0, got {value}")
    if args.model != "lstm":
        for name in ("lstm_hidden_size", "lstm_embedding_dim"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')}: only for --model lstm")
    if args.image_size is not None and args.image_size < 4:
        parser.error(f"--image-size: must be at least 4, got {args.image_size}")
    if args.model == "vgg16" and args.image_size is not None and args.image_size % 32:
        parser.error(f"--image-size: vgg16 needs a multiple of 32, got {args.image_size}")
    if not 0.0 < args.density <= 1.0:
        parser.error(f"--density: must be in (0, 1], got {args.density}")
    if args.density_warmup_steps < 0:
        parser.error(f"--density-warmup-steps: must be >= 0, got {args.density_warmup_steps}")
    if args.lr_warmup_steps < 0 or args.warmup_steps < 0:
        parser.error("--lr-warmup-steps and --warmup-steps must be >= 0")
    if not 0.0 <= args.momentum < 1.0:
        parser.error(f"--momentum: must be in [0, 1), got {args.momentum}")
    if not 0 <= args.weight_decay < math.inf:
        parser.error(f"--weight-decay: must be a finite number >= 0, got {args.weight_decay}")
    if args.clip_grad_norm is not None and not 0 <= args.clip_grad_norm < math.inf:
        parser.error(f"--clip-grad-norm: must be a finite number >= 0, got {args.clip_grad_norm}")
    if args.clip_grad_norm == 0:
        args.clip_grad_norm = None
    if args.local_clip_norm is not None and not 0 < args.local_clip_norm < math.inf:
        parser.error(f"--local-clip-norm: must be a positive finite number, got {args.local_clip_norm}")
    if (args.local_clip_norm is not None or args.track_staleness) \
            and args.hook not in HOOK_STRATEGIES:
        parser.error("--local-clip-norm and --track-staleness only apply to the omgs hooks "
                     "(topk, lags, omgs)")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node: must be positive, got {args.ranks_per_node}")
    if (args.topology != "auto" or args.ranks_per_node is not None) \
            and args.hook not in HOOK_STRATEGIES:
        parser.error("--topology and --ranks-per-node only apply to the omgs hooks "
                     "(topk, lags, omgs)")
    if args.hook == "powersgd" and args.warmup_steps < 2:
        parser.error("--warmup-steps: powersgd needs at least 2 dense steps (DDP rebuilds "
                     "its buckets after the first iteration)")
    for option in ("select", "plan", "profile"):
        if getattr(args, option) is None:
            continue
        if args.hook not in HOOK_STRATEGIES:
            parser.error(f"--{option} only applies to the omgs hooks (topk, lags, omgs)")
    if args.topk_backend != "auto" and args.hook not in HOOK_STRATEGIES:
        parser.error("--topk-backend only applies to the omgs hooks (topk, lags, omgs)")
    if args.topk_backend == "cupy" and args.device != "cuda":
        parser.error("--topk-backend cupy needs --device cuda")
    if args.min_sparse_numel is not None and args.min_sparse_numel < 0:
        parser.error(f"--min-sparse-numel: must be >= 0, got {args.min_sparse_numel}")
    if args.min_sparse_numel and (args.allow_dense is False or (
            args.allow_dense is None and args.hook in SPARSE_BASELINES)):
        # (the library refuses it too, but only once the process group is up)
        ruled_out = ("--no-allow-dense" if args.allow_dense is False
                     else f"--hook {args.hook} (every group sparse)")
        parser.error(f"--min-sparse-numel sends small groups dense, which {ruled_out} "
                     "rules out; leave it out, pass 0, or pass --allow-dense")
    if args.plan is not None and not os.path.isfile(args.plan):
        parser.error(f"--plan: no such file: {args.plan}")
    if args.plan is not None:
        problem = _plan_problem(args.plan)
        if problem:
            parser.error(f"--plan {args.plan}: {problem}")
    if args.profile is not None:
        from omgs_hook.profile_file import ProfileError, load_profile
        try:
            load_profile(args.profile)  # what register() does, but before any set-up
        except ProfileError as error:
            parser.error(f"--profile: {error}")
    if args.strategy is not None and args.hook != "omgs":
        parser.error(f"--strategy only applies to --hook omgs (--hook {args.hook} fixes it)")
    if args.strategy is not None:
        from omgs_hook.planner import parse_strategy
        try:
            args.strategy = parse_strategy(args.strategy)
        except ValueError as error:
            parser.error(f"--strategy: {error}")
    if (args.resume or args.resume_if_present) and not args.checkpoint:
        parser.error("--resume/--resume-if-present need --checkpoint PATH")
    if args.checkpoint_every is not None and not args.checkpoint:
        parser.error("--checkpoint-every needs --checkpoint PATH")
    if args.resume and not os.path.isfile(args.checkpoint):
        parser.error(f"--resume: no checkpoint file {args.checkpoint}")
    # found now, not at the first write (a whole epoch later for a checkpoint)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    for option, path, paths in (
            ("log-file", args.log, [args.log]),
            ("checkpoint", args.checkpoint,
             [args.checkpoint] + [rank_file(args.checkpoint, r) for r in range(world_size)])):
        for problem in filter(None, map(_output_path_problem, paths if path else [])):
            parser.error(f"--{option}: {problem}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.backend is not None:
        if not dist.is_backend_available(args.backend):
            parser.error(f"--backend {args.backend}: not available in this torch build")
        if args.backend == "nccl" and args.device != "cuda":
            parser.error("--backend nccl needs --device cuda")


def _plan_problem(path):
    """Why the --plan file is no plan (not JSON, not a plan's shape), or None."""
    from omgs_hook.hook import _parse_pinned_plan

    try:
        _parse_pinned_plan(path)  # register()'s own reading of plan=
    except ValueError as error:
        message = str(error)
        return message[len("plan: "):] if message.startswith("plan: ") else message
    return None


def _output_path_problem(path):
    """Why ``path`` cannot be written as a file (missing folders are created), or None."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):  # the first existing one is where mkdir starts
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"cannot create {path}: {folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create {path}: {folder} is not writable"
    return None


# ---------------------------------------------------------------------------------
# process group
# ---------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _attempt_store(restart):
    """The launcher's store, with keys private to this restart attempt.

    Measured with torch 2.13: after `torchrun --max-restarts` relaunches the workers, gloo
    read the previous attempt's peer addresses from the reused agent store in 3 of 4 runs
    ("connectFullMesh ... Connection refused"). A per-attempt key prefix fixed it (5 of 5).
    """
    import datetime

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and rank == 0,
                          timeout=datetime.timedelta(minutes=5))
    return dist.PrefixStore(f"train.py/attempt{restart}", store)


def init_distributed(args):
    """Join the process group torchrun describes, or make a one-rank group without it."""
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=_attempt_store(restart),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    else:
        local_rank = 0
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


# ---------------------------------------------------------------------------------
# data, model, hook
# ---------------------------------------------------------------------------------


def load_data(args):
    if args.model == "lstm":
        if args.synthetic:
            return example_data.synthetic_tokens(seq_len=args.seq_len, seed=args.seed)
        return example_data.text_corpus(seq_len=args.seq_len,
                                        modules=example_data.TEXT_CORPORA[args.text_corpus])
    if args.synthetic:
        return example_data.synthetic_images(image_size=args.image_size or 32, seed=args.seed)
    image_size = args.image_size or DEFAULT_IMAGE_SIZE[args.model]
    return example_data.digits(image_size=image_size)


def make_model(args, dataset):
    if dataset.kind == "text":
        sizes = {key: value for key, value in (("hidden_size", args.lstm_hidden_size),
                                               ("embedding_dim", args.lstm_embedding_dim))
                 if value is not None}
        return build_model(args.model, vocab_size=dataset.num_classes, **sizes)
    return build_model(args.model, in_channels=dataset.in_channels,
                       num_classes=dataset.num_classes)


def loss_and_correct(logits, targets, reduction="mean"):
    """Cross-entropy and number of correct predictions (per token for the LSTM)."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    loss = F.cross_entropy(logits, targets, reduction=reduction)
    correct = (logits.argmax(dim=1) == targets).sum()
    return loss, correct


class PowerSGDHook:
    """PyTorch's powerSGD_hook plus a checkpointable view of its state.

    ``PowerSGDState`` pickles a numpy RandomState, which ``torch.load(weights_only=True)``
    refuses; :meth:`state_dict` converts everything to tensors and plain values.

    Its error feedback and warm-start factors are flat per-bucket buffers laid out in the
    bucket's parameter order. A resumed process's first step runs DDP's first-guess
    buckets, whose order differs from the rebuilt buckets the checkpoint was written
    with (ResNet-20's one gloo bucket: reversed): the saved error was added to the wrong
    elements, and a resumed run ended up to 0.013 off the uninterrupted one. So the
    order each buffer is in is kept (and saved), and the buffers are rearranged per
    parameter whenever a bucket arrives in another order (:meth:`_realign`).
    """

    KINDS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, ddp_model, args, device):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.device = device  # checkpoints are loaded to the CPU; the hook needs them here
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.warmup_steps, use_error_feedback=True, warm_start=True,
            random_seed=args.seed)
        module = getattr(ddp_model, "module", None)
        params = list(module.named_parameters()) if module is not None else []
        self._names = {id(p): name for name, p in params}
        self._shapes = {name: tuple(p.shape) for name, p in params}
        self._orders = {}  # bucket index -> parameter names its buffers are laid out in
        self._pool = {kind: {} for kind in self.KINDS}  # name -> its piece, while realigning

        def hook(state, bucket):
            self._realign(bucket.index(), tuple(self._names.get(id(p), "")
                                                for p in bucket.parameters()))
            return powerSGD_hook.powerSGD_hook(state, bucket)

        ddp_model.register_comm_hook(self.state, hook)

    def _sizes(self, name):
        """Elements of parameter ``name`` in the error buffer, and in the P and Q factors
        (0 where powerSGD_hook sends it uncompressed), as powerSGD_hook lays them out."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        shape = self._shapes[name]
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = numel // rows if rows else 0
        rank = min(rows, cols, self.state.matrix_approximation_rank)
        if not powerSGD_hook._should_compress(rows, cols, rank,
                                              self.state.min_compression_rate)[0]:
            return numel, 0, 0
        return numel, rows * rank, cols * rank

    def _realign(self, index, names):
        """Before bucket ``index`` (parameters ``names``, in order) is compressed: when
        its buffers were laid out for another order, cut every buffer whose order is
        known into per-parameter pieces and build this bucket's from them."""
        if self._orders.get(index) == names or "" in names:
            self._orders[index] = names if "" not in names else None
            return
        for other, order in list(self._orders.items()):
            if order is None:
                continue
            sizes = [self._sizes(name) for name in order]
            for k, kind in enumerate(self.KINDS):
                buffers = getattr(self.state, kind)
                if other in buffers:
                    pieces = torch.split(buffers.pop(other), [size[k] for size in sizes])
                    self._pool[kind].update(zip(order, pieces))
            self._orders[other] = None
        for kind in self.KINDS:
            pool = self._pool[kind]
            if names and all(name in pool for name in names):
                getattr(self.state, kind)[index] = torch.cat([pool.pop(name) for name in names])
        self._orders[index] = names

    def state_dict(self):
        name, keys, position, has_gauss, cached_gaussian = self.state.rng.get_state()
        return {
            "iter": self.state.iter,
            "error_dict": dict(self.state.error_dict),
            "p_memory_dict": dict(self.state.p_memory_dict),
            "q_memory_dict": dict(self.state.q_memory_dict),
            "rng": {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                    "position": int(position), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached_gaussian)},
            "total_numel_before_compression": self.state.total_numel_before_compression,
            "total_numel_after_compression": self.state.total_numel_after_compression,
            # the parameter order of each bucket's buffers (see _realign)
            "orders": {index: list(order) for index, order in self._orders.items()
                       if order is not None},
        }

    def load_state_dict(self, state_dict):
        import numpy as np

        rng = state_dict["rng"]
        self.state.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32),
                                  rng["position"], rng["has_gauss"], rng["cached_gaussian"]))
        for key in ("iter", "total_numel_before_compression", "total_numel_after_compression"):
            setattr(self.state, key, state_dict[key])
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            getattr(self.state, key).clear()
            getattr(self.state, key).update(
                {index: tensor.to(self.device) for index, tensor in state_dict[key].items()})
        # (a checkpoint written before the orders were saved: its buffers are used as
        # they are, as before)
        self._orders = {int(index): tuple(order)
                        for index, order in state_dict.get("orders", {}).items()}
        self._pool = {kind: {} for kind in self.KINDS}

    def stats(self):
        rate, before, after = self.state.compression_stats()
        return {"total": {"compression_rate": rate, "numel_before_compression": before,
                          "numel_after_compression": after}}


def bucket_cap_for(args, model):
    """DDP bucket size in MiB for this hook (see the module docstring for powersgd)."""
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.hook == "powersgd" and backend == "gloo":
        model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        return max(args.bucket_cap_mb, math.ceil(model_mib) + 1.0)
    return args.bucket_cap_mb


def hook_options(args):
    """Keyword options of ``omgs_hook.register`` for an omgs-based ``--hook``.

    Options the user left unset (``--allow-dense``, ``--min-sparse-numel``, ``--select``,
    ``--plan``) are not passed, so the library's own defaults apply - except
    ``allow_dense`` for ``--hook topk`` and ``lags``, which is False: TopK-SGD and LAGS-SGD
    sparsify every group.
    """
    strategy = args.strategy if args.hook == "omgs" and args.strategy else HOOK_STRATEGIES[args.hook]
    options = dict(
        density=args.density, strategy=strategy, warmup_steps=args.warmup_steps,
        density_warmup_steps=args.density_warmup_steps, replan_every=args.replan_every,
        profile=args.profile, topk_backend=args.topk_backend,
        refit_online=args.refit_online, log_every=args.hook_log_every)
    if args.allow_dense is not None:
        options["allow_dense"] = args.allow_dense
    elif args.hook in SPARSE_BASELINES:
        # TopK-SGD and LAGS-SGD never send a group dense: with the library's
        # allow_dense=True a group went dense wherever that measured cheaper (on
        # loopback `--hook lags` sent 5 of ResNet-20's 9 buckets dense, 606 kB a step
        # instead of 22 kB)
        options["allow_dense"] = False
    if args.min_sparse_numel is not None:
        options["min_sparse_numel"] = args.min_sparse_numel
    if args.select is not None:
        options["select"] = args.select
    if args.plan is not None:
        options["plan"] = args.plan
    if args.local_clip_norm is not None:
        options["local_clip_norm"] = args.local_clip_norm
    if args.track_staleness:
        options["track_staleness"] = True
    if args.topology != "auto":
        options["topology"] = args.topology
    if args.ranks_per_node is not None:
        options["ranks_per_node"] = args.ranks_per_node
    return options


def attach_hook(ddp_model, args, device):
    """Register the chosen hook; return an object with state_dict/load_state_dict/stats."""
    if args.hook == "allreduce":
        return None
    if args.hook == "powersgd":
        return PowerSGDHook(ddp_model, args, device)
    import omgs_hook

    return omgs_hook.register(ddp_model, **hook_options(args))


# ---------------------------------------------------------------------------------
# schedule, evaluation, checkpoints
# ---------------------------------------------------------------------------------


def learning_rate(step, args, total_steps):
    """Learning rate for (0-based) ``step``: linear warm-up, then cosine or constant."""
    if step < args.lr_warmup_steps:
        return args.lr * (step + 1) / args.lr_warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    decay_steps = max(1, total_steps - args.lr_warmup_steps)
    progress = min(1.0, (step - args.lr_warmup_steps) / decay_steps)
    return 0.5 * args.lr * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, dataset, rank, world_size, device, batch_size=256):
    """Exact test loss and accuracy: each rank scores its shard, sums are all-reduced."""
    was_training = model.training
    model.eval()
    inputs, targets = example_data.test_shard(dataset, world_size, rank)
    # [summed loss, correct predictions, scored predictions]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for start in range(0, inputs.shape[0], batch_size):
        batch_x = inputs[start:start + batch_size].to(device)
        batch_y = targets[start:start + batch_size].to(device)
        loss, correct = loss_and_correct(model(batch_x), batch_y, reduction="sum")
        totals += torch.stack([loss.double(), correct.double(),
                               torch.tensor(float(batch_y.numel()), dtype=torch.float64,
                                            device=device)])
    dist.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def rank_file(path, rank):
    return f"{path}.rank{rank}"


class TrainError(Exception):
    """A problem train.py explains in one line: main prints it without a traceback."""


class ResumeError(TrainError, ValueError):
    """The checkpoint cannot be resumed from (unreadable, another setup, incomplete)."""


class MissingCheckpointError(TrainError, FileNotFoundError):
    """A file of the checkpoint set is not there."""


def _write_tmp(obj, path):
    """Write ``obj`` to ``path``.tmp and return that name; a failed write leaves no
    partial file behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        torch.save(obj, tmp)
    except BaseException:
        if os.path.isfile(tmp):  # (not whatever else is in the way under that name)
            os.remove(tmp)
        raise
    return tmp


def _replace_with(tmp, path):
    """Put the written ``tmp`` in ``path``'s place (one rename: a crash never leaves a
    half-written file there); a failed rename removes ``tmp``."""
    try:
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def previous_file(path):
    """Where a save keeps the previous set's rank file until the new set is whole."""
    return f"{path}.prev"


def _remove_if_present(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _keep_previous(path):
    """Keep ``path`` (the previous set's rank file, if any) as :func:`previous_file`:
    a hard link, so nothing is copied (a copy where the file system has none)."""
    if not os.path.isfile(path):
        return
    keep, tmp = previous_file(path), f"{previous_file(path)}.tmp"
    try:
        _remove_if_present(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, keep)
    except OSError:
        # best effort: the ranks agreed to replace their files already, and one raising
        # here would leave the others waiting at the barrier
        _remove_if_present(tmp)


def _ranks_that_failed(failed, rank, world_size, device):
    """Every rank learns which ranks report a failure (a collective: all ranks call it)."""
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(failed)
    dist.all_reduce(flags)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def save_checkpoint(args, rank, world_size, step, model, optimizer, hook):
    """Write the shared file and every rank's file of ``step`` as one set.

    --resume needs the shared file and the rank files of the same step, so nothing is
    replaced until every rank has written its new files: a failed write on any rank
    leaves the previous set whole (and raises on every rank). The shared file, which the
    rank files' step is checked against, is replaced last; a rank's previous file is kept
    (``PATH.rank{r}.prev``) until then, so a kill in between leaves a set to resume from.
    """
    files = []  # (contents, path) this rank writes
    if rank == 0:
        files.append(({
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step,
            "world_size": world_size, "model_name": args.model, "hook": args.hook,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        }, args.checkpoint))
    per_rank = {"step": step, "rank": rank, "world_size": world_size, "hook": args.hook,
                "hook_state": hook.state_dict() if hook is not None else None,
                "rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and args.device == "cuda":
        per_rank["cuda_rng_state"] = torch.cuda.get_rng_state()
    if args.no_broadcast_buffers:
        # each rank's own BatchNorm statistics: without the broadcast they differ, and the
        # shared file holds rank 0's only
        per_rank["buffers"] = dict(model.named_buffers())
    files.append((per_rank, rank_file(args.checkpoint, rank)))
    written, error = [], None  # written: (tmp, final path)
    try:
        for contents, path in files:
            written.append((_write_tmp(contents, path), path))
    except (OSError, RuntimeError) as caught:  # RuntimeError: torch.save's, e.g. disk full
        error = f"{path}.tmp: {str(caught).strip()}"
    device = next(model.parameters()).device  # (nccl reduces CUDA tensors only)
    failed = _ranks_that_failed(error is not None, rank, world_size, device)
    if failed:
        for tmp, _ in written:
            os.remove(tmp)
        why = error or f"failed on rank {', '.join(map(str, failed))}"
        raise TrainError(f"--checkpoint: the checkpoint of step {step} was not saved ({why}); "
                         f"{args.checkpoint} and its rank files are left as they were")
    # the previous set's rank file stays, as PATH.rank{r}.prev, until the shared file says
    # the new set is whole: a rank killed between this rank's replace and rank 0's
    # replace of the shared file leaves rank files of this step beside a shared file of
    # the last one, and --resume goes back to the kept ones (load_checkpoint)
    own = rank_file(args.checkpoint, rank)
    _keep_previous(own)
    _replace_with(*written[-1])
    dist.barrier()  # every rank file is of this step before the shared file says so
    if rank == 0:
        _replace_with(*written[0])
    # nobody continues (or exits) until the whole set of this step is in place
    dist.barrier()
    _remove_if_present(previous_file(own))


def _load(path):
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, not a torch file, objects it may not load
        lines = str(error).strip().splitlines()
        raise ResumeError(f"--resume: cannot read checkpoint file {path} (truncated or not "
                          f"written by train.py?): {lines[0] if lines else type(error).__name__}"
                          ) from None
    if not isinstance(record, dict) or "step" not in record:
        raise ResumeError(f"--resume: {path} is not a train.py checkpoint file")
    return record


def load_checkpoint(args, rank, world_size):
    """Read and check the shared and this rank's checkpoint file; clear errors if unusable."""
    shared_path, own_path = args.checkpoint, rank_file(args.checkpoint, rank)
    for path in (shared_path, own_path):
        if not os.path.exists(path):
            raise MissingCheckpointError(f"--resume: checkpoint file {path} does not exist")
    shared, own = _load(shared_path), _load(own_path)
    if shared.get("format") != CHECKPOINT_FORMAT or shared.get("version") != CHECKPOINT_VERSION:
        raise ResumeError(f"--resume: {shared_path} is not a version-{CHECKPOINT_VERSION} "
                          f"train.py checkpoint")
    problems = []
    if shared["model_name"] != args.model:
        problems.append(f"model {shared['model_name']!r} (now {args.model!r})")
    if shared["hook"] != args.hook:
        problems.append(f"hook {shared['hook']!r} (now {args.hook!r})")
    if shared["world_size"] != world_size:
        problems.append(f"world size {shared['world_size']} (now {world_size}); the hook "
                        f"state is per rank")
    if problems:
        raise ResumeError(f"--resume: {shared_path} was written with " + "; ".join(problems))
    kept = previous_file(own_path)
    if own["step"] != shared["step"] and os.path.isfile(kept):
        # a save was cut off between the rank files and the shared file (a rank killed
        # there): the set the shared file names is whole with the kept rank file
        previous = _load(kept)
        if previous["step"] == shared["step"]:
            own = previous
            try:
                os.replace(kept, own_path)  # the set is whole on disk again
            except OSError:
                pass  # (a read-only copy of the checkpoint: read from the kept file)
    if own["step"] != shared["step"]:
        raise ResumeError(f"--resume: {own_path} is from step {own['step']} but {shared_path} "
                          f"from step {shared['step']}: the checkpoint set is incomplete; "
                          f"start afresh without --resume")
    return shared, own


def load_hook_state(hook, state, args, rank):
    """Restore the hook's state, its refusals in train.py's terms."""
    try:
        hook.load_state_dict(state)
    except ValueError as error:
        # the library suggests register()'s on_world_size_change, which train.py has not
        message = str(error).split("; pass on_world_size_change=")[0]
        if message != str(error):
            message += ("; resume with the --topology and --ranks-per-node the checkpoint "
                        "was written with, or start afresh without --resume")
        raise ResumeError(f"--resume: {rank_file(args.checkpoint, rank)}: hook "
                          f"state: {message}") from None


# ---------------------------------------------------------------------------------
# logging helpers
# ---------------------------------------------------------------------------------


class JsonLog:
    """Write JSON lines on rank 0 (a no-op elsewhere or without --log).

    ``resume_step``: None starts the file afresh; a step (a resumed run's) keeps the
    records up to that step and appends (see :func:`trim_log`).
    """

    def __init__(self, path, enabled, resume_step=None):
        self.handle = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resume_step is not None:
                trim_log(path, resume_step)
            self.handle = open(path, "w" if resume_step is None else "a")

    def write(self, **record):
        if self.handle is not None:
            self.handle.write(json.dumps(record, default=_json_default) + "\n")
            self.handle.flush()

    def close(self):
        if self.handle is not None:
            self.handle.close()


def trim_log(path, step):
    """Cut a resumed run's log back to what its checkpoint (of ``step``) had seen.

    The records of later steps were written by the interrupted run after that checkpoint
    and are written again now; its summary line (a plain --resume after a finished run)
    is no longer the end, and a line cut short by a crash is no JSON. All of these go;
    the file is replaced atomically.
    """
    if not os.path.isfile(path):
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or record.get("summary"):
                continue
            later = isinstance(record.get("step"), (int, float)) and record["step"] > step
            if not later:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.writelines(kept)
    os.replace(tmp, path)


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def bytes_sent(hook_stats):
    """The hook's total bytes sent, if its stats report one (key names vary by hook)."""
    total = (hook_stats or {}).get("total", {})
    for key in ("bytes_sent", "sent_bytes", "bytes"):
        if isinstance(total.get(key), (int, float)):
            return total[key]
    return None


class PlanHistory:
    """The omgs hook's plan history, for the JSON log and the end-of-run output.

    The hook's ``stats()["plan_history"]`` (step and plan of every plan it used) is read
    whenever the hook's current plan object changes - a cheap identity check per step, so
    ``stats()`` (which also computes the residual norm) is not called every step. With a
    library that has no plan history, the plans seen (``stats()["plan"]``) are recorded
    instead, each with the step after which it was first in use. Every entry not logged
    yet is returned by :meth:`poll`, once.
    """

    def __init__(self, hook):
        self.hook = hook
        self.enabled = hook is not None and hasattr(hook, "plan")
        self._plan = None
        self.entries = []
        self.from_hook = None  # True: the hook's own plan_history; False: our fallback

    def poll(self, step, force=False):
        if not self.enabled:
            return []
        plan = getattr(self.hook, "plan", None)
        if plan is self._plan and not force:
            return []
        self._plan = plan
        stats = self.hook.stats()
        if "plan_history" in stats and stats["plan_history"] is not None:
            self.from_hook = True
            history = list(stats["plan_history"])
            # the entries after the last one logged: found by content, not by count - the
            # hook keeps its newest PLAN_HISTORY_LIMIT entries only, so once that many are
            # there the count stays and a count found no new entry ever again
            start = 0
            if self.entries:
                last = self.entries[-1]
                start = next((i + 1 for i in range(len(history) - 1, -1, -1)
                              if history[i] == last), 0)
            new = history[start:]
            self.entries = history
            return new
        self.from_hook = False
        current = stats.get("plan")
        if current is None or (self.entries and self.entries[-1]["plan"] == current):
            return []
        entry = {"step": step, "plan": current}
        self.entries.append(entry)
        return [entry]

    def resumed(self, hook_state):
        """After a resume: the plans of the checkpoint's hook state were logged by the run
        that wrote it; only later ones are new."""
        if self.enabled and isinstance(hook_state, dict):
            self.entries = list(hook_state.get("plan_history") or [])


def describe_plan_entry(entry):
    """One plan-history entry in a line: step, groups (units per group), dense groups."""
    if not isinstance(entry, dict):
        return json.dumps(entry, default=_json_default)
    plan = entry.get("plan") if isinstance(entry.get("plan"), dict) else entry
    step = entry.get("step", plan.get("made_at_step"))
    groups = plan.get("groups")
    parts = [f"step {step}:"]
    if plan.get("strategy") is not None:
        parts.append(str(plan["strategy"]))
    if isinstance(groups, (list, tuple)):
        sizes = [len(g) if isinstance(g, (list, tuple)) else g for g in groups]
        parts.append(f"{len(sizes)} groups {sizes}")
    dense = plan.get("dense")
    if isinstance(dense, (list, tuple)):
        parts.append(f"({sum(bool(d) for d in dense)} dense)")
    for key in ("reason", "source", "select"):
        if entry.get(key) is not None:
            parts.append(f"{key} {entry[key]}")
    return " ".join(parts)


# ---------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------


def freeze_what_was_built(args):
    """Before the first step: everything built so far (torch's modules, the data, the
    model, DDP, the hook) lives to the end. Frozen, it leaves the cyclic collector's full
    passes, which otherwise traverse it every few steps where a step allocates much -
    with 1000 buckets about 100 ms each, every ~17 steps (docs/training.md). Off with
    ``--no-gc-freeze``; :func:`main` unfreezes before its final collection."""
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()


def schedule_length(args, steps_per_epoch):
    """Steps of the learning-rate schedule (--epochs), the step to stop at, and why that
    is fewer than --steps (or None)."""
    total_steps = args.epochs * steps_per_epoch
    if not args.steps or args.steps <= total_steps:
        return total_steps, args.steps or total_steps, None
    # (steps per epoch depend on the data: known only now, not when parsing the options)
    return total_steps, total_steps, (
        f"--steps {args.steps} > {total_steps} steps of --epochs {args.epochs} "
        f"({steps_per_epoch} per epoch): stopping at {total_steps}")


def train(args, rank, world_size, device):
    is_main = rank == 0
    dataset = load_data(args)
    # same seed on every rank: identical initial weights (DDP would broadcast them anyway)
    torch.manual_seed(args.seed)
    model = make_model(args, dataset).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    start_step = 0
    rank_state = None
    if args.resume_if_present and os.path.exists(args.checkpoint):
        args.resume = True
    if args.resume:
        shared, rank_state = load_checkpoint(args, rank, world_size)
        model.load_state_dict(shared["model"])
        optimizer.load_state_dict(shared["optimizer"])
        start_step = shared["step"]
    # per-rank stream for dropout and the hook's own randomness
    torch.manual_seed(args.seed + 1 + rank)
    if rank_state is not None:
        torch.set_rng_state(rank_state["rng_state"])
        if "cuda_rng_state" in rank_state and args.device == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng_state"])

    ddp_options = {}
    if args.no_broadcast_buffers:
        # torch >= 2.13 renames the option (and warns about the old name even when True)
        ddp_parameters = inspect.signature(DistributedDataParallel.__init__).parameters
        key = "forward_sync_buffers" if "forward_sync_buffers" in ddp_parameters else \
            "broadcast_buffers"
        ddp_options[key] = False
    ddp_model = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_for(args, model), **ddp_options)
    if rank_state is not None and args.no_broadcast_buffers and rank_state.get("buffers"):
        # each rank's own statistics, after DDP's construction (which broadcast rank 0's)
        own = dict(model.named_buffers())
        with torch.no_grad():
            for name, tensor in rank_state["buffers"].items():
                if name in own:
                    own[name].copy_(tensor)
    hook = attach_hook(ddp_model, args, device)
    if rank_state is not None and hook is not None:
        load_hook_state(hook, rank_state["hook_state"], args, rank)

    sampler = example_data.make_sampler(dataset.num_train, world_size, rank, args.seed)
    steps_per_epoch = example_data.steps_per_epoch(dataset.num_train, world_size,
                                                   args.batch_size)
    total_steps, stop_step, capped = schedule_length(args, steps_per_epoch)
    log = JsonLog(args.log, is_main, resume_step=start_step if args.resume else None)
    if is_main and capped:
        print(f"train.py: warning: {capped}", file=sys.stderr, flush=True)
    if is_main:
        print(f"train.py: {args.model} ({count_parameters(model):,} parameters), "
              f"{example_data.describe(dataset)}; world size {world_size} ({dist.get_backend()}), "
              f"hook {args.hook}, density {args.density}, {steps_per_epoch} steps/epoch, "
              f"steps {start_step}..{stop_step}", flush=True)

    progress = None
    if is_main and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=stop_step, initial=start_step, unit="step", dynamic_ncols=True)

    freeze_what_was_built(args)
    iter_times = []
    evaluation = None
    plan_history = PlanHistory(hook)
    if rank_state is not None:
        plan_history.resumed(rank_state["hook_state"])
    step = start_step
    epoch = step // steps_per_epoch
    ddp_model.train()
    while step < stop_step:
        batches = example_data.shard_batches(dataset, sampler, epoch, args.batch_size,
                                             start_step=step % steps_per_epoch)
        for inputs, targets in batches:
            if step >= stop_step:
                break
            lr = learning_rate(step, args, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            started = time.perf_counter()
            inputs, targets = inputs.to(device), targets.to(device)
            loss, _ = loss_and_correct(ddp_model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.clip_grad_norm)
            optimizer.step()
            loss_value = loss.item()  # also waits for the device on CUDA
            iter_s = time.perf_counter() - started
            iter_times.append(iter_s)
            step += 1
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step}; "
                                         f"try a smaller --lr")
            log.write(step=step, epoch=epoch, loss=loss_value, iter_s=iter_s, lr=lr)
            for entry in plan_history.poll(step):
                log.write(event="plan", step=step, plan_history_entry=entry)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.3f}", ms=f"{1000 * iter_s:.0f}",
                                     refresh=False)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_checkpoint(args, rank, world_size, step, model, optimizer, hook)
            if (args.fail_at_step == step and rank == world_size - 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                print(f"train.py: rank {rank} fails on purpose after step {step}", flush=True)
                os._exit(13)
        if step % steps_per_epoch == 0:  # the epoch ran to its end
            test_loss, test_accuracy = evaluate(model, dataset, rank, world_size, device)
            evaluation = (step, test_loss, test_accuracy)
            log.write(epoch=epoch, step=step, test_accuracy=test_accuracy, test_loss=test_loss)
            if is_main:
                line = (f"epoch {epoch} (step {step}): test accuracy {test_accuracy:.4f}, "
                        f"test loss {test_loss:.4f}")
                if progress is not None:
                    progress.write(line)  # keeps the bar intact
                else:
                    print(line, flush=True)
            if args.checkpoint and not (args.checkpoint_every
                                        and step % args.checkpoint_every == 0):
                save_checkpoint(args, rank, world_size, step, model, optimizer, hook)
        epoch += 1
    if progress is not None:
        progress.close()

    if evaluation is None or evaluation[0] != step:
        test_loss, test_accuracy = evaluate(model, dataset, rank, world_size, device)
        evaluation = (step, test_loss, test_accuracy)
        log.write(epoch=step / steps_per_epoch, step=step, test_accuracy=test_accuracy,
                  test_loss=test_loss)
        if args.checkpoint and step > start_step:
            save_checkpoint(args, rank, world_size, step, model, optimizer, hook)

    for entry in plan_history.poll(step, force=True):
        log.write(event="plan", step=step, plan_history_entry=entry)
    summary = summarise(args, world_size, start_step, step, iter_times, evaluation, hook, model)
    if plan_history.enabled:
        summary["plan_history"] = plan_history.entries
        summary["plan_history_source"] = "hook" if plan_history.from_hook else "train.py"
    log.write(**summary)
    log.close()
    if is_main:
        print("summary: " + " ".join(f"{key}={_format(value)}" for key, value in summary.items()
                                     if key not in ("summary", "hook_stats", "plan_history",
                                                    "plan_history_source")
                                     and value is not None), flush=True)
        if plan_history.enabled:
            print(f"plan history ({len(plan_history.entries)} plan(s)"
                  f"{'' if plan_history.from_hook else ', as seen by train.py'}):", flush=True)
            for entry in plan_history.entries:
                print("  " + describe_plan_entry(entry), flush=True)
        if hook is not None and hasattr(hook, "summary"):
            print(hook.summary(), flush=True)  # the plan in words: groups, why dense, bytes
    return summary


def summarise(args, world_size, start_step, step, iter_times, evaluation, hook, model):
    """Final numbers: accuracy, iteration time in steady state, bytes the hook sent."""
    # leave out DDP's set-up iterations (every launch builds a new DDP model, resumed
    # ones too) and the hook's dense warm-up (when it ran now)
    skip = max(DDP_SETUP_STEPS, args.warmup_steps - start_step)
    steady = iter_times[skip:] or iter_times
    hook_stats = hook.stats() if hook is not None else None
    sent = bytes_sent(hook_stats)
    dense_bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.hook == "allreduce":
        # DDP's payload: every gradient element, every step since step 0
        sent = step * dense_bytes_per_step
    elif args.hook == "powersgd":
        # PowerSGD counts elements only in compressed steps; add its dense warm-up steps
        numel_after = hook_stats["total"]["numel_after_compression"]
        sent = 4 * numel_after + min(step, args.warmup_steps) * dense_bytes_per_step
    return {
        "summary": True, "model": args.model, "hook": args.hook, "world_size": world_size,
        "steps": step, "test_accuracy": evaluation[2], "test_loss": evaluation[1],
        "mean_iter_s": statistics.fmean(steady) if steady else None,
        "median_iter_s": statistics.median(steady) if steady else None,
        "timed_steps": len(steady),
        "bytes_sent": sent,
        "bytes_sent_per_step": sent / step if sent is not None and step else None,
        "hook_stats": hook_stats,
    }


def _format(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return json.dumps(value, default=_json_default, separators=(",", ":"))
    return str(value)


def show_hook_log(rank):
    """The hook logs at INFO (its log line every --hook-log-every steps, trial summaries,
    re-plans) to the "omgs_hook" logger; Python drops INFO unless something shows it.
    Rank 0 prints it to stdout, as it prints its own lines."""
    import logging

    if rank != 0:
        return
    hook_logger = logging.getLogger("omgs_hook")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    hook_logger.addHandler(handler)
    hook_logger.setLevel(logging.INFO)
    hook_logger.propagate = False  # (not twice where the root logger prints too)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world_size, device = init_distributed(args)
    show_hook_log(rank)
    status = 0
    try:
        train(args, rank, world_size, device)
    except TrainError as error:
        where = f" (rank {rank})" if world_size > 1 else ""
        print(f"train.py{where}: error: {error}", file=sys.stderr, flush=True)
        status = 1
    # Free the DDP model (and the hook state that references it) before tearing down the
    # process group: gloo otherwise aborts at interpreter exit in ~10-20% of runs.
    gc.unfreeze()  # (frozen objects are never collected)
    gc.collect()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
