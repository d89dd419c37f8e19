"""The OMGS-SGD DDP communication hook: merged-group top-k sparsification with error feedback.

Algorithm (per training step, i.e. per DDP backward pass):

1. DDP calls :func:`omgs_hook` once per gradient bucket, in ready order. The hook
   records when each bucket arrived (its share of backward time) and returns a Future
   for it.
2. Buckets are merged into **groups** by the current plan. A group is a run of
   neighbouring buckets, stored as the list of its parameters, so a group may span
   several buckets and - after DDP rebuilt its buckets or restarted with one - a bucket
   may hold several groups. A group is sent as soon as all of its parameters arrived.
3. For a sparse group of D elements: ``acc = gradient + residual`` (fp32, concatenated
   in the group's canonical parameter order); the ``k = max(1, ceil(density * D))``
   entries of largest magnitude are selected; the residual keeps everything that was not
   sent; values, int32 indices and a status word travel in ONE all-gather of a
   fixed-length packed payload; the result is ``index_add`` of every rank's entries,
   divided by the world size, written back into the bucket buffers.
   A dense group (the cost model found an all-reduce cheaper, or warm-up, or
   ``density=1``) sends ``gradient + residual`` with an all-reduce; its residual is zero
   afterwards.
4. When every group covering a bucket has been written back, that bucket's Future is
   completed. By the last bucket every group has been issued, so no Future stays pending.
5. Residual updates are committed once per step, after every group finished; a step in
   which any rank saw NaN/Inf, or a collective failed, commits nothing.

Planning: the first ``warmup_steps`` steps run dense all-reduce per bucket while the
hook measures each bucket's backward time. Then the OMGS optimiser
(:mod:`omgs_hook.planner`) computes the plan from the slowest rank's measured timeline
(tail of the previous step, forward, per-bucket backward; median over steps), the
profile's collective cost ``alpha + beta * bytes`` and top-k cost
``c0 + c1*D + c2*D*log2(D)``, plus the hook's own measured work per sparse group on
either side of the collective (on CPU; docs/cost-model.md). It re-computes the plan once
``OVERHEAD_SETTLE_STEPS`` steps after the first one (the first plan cannot know what a
sparse group costs the hook), every ``replan_every`` steps, and when DDP's bucket layout
changed for good. All ranks derive the plan from the same all-gathered numbers and
compare a checksum; a mismatch raises.

Measured selection (``select="measured"``, the default): the model's plan is only a
proposal. The first one is made before any sparse group ran, so the model's best sparse
plan runs first (the *sparse lead*) and the re-plan ``OVERHEAD_SETTLE_STEPS`` later
makes the candidates. Then the hook runs a bounded *trial* (:mod:`omgs_hook.plan_selection`): a
few candidate plans, each for a few ordinary training steps on a schedule fixed by step
number, each timed from the previous step's end to its own (a step ends with its last
collective, at about the same moment on every rank); the slowest rank's times,
all-gathered, decide (a plan other than TopK-SGD's one group must read more than 3%
faster than it). The winner is kept until the model's inputs change (or, once
settled, it runs slower than the trial's runner-up measured: the two are tried again).
``select="model"`` is the plain model plan (with ``allow_dense=False``: the paper's
algorithm). ``plan=`` pins a plan: no re-planning, no trial.

Collectives are issued only from the hook itself (the autograd thread), in plan order,
identically on every rank. Future callbacks do local work only: a collective or wait
inside a callback deadlocks gloo.
"""

import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import threading
import time
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import communicator
from . import cost_model
from . import plan_job
from . import plan_selection
from . import planner as planner_mod
from . import topk as topk_mod
from . import topology as topology_mod
from .cost_model import (Instance, InstanceError, LinearCost, TopkCost, Unit, check_groups,
                         hierarchical_instance, units_of)
from .background_planner import BackgroundPlanner
from .group_exchange import StepExchange
from .group_plan import GroupPlan, check_exchange
from .measurements import (BackwardMeter, CommTimeMeter, GroupOverheadMeter, TopkTimeMeter,
                           comm_sums, least_median_factor, slowest_rank_timeline,
                           two_level_comm_sums, untimed_per_group_s)
from .profile_file import (Profile, default_profile, load_profile, profile_bandwidth_gaps,
                           profile_mismatches)
from .residual_memory import ResidualMemory, check_residuals, squared_norm

logger = logging.getLogger("omgs_hook")

STATE_FORMAT_VERSION = 1
NONFINITE_POLICIES = ("skip", "raise")
SELECT_MODES = ("measured", "model")
# plan_history keeps the newest this many entries
PLAN_HISTORY_LIMIT = 1000
# a re-plan's inputs are gathered at the end of step s; the plan, computed on a worker
# thread meanwhile, is put in use at the start of step s + PLAN_LAG or, when some rank's
# planner is not done by then, of the first later step at which every rank's is
PLAN_LAG = 2
# A planning job runs in the planner's worker process (no interpreter lock shared with
# the training thread, background_planner) when its instance has at least this many
# units, or when the last job took longer than REPLAN_STALL_BUDGET_S of CPU: on a thread
# it would hold the lock that DDP's and this hook's Python need at every bucket.
# At training's priority only where the host has a core to spare for it, though: on a
# host whose cores the ranks' own threads fill (2 ranks on 2 cores) such a process would
# take CPU from training, which costs more than the shared lock (planner_has_a_core).
ISOLATE_UNITS = 100
REPLAN_STALL_BUDGET_S = 0.02
# There, such a job runs in the planner's low-priority worker process when a plan is in
# use meanwhile (a re-plan): in the cores' idle time, so that it delays its plan instead
# of slowing the steps; the first plan stays on the thread (docs/design.md)
LOW_PRIORITY_REPLANS = True
WORLD_SIZE_POLICIES = ("error", "reset")
UNAPPLIED_POLICIES = ("rewind", "keep")
#: ``min_sparse_numel``'s value where it is not given and ``allow_dense`` is on: sparse
#: groups of fewer elements (4 kB of fp32) are sent dense - the biases and normalisation
#: tensors that a plan can leave alone in a group (docs/convergence.md)
DEFAULT_MIN_SPARSE_NUMEL = 1024
# this many steps in a row whose gradient looked unapplied is not a discard pattern (a
# GAN's discriminator alternates kept and discarded steps) but an optimizer that
# updates parameters without bumping their version (``p.data``): rewinding stops
UNAPPLIED_STREAK_LIMIT = 3
# how a state without a module names parameters, for the errors of a checkpoint that
# does not fit them
MODULELESS_NAMES = (
    "this state has no module (register_comm_hook without OMGSState(module=...)), so it "
    "names parameters param0, param1, ... in the order of the first step's buckets; load "
    "a state saved the same way from the same model, or pass module=ddp_model.module (as "
    "omgs_hook.register does) to load one saved with parameter names")
# options a plan is made for: a checkpoint saved with other values has its plan, trial
# and pending plan job dropped on load (the residuals stay: they are per parameter)
PLAN_OPTIONS = ("density", "strategy", "select", "allow_dense", "min_sparse_numel")
# A bucket layout that differs from the plan's must persist this many steps before it
# forces a re-plan: DDP's one-bucket iterations after a (re)start are transient.
LAYOUT_SETTLE_STEPS = 3
# Error-feedback health (residual norm / gradient norm) is measured on every this many
# steps: two extra reads of each group, amortised to a tenth.
HEALTH_EVERY = 10
# The first plan is made before any sparse group was sent, so the hook's own per-group
# work is unknown to it; this many steps later the plan is made once more with it.
OVERHEAD_SETTLE_STEPS = 5
# steps a new plan runs before the model is checked against it (re-evaluated with the
# times of its own steps; at least measurements.MIN_FRESH_STEPS of them)
CHECK_SETTLE_STEPS = 5
#: a model check whose steps ran in a load spell (their forward, on some rank, over
#: plan_selection.SPELL_FACTOR times that rank's recent level) waits CHECK_SETTLE_STEPS
#: more steps, at most this many times, measuring afresh from there
MAX_CHECK_POSTPONES = 3
#: steps after a plan went into use at which the model is checked once more, on the
#: steps since the first check (``"kind": "settled"``): the steps right after a plan
#: change (the end of a trial or of the warm-up) run slower or faster than the steady
#: state the plan's prediction is for. This check never changes the plan; it only
#: re-predicts it from the settled steps.
SETTLED_CHECK_STEPS = 20


def planner_has_a_core(world_size):
    """Whether this host has a core for each local rank's planner process besides the
    ranks' own threads: usable cores - local ranks * torch threads >= local ranks.
    Local ranks: torchrun's ``LOCAL_WORLD_SIZE``, else (launched otherwise) the world."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (platforms without affinity)
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        local = max(1, int(world_size))
    return cores - local * torch.get_num_threads() >= local


def _check_fraction(name, value):
    # (NumPy scalars are numbers; a tensor is not: it is named as such)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        kind = "a tensor" if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"{name} must be a number in (0, 1], got {kind}: {value!r}")
    if not 0.0 < float(value) <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _no_hook(*args):
    """What a copy of a module hook of the state does: nothing (see _ModuleHook)."""
    return None


def _no_hook_factory():
    return _no_hook


class CopiedState:
    """What a deep copy or a pickle of an :class:`OMGSState` gives: a placeholder. DDP
    keeps ``(hook, state)`` in its ``_comm_hooks``, so ``copy.deepcopy(ddp_model)`` and
    ``torch.save(ddp_model)`` copy the state too - which cannot be copied (its process
    group, threads and buffers). The copied DDP model rebuilds its reducer without the
    hook, as with any comm hook; using this placeholder as a hook state raises."""

    def on_bucket(self, bucket):
        raise RuntimeError(
            "omgs_hook: this is a copy of an OMGSState (copy.deepcopy or pickle of a DDP "
            "model with the hook), which holds no hook state; call omgs_hook.register on "
            "the copied model instead")

    def __repr__(self):
        return "CopiedState()"


class _WeakCallback:
    """A bound method of the state, held weakly: a callback the state hands to an object
    it owns itself (the step's exchange) would otherwise close a reference cycle, and
    the state - with its planner thread - would outlive its DDP model until Python's
    cycle collector happened to run. Calling it once the state is gone does nothing."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args):
        method = self._method()
        return None if method is None else method(*args)


class _MarkUsed:
    """A parameter's gradient hook: notes that this rank's backward computed its
    gradient (the hook state's ``_used_keys``). Holds the set, not the state; a model
    saved with ``torch.save`` drops it without a warning."""

    __torch_unserializable__ = True

    def __init__(self, used, key):
        self._used = used
        self._key = key

    def __call__(self, grad):
        self._used.add(self._key)


class _Reached:
    """A forward output's autograd pre-hook: marks the meter's entry of that forward
    (:meth:`BackwardMeter.current_forward`) as reached by a backward."""

    def __init__(self, entry):
        self._entry = entry

    def __call__(self, grad_outputs):
        self._entry[2] = True


def _output_nodes(output, limit=8, visits=64):
    """The autograd nodes of up to ``limit`` tensors in a forward's output (a tensor, or
    tensors in nested tuples, lists and dicts; at most ``visits`` items looked at)."""
    nodes, stack = [], [output]
    while stack and len(nodes) < limit and visits > 0:
        visits -= 1
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                nodes.append(item.grad_fn)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return nodes


class _ModuleHook(_WeakCallback):
    """A hook the state puts on the user's module (and the optimizer step hook). It
    holds the state weakly, and a deep copy or a pickle of it is a no-op: a copy of the
    module (an EMA model, ``torch.save(model)``) is not the DDP model, and the state
    itself cannot be copied (its process group cannot be pickled)."""

    def __deepcopy__(self, memo):
        return _no_hook

    def __reduce__(self):
        return (_no_hook_factory, ())


def _check_bool(name, value):
    """``value`` as a bool; anything but True or False (a string "False" from a config
    file would read as True) raises ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_int(name, value, minimum):
    """``value`` as a Python int (NumPy integers too, as the float options take NumPy
    floats); a bool, a float or a value under ``minimum`` raises ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_min_sparse_numel(value, allow_dense):
    """``min_sparse_numel`` resolved: None -> the default with ``allow_dense``, else 0."""
    if value is None:
        return DEFAULT_MIN_SPARSE_NUMEL if allow_dense else 0
    value = _check_int("min_sparse_numel", value, 0)
    if value and not allow_dense:
        raise ValueError(
            f"min_sparse_numel={value} needs allow_dense=True: it sends small groups as "
            "dense all-reduces, which allow_dense=False (the paper's all-sparse algorithm) "
            "rules out; pass min_sparse_numel=0 or None with allow_dense=False")
    return value


def _parse_pinned_plan(plan):
    """``plan=`` -> None, ``("keys", GroupPlan)`` or ``("units", groups, dense, predicted,
    exchange)``.

    Raises ValueError naming ``plan`` for anything it cannot use."""
    if plan is None:
        return None
    if isinstance(plan, GroupPlan):
        check_exchange(plan.exchange)
        return ("keys", dataclasses.replace(plan, made_at_step=0))
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        path = os.fsdecode(plan)
        try:
            with open(path, encoding="utf-8") as f:
                plan = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"plan: cannot read a plan from {path!r}: {exc}") from None
    if isinstance(plan, list):
        if len(plan) != 1:
            raise ValueError(f"plan: a list of {len(plan)} plans; pass one")
        plan = plan[0]
    if not isinstance(plan, dict):
        raise ValueError(f"plan must be a dict, a GroupPlan, a JSON path or None, got "
                         f"{type(plan).__name__}")
    if "plan" in plan and "groups" not in plan:  # a state_dict() or a stats() result
        plan = plan["plan"]
        if not isinstance(plan, dict):
            raise ValueError("plan: the saved state holds no plan")
    groups = plan.get("group_keys", plan.get("groups"))
    if not isinstance(groups, list) or not groups or not all(
            isinstance(g, list) and g for g in groups):
        raise ValueError("plan: 'groups' must be a non-empty list of non-empty lists")
    dense = plan.get("dense")
    if dense is None:
        dense = [False] * len(groups)
    if not isinstance(dense, list) or len(dense) != len(groups) or not all(
            isinstance(d, (bool, np.bool_)) for d in dense):
        raise ValueError(f"plan: 'dense' must be a list of {len(groups)} booleans")
    dense = [bool(d) for d in dense]  # (NumPy's too, as the options take NumPy numbers)
    exchange = check_exchange(plan.get("exchange"))  # None: the registration's
    flat = [x for g in groups for x in g]
    predicted = plan.get("predicted_iteration_s")
    if predicted is None:  # a stats()["plan_history"] entry calls it predicted_s
        predicted = plan.get("predicted_s")
    predicted = float(predicted) if isinstance(predicted, (int, float)) else 0.0
    if all(isinstance(x, str) for x in flat):
        if len(set(flat)) != len(flat):
            raise ValueError("plan: a parameter appears in more than one group")
        layout = plan.get("layout") or groups
        try:
            layout = tuple(tuple(str(k) for k in b) for b in layout)
        except TypeError:
            raise ValueError("plan: 'layout' must be a list of lists of parameter names") from None
        return ("keys", GroupPlan(groups=tuple(tuple(g) for g in groups), dense=tuple(dense),
                                  layout=layout, strategy="pinned",
                                  predicted_iteration_s=predicted, made_at_step=0,
                                  exchange=exchange))
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
           for x in flat):
        try:
            units = check_groups([[int(x) for x in g] for g in groups], len(flat))
        except InstanceError as exc:
            raise ValueError(f"plan: {exc}") from None
        return ("units", units, tuple(dense), predicted, exchange)
    raise ValueError("plan: groups must hold parameter names or bucket indices, not a mix")


def _corrected(base, correction, exchange=None):
    """``base`` (the flat model from the measurements) plus what the last trial measured
    beyond it (a :class:`plan_selection.Correction`): the top-k's fixed cost gains its
    per-group term, the dense cost's beta its per-element term, each clamped at zero.
    The constant is left out: it is the trial's level, measured under the load of its
    steps, and moves with it (a trial in a loaded spell carried +150 ms into every later
    prediction); the tail and the rest of the step come from the fresh measurements,
    and a constant changes no plan's rank. The group term is centred on the trial's
    typical plan: ``level_s`` takes back what the term, as clamped, adds to that plan
    (``correction.ref_plan``) as ``base``'s timeline prices it - part of it hides behind
    the network where that is the critical path. Without a reference plan this timeline
    can price (one saved before it, a two-level plan, another layout) it takes back the
    term times ``sparse_groups_ref``. Never below minus the rest of the step outside
    backward, so that no prediction is absurd. ``exchange``: the registration's
    exchange, which a reference plan saved without one ran on."""
    if correction is None:
        return base
    dense = base.dense
    if dense is not None:
        dense = LinearCost(alpha_s=dense.alpha_s, beta_s_per_byte=max(
            0.0, dense.beta_s_per_byte + correction.dense_s_per_element / 4))
    topk = base.topk
    c0 = max(0.0, topk.c0 + correction.sparse_group_s)
    dense_only = dataclasses.replace(base, dense=dense)
    corrected = dataclasses.replace(dense_only, topk=TopkCost(c0=c0, c1=topk.c1, c2=topk.c2))
    ref = _flat_reference_plan(base, correction, exchange)
    if ref is not None:  # the group term's share only: the dense term is not centred
        groups, ref_dense = ref
        added = (planner_mod.predicted_iteration_s(corrected, groups, ref_dense)
                 - planner_mod.predicted_iteration_s(dense_only, groups, ref_dense))
    else:
        added = (c0 - topk.c0) * correction.sparse_groups_ref
    level = max(-(base.forward_s + base.tail_s), base.level_s - added)
    return dataclasses.replace(corrected, level_s=level)


def _flat_reference_plan(base, correction, exchange):
    """``(groups, dense)`` of the correction's reference plan if ``base`` can price it:
    a flat plan that covers ``base``'s units in order, dense groups only where ``base``
    has a dense cost (``dense`` None where it has none); else None."""
    if correction.ref_plan is None or not correction.sparse_group_s:
        return None
    groups, dense, ref_exchange = correction.ref_plan
    if (ref_exchange or exchange or "flat") != "flat" or len(dense) != len(groups):
        return None
    if [u for g in groups for u in g] != list(range(len(base.layers))):
        return None  # planned over other units (the layout changed since the trial)
    if base.dense is None:
        return (groups, None) if not any(dense) else None
    return groups, list(dense)


def _two_level_corrected(two_level, correction):
    """``(ranks_per_node, intra, inter, inter_dense)`` with the correction's per-element
    dense term on the measured ``inter_dense`` too: a dense group of D elements all-reduces
    a D / L shard between the nodes, so each shard element carries L times the term.
    (Without a measured ``inter_dense`` the derived one comes from the corrected flat
    dense cost already.)"""
    per_node, intra, inter, inter_dense = two_level
    if correction is None or inter_dense is None or not correction.dense_s_per_element:
        return two_level
    beta = inter_dense.beta_s_per_byte + correction.dense_s_per_element * per_node / 4
    return per_node, intra, inter, LinearCost(alpha_s=inter_dense.alpha_s,
                                              beta_s_per_byte=max(0.0, beta))


# the planning of one re-plan lives in a torch-free module, so that it can run in the
# planner's worker process (background_planner)
_compute_plan = plan_job.compute_plan


def _check_plan_keys(plan, shapes, optional=()):
    """A pinned plan of parameter names must cover exactly the trained parameters
    (``optional``: those it may leave out, which DDP never hands the hook)."""
    planned = {k for g in plan.groups for k in g}
    missing = sorted(set(shapes) - planned - set(optional))
    unknown = sorted(planned - set(shapes))
    if missing or unknown:
        raise ValueError(
            f"plan: the pinned plan does not match the model's parameters (not in the plan: "
            f"{missing[:5]}, not in the model: {unknown[:5]})"
        )


def _check_sparse_group_sizes(plan, shapes):
    """A pinned plan's sparse groups must fit int32 indices (planned ones are cut to fit:
    planner._fit_index_range). ``shapes``: {key: shape}."""
    limit = cost_model.MAX_SPARSE_GROUP_NUMEL
    for j, (group, dense) in enumerate(zip(plan.groups, plan.dense)):
        size = sum(math.prod(shapes[k]) for k in group)
        if not dense and size > limit:
            raise ValueError(
                f"plan: the pinned plan's sparse group {j} holds {size} elements, more than "
                f"one sparse group can index ({limit}: int32 indices); split it or mark it "
                "dense"
            )


class OMGSState:
    r"""State of the OMGS hook: options, residuals, measurements and the current plan.

    Args:
        process_group: the process group to communicate over (None: the default group).
            With ``register_comm_hook`` on a DDP model built over a subgroup, pass DDP's
            group here: the hook cannot see it, and on the default group it would average
            with every rank of the job (:func:`register` passes it).
        density (float): fraction rho of each group's elements that is sent, in (0, 1].
            ``1.0`` means plain all-reduce (no sparsification, no residual).
        strategy (str): how buckets are merged into groups: ``"optimal"`` (default, the
            exact minimum of the cost model - OMGS), ``"greedy"`` (the paper's merge
            rule), ``"single"`` (one group: TopK-SGD), ``"layerwise"`` (every bucket
            alone: LAGS-SGD) or ``"threshold:BYTES"`` (close a group at BYTES of gradient).
            Whatever the strategy, a sparse group holds at most 2**31 - 1 elements (its
            indices are int32): a larger one is cut into consecutive pieces.
        warmup_steps (int): steps of dense all-reduce at the start, used to measure
            backward times and to let DDP rebuild its buckets. Default 5.
        density_warmup_steps (int): after the dense warm-up, lower the density
            exponentially from ``density_warmup_start`` to ``density`` over this many
            steps (DGC's warm-up: very low densities converge more slowly at first,
            because error feedback releases most entries only after many steps).
            Default 0: ``density`` from the first sparse step, as in the OMGS paper.
            Plans are always made for ``density``.
        density_warmup_start (float): the first sparse step's density when
            ``density_warmup_steps > 0``, in (0, 1]. Default 0.25 (as DGC). No effect
            when it is not above ``density``.
        replan_every (int): re-compute the plan every this many steps. Default 100.
        profile: path of a profile JSON written by ``omgs-profile`` (or a ``Profile``);
            None uses the documented defaults of :func:`omgs_hook.profile_file.default_profile`.
            A profile measured with another world size, backend or device type is used
            but warned about.
        topk_backend (str): ``"auto"`` (CuPy kernel on CUDA when available, else the exact
            sampled-threshold selector), ``"torch"``, ``"sampled"`` or ``"cupy"``.
        allow_dense (bool): let the planner send a group as a dense all-reduce where the
            cost model says that is cheaper. Default True.
        min_sparse_numel (int or None): with ``allow_dense``, every plan - the model's,
            each trial candidate, any strategy's - sends its sparse groups of fewer
            elements dense (:func:`omgs_hook.planner.small_groups_dense`). A convergence
            guard: a LayerNorm or bias alone in a sparse group sends 1-3 entries a step,
            each about every ``1 / density`` steps with that many steps of residual, and
            with momentum that can diverge (a held-out language model did, at density
            0.01 and 0.001: docs/convergence.md); sent dense, such a group costs about
            its sparse all-gather's startup. None (default): ``DEFAULT_MIN_SPARSE_NUMEL``
            (1024) with ``allow_dense``, 0 without; 0 turns the guard off. A value above
            0 needs ``allow_dense=True`` (``allow_dense=False`` is the paper's algorithm,
            whose groups are all sparse). A pinned ``plan`` keeps its own flags. Steps
            with no plan in use (the first steps after the warm-up, while the first plan
            is made) and parameters no plan names (unfrozen since) go out as one sparse
            group, unguarded.
        select (str): how the plan in use is chosen. ``"measured"`` (default): after each
            model-based plan, a bounded trial times a few candidate plans for real (the
            model's choice, the optimum without dense groups, all-dense (DDP's own
            all-reduce per bucket, with ``allow_dense``), ``single``, ``layerwise``,
            ``greedy``, the model's best plans one group fewer and one more, and up to
            two coarser ones between ``single`` and the optimum's groups; with
            ``topology="auto"`` on a two-level cluster also ``flat:optimal`` and
            ``flat:single`` on the flat exchange; duplicates
            and plans the model predicts over 1.5x its best are left out; every one
            with ``min_sparse_numel``'s floor) and keeps the
            fastest by the slowest rank's step time, except that a plan other than
            TopK-SGD's one sparse group has to read more than 3% faster than it to be
            chosen over it (``plan_selection.BASELINE_MARGIN``: within that, over the
            stored cluster runs, the trial's lead of a multi-group plan was not real),
            and that plan goes on to the confirm round whenever the screen read it
            within 60% of the best (``BASELINE_WINDOW``).
            ``"model"``: the cost model's plan
            as is (with ``allow_dense=False`` this is the OMGS paper's algorithm,
            unchanged). Only ``strategy="optimal"`` has a full candidate set; another
            strategy's trial only compares its plan with the same groups all sparse,
            when the model sent some dense.

            **Trial budget.** Up to three rounds (``plan_selection.Trial``): every candidate
            runs ``1`` settle step (not counted) and ``1`` counted step, in order and then
            again in reverse order (two passes, so that a machine that speeds up or slows
            down over the round costs every candidate alike). Before the first trial of a
            run the model's best sparse plan runs ``7`` steps (the *sparse lead*: the
            candidates are then made from its steps, with the top-k and the hook's own
            per-group work measured; where those are known already, a resumed run, the
            trial starts with ``6`` uncounted steps of the model's choice instead, as the
            steps right after the warm-up run slow); those within 30% of the best (at
            most 3) run again in reverse order with ``3`` counted steps; those still
            closer to the best than the noise (at least 3%; the larger of the spread of
            the confirm round's samples and how far one candidate's two screen turns
            moved against the others') run two more turns each, in mirrored order
            (``a b c c b a``), ``2`` counted steps per turn. A
            candidate's time weights each round by its turns there. A step that a load spell
            slowed (on some rank the forward pass after it took over 1.3x that rank's median
            forward of the trial: on CPU; on CUDA no step is judged) is left out of its
            candidate's median; a candidate whose every sample in a round was slowed runs
            its turn again right after (at most 2 such retakes per trial). Then the
            winner and the runner-up (when within 30% of it) run side by side, 20 pairs of
            turns of 1 settle and 1 counted step (``W R, R W, ...``), and the runner-up
            takes over when the median of its readings over the winner's in the pairs is
            below 1: adjacent steps share the host's slow and fast phases, which the
            rounds before cannot average out. A full trial (the
            first plan, a bucket-layout change) has at most 7 candidates: at most
            ``7 * 2 * 2 + (3 + 2) * 4 + 3 * 2 * 3 + 2 * 20 * 2 = 146`` steps (58
            without load spells and without the side-by-side pairs), after the first
            trial's 7 sparse-lead steps; as the rounds narrow to plans within a few % of each
            other, most of those steps run at about the winner's pace
            (``stats()["selection"]`` reports each trial's ``excess_steps``: its cost in
            steps of the winner; -2 to 21 steps, the pairs included, on a held-out
            18-bucket model, docs/benchmarks.md). A later trial (a periodic re-plan whose
            model plan differs from the one the last trial started from, e.g. after an
            online refit) compares the kept plan with the new model plan only (at most 36
            steps, no side-by-side pairs) and starts only while all later trials together
            stay within 3% of the steps run; otherwise the kept plan stays. (With ``topology="auto"`` resolved two-level it
            starts when the two-level or the flat model's plan changed, and also holds the
            flat model's plan ``flat:<strategy>`` when that differs from the kept plan and
            the budget has room for three candidates, at most 50 steps.) Trial steps are
            ordinary training steps (error feedback is per parameter, so switching plans
            between steps changes no result); what a trial costs is the slower candidates'
            extra time over those steps. One small all-gather per measuring round (at most
            three per trial, and one for the side-by-side pairs), from the hook. The
            trial's measurements also refit the model
            (a constant, seconds per element sent dense, seconds per sparse group:
            ``stats()["cost_correction"]``) for the later re-plans. Once settled (20
            steps after it went into use) the winner's step time is compared with the
            other candidates' trial times: when it runs slower than one of them by more
            than the trial's tie margin, the two run a trial of their own (the winner
            first; once per trial, at most 36 steps, counted in the later trials' 3%).
        plan: pin the plan: a plan saved from a previous run (``state.stats()["plan"]``,
            ``state.state_dict()`` or its ``"plan"``), the output of ``omgs-plan`` (groups
            of bucket indices, adopted at the end of the warm-up; the layout must have
            as many buckets), a :class:`~omgs_hook.group_plan.GroupPlan`, or the path of
            a JSON file holding one of these. The hook then never re-plans nor runs a
            trial, so the same seed and the same pinned plan give bit-identical
            training on the same machine. Default None.
        refit_online (bool): refit alpha/beta of the sparse all-gather from the hook's own
            timed collectives at every re-plan (averaged across ranks), so the plan
            follows the real network. Costs a clock read per collective; noisy on shared
            machines. Default False.
        measured_comm (bool): scale the profile's collective costs - the sparse
            all-gather (with the measured write-back) and the dense all-reduce, each by
            its own factor - to what this run's collectives took over the last 16 steps,
            as the timeline counts them (from issue, or the previous collective's end, to
            the end of the write-back). The profile times collectives alone; in training
            they share the cores (gloo) with backward, and the network may have changed.
            Per rank the factor is the median over those steps of each step's measured
            over modelled time, then the least over ranks (a rank that waits for a
            straggler measures the wait too); identical on every rank. A re-plan at
            step N reads steps before N only, and never the first step this state ran
            (the process group's first use).
            ``stats()["planned_with"]["comm_scale"]``. With the two-level exchange each
            link class has its own factor, from the same per-step ratio, per-rank median
            and least over ranks, over the last 16 two-level steps: ``intra`` from the
            intra-node all-gathers (each from the end of its group's inter-node
            collective to the end of its write-back), ``inter`` from the inter-node
            sparse all-gathers and ``inter_dense`` from the inter-node all-reduces (each
            from its issue, or the previous group's end, to its completion); the
            intra-node reduce-scatter is not timed (gloo gives it no future), it is
            priced by the scaled ``intra`` line. They scale the two-level instance's
            link classes (``stats()["planned_with"]["two_level_scale"]``); the flat
            factors then come from the steps that ran on the flat exchange (the flat
            candidates of a ``topology="auto"`` trial, a flat winner) and scale only
            the flat instance those candidates are priced by (docs/hierarchical.md).
            Host clock only: on CUDA it times launches, not the GPU, and the profile
            stands alone. Default True.
        nonfinite (str): what to do when any rank's gradient holds NaN/Inf: ``"skip"``
            (default) - every rank gets a non-finite gradient for the affected group (so
            an AMP ``GradScaler`` skips the step) and the residual stays exactly as it
            was; ``"raise"`` - the same, and then ``backward()`` raises
            :class:`FloatingPointError` on every rank (after DDP has finished the
            step, so the next step runs normally).
        log_every (int): log a one-line summary at INFO every this many steps (0: never).
        module: the model (``ddp_model.module``). Gives residuals their parameter names
            in ``state_dict()`` and times the forward pass. :func:`register` passes it.
        measure_window (int): steps of backward timings the planner's medians use.
        on_world_size_change (str): when ``load_state_dict`` gets a state saved with
            another world size, topology or by another rank (a checkpoint written by
            rank 0 alone and loaded everywhere): ``"error"`` (default) or ``"reset"``
            (drop the residuals, logging their norm - they were another rank's, or
            another split's, error feedback).
        local_clip_norm (float): DGC's local gradient clipping (off by default). Each
            rank scales its own gradient *before* it is added to the residual, so that
            the gradient of a group of D elements (out of all N elements) has an L2 norm
            of at most ``local_clip_norm * sqrt(D / N) / sqrt(world_size)``: the total
            norm threshold you would give ``clip_grad_norm_``, scaled by
            ``world_size ** -0.5`` as DGC does, and split over the groups in proportion
            to their size (groups are sent while backward still runs, so the whole
            gradient's norm is never available in time). Needs ``module`` (the
            parameter count); :func:`register` passes it.
        track_staleness (bool): keep, per element, the number of steps since it was last
            sent (an int32 counter per element: 4 bytes each, and one pass per group
            and step), reported per group in ``stats()["staleness"]``. Default False.
            Not available with the two-level exchange.
        topology (str): ``"flat"`` - every rank's top-k entries go to every other rank
            (one all-gather per group) -, ``"hierarchical"`` - the two-level exchange of
            :mod:`omgs_hook.hierarchical`: an intra-node reduce-scatter, top-k of each
            local rank's shard of the node's sum, a sparse all-gather between nodes only,
            an intra-node all-gather (docs/hierarchical.md) -, or ``"auto"`` (default):
            hierarchical when there is more than one node and more than one rank per
            node, else flat. Subgroups are created at registration (every rank must
            construct the state at the same point, as with DDP itself). With ``"auto"``
            resolved to the two-level exchange and ``select="measured"``, the trial also
            times plans on the flat exchange (``flat:optimal``, ``flat:single``, planned
            with the flat model, in the last two of its at most 7 places) and the run
            keeps whichever exchange is faster; each plan carries its exchange
            (``stats()["plan"]["exchange"]``). An explicit ``"hierarchical"`` or
            ``"flat"`` is kept as asked.
        ranks_per_node (int): ranks per node; consecutive ranks form a node. Default
            None: torchrun's ``LOCAL_WORLD_SIZE`` (unset: one rank per node for
            ``"auto"``; an error for ``"hierarchical"``). Must divide the world size.
            A DDP model on a subgroup of the job (``process_group``, e.g. the
            data-parallel groups of a model-parallel job) always exchanges flat - the
            two-level exchange's node groups need every rank of the job -: ``"auto"``
            resolves to flat there and ``"hierarchical"`` raises ValueError; nodes are
            the job's (global rank ``g`` on node ``g // ranks_per_node``), for the byte
            counts of ``stats()``.
        on_unapplied (str): what happens to a step's error feedback when its gradient is
            thrown away instead of applied - the parameters' gradients were cleared
            (``zero_grad()``, to None or to zeros) and no optimizer step changed any of
            them before the module's next forward pass. That is how a GAN's generator
            step leaves the discriminator's gradients. Plain DDP drops such a gradient;
            with error feedback its unsent part would stay in the residual and be
            applied in a later step, pushing the discriminator the generator's way.
            ``"rewind"`` (default): the step's residual update is undone at that next
            forward (bit-exact: the residuals are those before the step), counted in
            ``stats()["total"]["rewound_steps"]``, logged at WARNING the first time.
            ``"keep"``: the residual keeps it (error feedback of every backward pass).
            Needs ``module`` (the forward pre-hook); :func:`register` passes it. A
            gradient kept for accumulation (not cleared) is never rewound. Where no
            ``torch.optim`` optimizer holding these parameters has stepped yet, after
            ``UNAPPLIED_STREAK_LIMIT`` (3) rewound steps in a row the hook concludes that
            the optimizer updates parameters without bumping their version (``p.data``),
            stops rewinding and warns (a ``torch.optim`` optimizer's steps are seen, so
            with one a run of skipped updates is rewound however long). To drop such
            gradients without sending them at all, run that backward under
            ``ddp_model.no_sync()``. When an optimizer step touched some of the step's
            parameters but not others (one DDP model holding a generator and its
            discriminator, an optimizer each), the residual update of each parameter no
            optimizer step touched and whose gradient was cleared (and that this rank
            did not park as unused) is undone, the others' kept:
            ``stats()["total"]["partly_rewound_steps"]`` (flat exchange only; the
            two-level exchange's shard residuals mix parameters, and such a step is kept).
            A loop whose module forward spans several backwards (Lightning's
            ``training_step``) calls :meth:`before_backward` before each backward
            instead; ``OMGSStrategy`` does.
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision run (default
            None). The hook sees the gradients multiplied by the loss scale, and so
            does the residual it keeps; when the scaler changes the scale (halved after
            an overflow, doubled after ``growth_interval`` good steps) a residual kept
            at the old scale would be applied at twice or half its value. With the
            scaler given, the hook reads its scale at the first forward of each step
            (``get_scale()``: on CUDA one small synchronisation per step; read again
            where ``update()`` has written the scale since) and rescales
            the stored residuals when it moved; ``local_clip_norm`` then applies to the
            unscaled gradient. ``state_dict()`` records the scale its residuals are at
            (``"residual_scale"``), so a resumed run converts them too.
    """

    def __reduce__(self):
        # (deepcopy falls back to this too) see CopiedState
        return (CopiedState, ())

    def __init__(
        self,
        process_group=None,
        density=0.001,
        strategy="optimal",
        warmup_steps=5,
        density_warmup_steps=0,
        density_warmup_start=0.25,
        replan_every=100,
        profile=None,
        topk_backend="auto",
        allow_dense=True,
        select="measured",
        plan=None,
        refit_online=False,
        measured_comm=True,
        nonfinite="skip",
        log_every=100,
        module=None,
        measure_window=32,
        on_world_size_change="error",
        local_clip_norm=None,
        track_staleness=False,
        topology="auto",
        ranks_per_node=None,
        on_unapplied="rewind",
        min_sparse_numel=None,
        grad_scaler=None,
        _ddp_ignored=(),
    ):
        self.density = _check_fraction("density", density)
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler (with get_scale()) "
                             f"or None, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        # the loss scale the stored residuals are in (None: not known yet - nothing stored
        # under a scaler); the scale read at this step's first forward, for bucket 0
        self._residual_scale = None
        self._forward_scale = None
        self._forward_scale_version = None  # _scale_version() when it was read
        try:
            self.strategy = planner_mod.parse_strategy(strategy)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"strategy: {exc}") from None
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.density_warmup_steps = _check_int("density_warmup_steps", density_warmup_steps, 0)
        self.density_warmup_start = _check_fraction("density_warmup_start", density_warmup_start)
        self.replan_every = _check_int("replan_every", replan_every, 1)
        self.log_every = _check_int("log_every", log_every, 0)
        measure_window = _check_int("measure_window", measure_window, 1)
        valid_backends = ("auto",) + tuple(topk_mod.BACKENDS)
        if topk_backend not in valid_backends:
            raise ValueError(
                f"topk_backend must be one of {', '.join(valid_backends)}, got {topk_backend!r}"
            )
        self.topk_backend = topk_backend
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        if on_world_size_change not in WORLD_SIZE_POLICIES:
            raise ValueError(
                f"on_world_size_change must be one of {WORLD_SIZE_POLICIES}, "
                f"got {on_world_size_change!r}"
            )
        self.on_world_size_change = on_world_size_change
        if on_unapplied not in UNAPPLIED_POLICIES:
            raise ValueError(f"on_unapplied must be one of {UNAPPLIED_POLICIES}, "
                             f"got {on_unapplied!r}")
        self.on_unapplied = on_unapplied
        # the parameters of the step in progress, then (after its last bucket) their
        # versions, read at the next forward to tell an applied gradient from a dropped one
        self._step_params = []
        self._applied_check = None
        # False once before_backward() was called: the loop (Lightning) marks each step
        # right before its backward, and the module's forward no longer decides
        self._check_at_forward = True
        self._unapplied_streak = 0
        self._rewind_warned = False
        self._partial_rewind_warned = False
        self.allow_dense = _check_bool("allow_dense", allow_dense)
        self.min_sparse_numel = _check_min_sparse_numel(min_sparse_numel, self.allow_dense)
        self.refit_online = _check_bool("refit_online", refit_online)
        self.measured_comm = _check_bool("measured_comm", measured_comm)
        if local_clip_norm is not None and (
                isinstance(local_clip_norm, (bool, np.bool_))
                or not isinstance(local_clip_norm, (int, float, np.integer, np.floating))
                or not 0 < float(local_clip_norm) < math.inf):
            raise ValueError(
                f"local_clip_norm must be a positive number or None, got {local_clip_norm!r}")
        if local_clip_norm is not None and module is None:
            raise ValueError("local_clip_norm needs the module (its parameter count): use "
                             "omgs_hook.register(ddp_model, ...) or pass module=")
        self.local_clip_norm = None if local_clip_norm is None else float(local_clip_norm)
        self.track_staleness = _check_bool("track_staleness", track_staleness)
        self._topology_options = (topology_mod.check_topology_option(topology),
                                  topology_mod.check_ranks_per_node_option(ranks_per_node))
        if topology == "hierarchical" and track_staleness:
            raise ValueError("track_staleness is not available with topology='hierarchical'")
        self.topology = None  # resolved (with the subgroups) at registration / first step
        self._subgroups = None
        if select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}, got {select!r}")
        self.select = select
        self._pinned = _parse_pinned_plan(plan)

        if profile is None or isinstance(profile, Profile):
            self._profile_arg = profile
        elif isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
            self._profile_arg = load_profile(profile)  # ProfileError names the problem
        else:
            raise TypeError(f"profile must be a path, a Profile or None, got {type(profile).__name__}")
        self.profile = None  # resolved at the first step (needs the device and world size)

        group_type = getattr(dist, "ProcessGroup", None)
        if (process_group is not None and group_type is not None
                and not isinstance(process_group, group_type)):
            raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None "
                             f"(the default group), got {type(process_group).__name__}")
        self.process_group = process_group
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ValueError(f"module must be a torch.nn.Module (ddp_model.module) or None, "
                             f"got {type(module).__name__}")
        self.module = module
        self._names = {}
        self._shapes = {}
        # a module-less state loaded a checkpoint: its residuals' parameters are known
        # once the next step has seen every bucket (_end_step)
        self._unplaced_check = False
        if module is not None:
            self._index_module(module)

        self.memory = ResidualMemory()
        self.meter = BackwardMeter(window=measure_window)
        self.overhead = GroupOverheadMeter()
        self.writeback = GroupOverheadMeter()
        self.topk_times = TopkTimeMeter()
        self._awaiting_overhead = False
        self._planned_with = None
        self.plan = None
        self.step = 0
        self._selector = None
        self._device = None
        self._exchange = None
        self._consistency_checked = False
        self._layout_streak = (None, 0)
        self._resumed_layout = None  # the checkpoint's last layout (load_state_dict)
        # how many steps in a row the checkpoint's layout had held, until the first step
        # after the load has used it (_layout_after_load); None otherwise
        self._resumed_streak = None
        self._stand_ins_left = 0  # steps after a load still to stand for its layout
        self._first_due_at = None  # the step the first plan was due at, if it waited
        self._fitter = None
        if self.refit_online:
            from .fitting import OnlineLinearFitter

            self._fitter = OnlineLinearFitter()
        self._comm_override = None
        # measured_comm: what the last steps' collectives took, by kind (the flat
        # exchange's), and a two-level run's two-level steps by link class
        self._comm_times = CommTimeMeter()
        self._two_level_times = CommTimeMeter(kinds=3)
        # finished steps whose measurements (collective times, per-group work) are not
        # fed to the meters yet: a step finishes on whichever thread completes its last
        # collective, and feeding the meters there raced with the re-plan that reads
        # them at the end of the next step's backward. They are fed on the autograd
        # thread instead, steps before the current one only (_ingest_finished), so a
        # re-plan at step N always sees exactly the steps before N.
        self._finished = collections.deque()
        # the first step this state runs times the process group's first use of its
        # collectives (2-6x a later step's, 2 gloo ranks): never a sample of the network
        self._collectives_warm = False
        # the plan in use against reality: this rank's (step, seconds) from the previous
        # step's end to this one's (:meth:`_on_step_finished`),
        # the step at which the plan in use is re-evaluated with its own steps' times, and
        # the result of that (stats()["model_check"])
        self._step_times = collections.deque(maxlen=measure_window)
        self._check_at = None
        self._check_postponed = 0  # times the pending check waited out a load spell
        self._settled_at = None  # the step of the plan's settled check, when pending
        self._model_check = None
        # measured selection: the running trial, its GroupPlans and layout, the last
        # finished trial's report, the model plan the last trial started from
        self._clock = time.perf_counter  # step ends (tests inject a fake per rank)
        # the trial's load probe of the step in progress (tests inject a fake with the clock)
        self._load_probe = self.meter.forward_in_progress_s
        self._step_end = None  # (step index, clock) of the last step's end
        # (step index, seconds, the loop's excess gap in them) of the step that ended
        # last, until the next step's bucket 0 records it
        self._step_sample = None
        # (step index, seconds) of the forward of the step in progress, during a trial:
        # the next step's record divides its time by its pace (plan_selection, "Pace")
        self._step_forward = None
        self._last_step_s = None
        self._trial = None
        self._trial_plans = []
        self._trial_layout = None
        self._last_trial = None
        self._model_key = None
        self._flat_model_key = None  # the flat model's plan when the last trial started
        self._retrial_steps = 0
        # the last trial's winner was checked against the other candidates once settled
        # (_maybe_regret_trial): once per trial
        self._regret_checked = False
        self._closed = False  # close() was called: the hook refuses to run on
        # the step's compute (plan_selection.compute_s) when the last trial was planned: a
        # later periodic re-plan trials again when it has moved (WORKLOAD_FACTOR). For
        # the first trial (and a new layout's) it is the first periodic re-plan's after
        # it instead: those were planned from the dense warm-up, whose backward shares
        # the cores with the all-reduce - measured 27 ms there against 15-16 ms in the
        # sparse steps after, which read as a moved workload at every re-plan
        self._trial_workload_s = None
        self._correction = None  # plan_selection.Correction fitted from the last trial
        self._plan_history = []
        self._planner = BackgroundPlanner()
        self._plan_job = None  # the inputs of the plan being computed (plain values)
        # (job, work, gathered rows, this rank's plans) of the readiness all-gather issued
        # at the end of a step whose next step may switch to the job's plan; see
        # _issue_ready_probe
        self._ready_probe = None
        # (layout, reason, work, gathered rows, row layout, seconds taken) of a re-plan
        # started at the end of a step and finished at the next bucket 0; see _start_replan
        self._pending_replan = None
        # a logging thread's stats() may finish it while bucket 0 does: once, by one of them
        self._replan_lock = threading.RLock()  # (re-entered by a log handler: a no-op)
        self._finishing_replan = False  # _finish_replan is running (see there)
        self._polled_result = None  # the pending job's result, once polled, until in use
        self._probe_error = None  # what polling for a probe raised (see _issue_ready_probe)
        self._replan_stall = (0.0, 0.0)  # (last, largest) seconds; see _note_stall
        self._numels_of = None  # (layout, elements per bucket); see _layout_numels
        self._coarse_warned = False
        self._two_level_warned = False
        self._last = None
        self._last_exchange = None
        self._plan_instance = None  # (layout, Instance) of the last re-plan
        self._base_instance = None  # (layout, Instance before the correction, two-level costs)
        self._flat_instance = None  # (layout, the flat Instance) of the last re-plan
        self._forward_end_wall = None
        self._health = None  # (step, [(grad^2, residual^2) per group]) of the last measured step
        self._staleness = None  # (step, [(keys, int32 ages) per sparse group])
        self._totals = {"steps": 0, "bytes_sent": 0, "dense_bytes": 0, "elements": 0,
                        "selected": 0, "nonfinite_steps": 0, "replans": 0, "trials": 0,
                        "warmup_steps": 0, "warmup_elements": 0, "warmup_bytes": 0,
                        "sparse_group_elements": 0, "sparse_group_selected": 0,
                        "inter_node_bytes": 0, "intra_node_bytes": 0, "rewound_steps": 0,
                        "partly_rewound_steps": 0, "unused_restored": 0,
                        "replans_dropped": 0}
        self._hooks = []
        # keys whose gradient this rank computed since the last synchronised step, where
        # track_local_use() installed the hooks that note them; None: not tracked
        self._used_keys = None
        # (weakly) the DDP model register() put the hook on: whether it has a static
        # graph, which delays DDP's bucket rebuild by a step; None: registered by hand
        self._ddp_ref = None
        # per step (see _start_group_tracking): the plan's key -> group map, and how many
        # parameters of each group have not arrived (0: the group is sent)
        self._group_of = (None, {})
        self._group_missing = []
        if self._pinned is not None and self._pinned[0] == "keys" and module is not None:
            # parameters DDP ignores (its parameters_to_ignore: the module's ignore list,
            # delay_all_reduce_named_params) are in no bucket, so in no saved plan: a plan
            # saved from such a model was refused here, naming them as missing
            ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
            _check_plan_keys(self._pinned[1], self._shapes, ignored | set(_ddp_ignored))
            _check_sparse_group_sizes(self._pinned[1], self._shapes)
        if dist.is_available() and dist.is_initialized():
            self._setup_topology()
        # optimizer steps seen over the module's parameters (_on_optimizer_step)
        self._optimizer_steps = 0
        self._optimizers_seen = weakref.WeakKeyDictionary()
        # optimizer -> the value of _optimizer_steps its last step set (its held
        # parameters are untouched by it since any count at or above that)
        self._optimizer_last_step = weakref.WeakKeyDictionary()
        self._param_ids = frozenset()
        if module is not None:
            self._param_ids = frozenset(id(p) for p in module.parameters() if p.requires_grad)
            self._hooks.append(module.register_forward_pre_hook(
                _ModuleHook(self._on_forward_pre)))
            self._hooks.append(module.register_forward_hook(_ModuleHook(self._on_forward)))
            self._hooks.append(module.register_load_state_dict_post_hook(
                _ModuleHook(self._on_module_load)))
            step_hook = register_optimizer_step_post_hook(_ModuleHook(self._on_optimizer_step))
            self._hooks.append(step_hook)
            # torch-wide: removed with the state even where close() is never called
            weakref.finalize(self, step_hook.remove)

    # ------------------------------------------------------------------ set-up helpers
    def _index_module(self, module):
        for name, sub in module.named_modules():
            # a frozen table (Embedding.from_pretrained(..., freeze=True, sparse=True))
            # produces no gradient at all: DDP gives it no bucket, so it is no obstacle
            if getattr(sub, "sparse", False) is True and isinstance(
                    sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and any(
                    p.requires_grad for p in sub.parameters(recurse=False)):
                raise ValueError(
                    f"module {name!r} ({type(sub).__name__}(sparse=True)) produces sparse "
                    "gradients, which OMGS cannot sparsify and DDP gives no comm hook a "
                    "dense bucket of; construct it with sparse=False"
                )
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            if not param.is_floating_point():
                raise TypeError(
                    f"parameter {name!r} has dtype {param.dtype}: OMGS sparsifies floating-"
                    "point gradients only"
                )
            self._names[id(param)] = name
            self._shapes[name] = tuple(param.shape)
            if self.density < 1.0 and param.numel() > cost_model.MAX_SPARSE_GROUP_NUMEL:
                raise ValueError(
                    f"parameter {name!r} has {param.numel()} elements, more than one sparse "
                    f"group can index ({cost_model.MAX_SPARSE_GROUP_NUMEL}: int32 indices); "
                    "OMGS cannot sparsify it (split the tensor, or train with density=1)"
                )

    def _key(self, param):
        key = self._names.get(id(param))
        if key is None:
            # No module given: name parameters by first appearance (bucket order), which is
            # the same on every rank and in every run of the same script.
            key = f"param{len(self._names)}"
            loaded = self.memory.unplaced().get(key)
            if loaded is not None and loaded != tuple(param.shape):
                # (with a module, load_state_dict compared the shapes already)
                raise ValueError(
                    f"residual for {key!r} has shape {loaded}, the parameter has "
                    f"{tuple(param.shape)}: {MODULELESS_NAMES}")
            self._names[id(param)] = key
            self._shapes[key] = tuple(param.shape)
        return key

    def _on_forward_pre(self, module, args):
        # a forward without autograd (an evaluation under no_grad) is not part of a
        # training step: timing it would count the evaluation as an iteration
        if torch.is_grad_enabled():
            if self._check_at_forward:
                self._check_applied()
            self.meter.forward_started()
            if self.grad_scaler is not None and (
                    self._forward_scale is None
                    or self._forward_scale_version != self._scale_version()):
                # read here, not at bucket 0: on CUDA get_scale() synchronises, and here
                # it waits for the optimizer step only, not for backward's kernels. Read
                # again when the scale moved since: a forward whose backward never
                # reached bucket 0 (under no_sync(), a GAN's generator step) left its
                # reading, and the next step took it after scaler.update() had changed
                # the scale
                self._forward_scale_version = self._scale_version()
                self._forward_scale = float(self.grad_scaler.get_scale())

    def _scale_version(self):
        """A token that changes whenever the GradScaler's scale may have: its scale
        tensor and that tensor's version (``update()`` writes it in place), read without
        synchronising; a fresh object (never equal) for a scaler without one."""
        scale = getattr(self.grad_scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return (id(scale), scale._version)
        if scale is None and hasattr(self.grad_scaler, "_init_scale"):
            # (a GradScaler before its first scale() call: get_scale() is _init_scale)
            return ("init", getattr(self.grad_scaler, "_init_scale", None))
        return object()

    def _on_module_load(self, module, incompatible_keys):
        """The module's weights were loaded (``load_state_dict``, of it or of the DDP
        model) after this state loaded a checkpoint taken before its last step's
        decision (:meth:`_check_applied`): the load moved every parameter's version, but
        it is no optimizer step - a resume that loads the model after the hook state
        must rewind as one that loads it before."""
        check = self._applied_check
        if check is not None and check[2] is not None:
            params, _, loaded, optimizer_steps, candidates = check
            self._applied_check = (params, [p._version for p in params], loaded,
                                   optimizer_steps, candidates)

    def _on_optimizer_step(self, optimizer, args, kwargs):
        """Any ``torch.optim`` optimizer's step (a global post-hook): count it when it
        holds some of this module's parameters."""
        groups = optimizer.param_groups
        signature = (len(groups), sum(len(group["params"]) for group in groups))
        known = self._optimizers_seen.get(optimizer)
        if known is None or known[0] != signature:
            held = frozenset(id(p) for group in groups for p in group["params"]
                             if id(p) in self._param_ids)
            known = self._optimizers_seen[optimizer] = (signature, held)
        if known[1]:
            self._optimizer_steps += 1
            self._optimizer_last_step[optimizer] = self._optimizer_steps

    def _untouched(self, params, versions, optimizer_steps):
        """The parameters of ``params`` that no optimizer step has touched since
        ``versions`` and ``optimizer_steps`` were read: same version, and held by no
        ``torch.optim`` optimizer that stepped since (fused ones move no version)."""
        stepped = None
        if self._optimizer_steps != optimizer_steps:
            held = [known[1] for optimizer, last in list(self._optimizer_last_step.items())
                    if last > optimizer_steps
                    and (known := self._optimizers_seen.get(optimizer)) is not None]
            if any(ids >= self._param_ids for ids in held):
                return []  # (an optimizer over the whole model stepped: the usual case)
            stepped = frozenset().union(*held)
        return [p for p, v in zip(params, versions)
                if p._version == v and (stepped is None or id(p) not in stepped)]

    def _check_applied(self):
        """At the first forward with autograd after a step: was that step's gradient
        applied? Not when every parameter it reduced has the same version as at the
        step's end (no optimizer step touched it) and its gradient cleared - to None, or
        to zeros by ``zero_grad(set_to_none=False)`` (read only once every version is
        unchanged, which training steps never reach): then its residual update is
        rewound (``on_unapplied``). Local state only: no collective."""
        check, self._applied_check = self._applied_check, None
        if check is None:
            return
        params, versions, loaded, optimizer_steps, candidates = check
        exchange = self._exchange
        if loaded is None and (exchange is None or not exchange.finished
                               or exchange.error is not None):
            return
        if loaded is None and exchange.nonfinite:
            return  # dropped already (an AMP step the scaler skips): no evidence either way
        untouched = self._untouched(params, versions, optimizer_steps)
        if len(untouched) < len(params) or candidates is not None:
            self._unapplied_streak = 0
            self._rewind_part(untouched, loaded, candidates)
            return
        if any(p.grad is not None and bool(p.grad.any()) for p in params):
            # no optimizer step, gradients kept: accumulation, every update stays (a
            # parameter whose accumulated gradient is zero was not cleared either)
            self._unapplied_streak = 0
            self.memory.forget_last_commit()
            return
        self._unapplied_streak += 1
        # The streak tells an optimizer that writes p.data (every step looks dropped) from
        # dropped steps - only where the optimizer's steps are not seen otherwise: once a
        # torch.optim optimizer over these parameters has stepped (its step post-hook), a
        # run of steps without one is a run of skipped updates (a guard that skips the
        # optimizer step on a loss spike), each rewound as plain DDP drops it
        if self._unapplied_streak > UNAPPLIED_STREAK_LIMIT and self._optimizer_steps == 0:
            self.memory.forget_last_commit()
            self.on_unapplied = "keep"
            warnings.warn(
                f"omgs_hook: {UNAPPLIED_STREAK_LIMIT + 1} steps in a row ended with their "
                "gradients cleared and no parameter's version changed: the optimizer seems "
                "to update parameters without autograd seeing it (p.data). The "
                f"{UNAPPLIED_STREAK_LIMIT} steps before this one were rewound; from this "
                "one on the residual keeps every step's update and rewinding is off. Pass "
                "on_unapplied='keep' to keep those first steps too.",
                RuntimeWarning, stacklevel=3)
            return
        if loaded is not None:  # resumed from a checkpoint taken before this decision
            self.memory.load_state_dict(loaded, self._shapes)
        elif not self.memory.rewind_last_commit():
            return
        self._totals["rewound_steps"] += 1
        level = logging.INFO if self._rewind_warned else logging.WARNING
        self._rewind_warned = True
        logger.log(level, "omgs_hook: the gradient of step %d was cleared without an "
                   "optimizer step (as a GAN's generator step leaves the discriminator's): "
                   "its residual update is rewound, as plain DDP drops that gradient "
                   "(on_unapplied='rewind'; 'keep' keeps it)", self.step)

    def before_backward(self):
        """Decide now, instead of at the module's next forward, whether the last step's
        gradient was applied (``on_unapplied``): for a training loop that calls it right
        before every backward, after its ``zero_grad()``. Lightning's
        :class:`~omgs_hook.lightning.OMGSStrategy` does (its ``pre_backward``): there
        the DDP model's forward is the whole ``training_step``, which in manual
        optimization runs several backwards (a GAN's discriminator and generator
        steps) and clears their gradients after that forward, so a check at the
        forward never saw a dropped gradient. From the first call on, the forward no
        longer decides."""
        self._check_at_forward = False
        self._check_applied()

    def _rewind_part(self, untouched, loaded, candidates):
        """The step was applied to some of its parameters only (one DDP model holding a
        GAN's generator and discriminator: the generator's step leaves the
        discriminator's gradient computed, cleared and never applied, as plain DDP drops
        it): the residual update of each parameter that no optimizer step touched and
        whose gradient was cleared - and that this rank did not park - is undone,
        the others' kept. ``candidates``: the keys a checkpoint taken before this
        decision allowed (None: every key). The two-level exchange's shard residuals
        mix parameters: there the step is kept whole, as before."""
        keys = [key for p, key in self._rewindable(untouched, loaded, candidates)
                if p.grad is None or not bool(p.grad.any())]
        if not keys:
            self.memory.forget_last_commit()
            return
        if loaded is not None:  # resumed from a checkpoint taken before this decision
            residuals = self.memory.state_dict()
            for key in keys:
                if key in loaded:
                    residuals[key] = loaded[key]
                else:
                    residuals.pop(key, None)
            self.memory.load_state_dict(residuals, self._shapes)
        elif not self.memory.rewind_keys(keys):
            self.memory.forget_last_commit()
            return
        self._totals["partly_rewound_steps"] += 1
        level = logging.INFO if self._partial_rewind_warned else logging.WARNING
        self._partial_rewind_warned = True
        logger.log(level, "omgs_hook: the gradient of step %d was cleared without an "
                   "optimizer step for %d of its parameters (e.g. %s; a discriminator in "
                   "the same DDP model as its generator): their residual update is "
                   "rewound, as plain DDP drops those gradients (on_unapplied='rewind')",
                   self.step, len(keys), keys[0])

    def _on_forward(self, module, args, output):
        if torch.is_grad_enabled():
            self.meter.forward_finished()
            self._forward_end_wall = time.perf_counter()
            entry = self.meter.current_forward()
            if entry is not None:
                # marked when a backward reaches this output: a forward no backward
                # reaches (a metric computed with autograd on) is no part of the step
                for node in _output_nodes(output):
                    try:
                        node.register_prehook(_Reached(entry))
                    except RuntimeError:
                        pass

    @property
    def world_size(self):
        return dist.get_world_size(self.process_group)

    def _setup_topology(self):
        """Resolve ``topology`` / ``ranks_per_node`` and create the two-level exchange's
        subgroups (collective: every rank, same point, same order)."""
        if self.topology is not None:
            return
        topology, ranks_per_node = self._topology_options
        group_ranks, job_size = self._group_members()
        topo = topology_mod.resolve_topology(topology, ranks_per_node, self.world_size,
                                             dist.get_rank(self.process_group),
                                             group_ranks=group_ranks, job_world_size=job_size)
        if topo.hierarchical and self.track_staleness:
            raise ValueError("track_staleness is not available with the two-level exchange "
                             "(topology resolved to 'hierarchical'); pass topology='flat'")
        if not topo.hierarchical and self.world_size > 1:
            # the same check build_subgroups makes first: a flat rank among two-level ones
            # must fail with them rather than leave them waiting in new_group
            topology_mod.check_agreement(topo, self.process_group)
        self._subgroups = (topology_mod.build_subgroups(topo, self.process_group)
                           if topo.hierarchical else None)
        self.topology = topo
        self._check_pinned_exchange()
        if self.plan is not None and self.plan.exchange is None:  # loaded before the set-up
            self.plan = dataclasses.replace(self.plan, exchange=topo.kind)

    def _group_members(self):
        """``(global ranks of the process group's members in group order, the job's world
        size)``, or ``(None, None)`` for the default group."""
        group = self.process_group
        if group is None or group == dist.group.WORLD:
            return None, None
        return ([dist.get_global_rank(group, r) for r in range(self.world_size)],
                dist.get_world_size())

    def _check_pinned_exchange(self):
        """A pinned plan's ``exchange`` must be one this registration can run."""
        exchange = self._pinned_exchange()
        if exchange is None or exchange == self.topology.kind:
            return
        if exchange == "hierarchical":
            raise ValueError(
                "plan: the pinned plan uses the two-level exchange ('exchange': "
                f"'hierarchical') but the topology resolved to {self.topology.describe()} "
                f"(topology={self.topology.requested!r}); pass topology='hierarchical' with "
                "ranks_per_node, or remove 'exchange' from the plan")
        if self.topology.requested != "auto":
            raise ValueError(
                f"plan: the pinned plan uses the flat exchange ('exchange': 'flat') but "
                f"topology={self.topology.requested!r} was asked for; pass topology='auto' "
                "to run it flat, or remove 'exchange' from the plan")

    def _pinned_exchange(self):
        if self._pinned is None:
            return None
        return self._pinned[1].exchange if self._pinned[0] == "keys" else self._pinned[4]

    def _registered_exchange(self):
        """The exchange of the registration's topology (None before it is resolved)."""
        return self.topology.kind if self.topology is not None else None

    def _compares_exchanges(self):
        """Whether the trial also times flat candidates: ``topology="auto"`` resolved to
        the two-level exchange (an explicit topology is kept as asked)."""
        topo = self.topology
        return (topo is not None and topo.hierarchical and topo.requested == "auto"
                and self.select == "measured" and self._pinned is None)

    def _step_exchange_kind(self):
        """The exchange this step runs: the plan's, or the registration's in the warm-up
        (and without a plan)."""
        if self._subgroups is None:
            return "flat"
        if self.plan is None or self._in_dense_mode():
            return self.topology.kind
        return self.plan.exchange or self.topology.kind

    def _first_bucket_setup(self, bucket):
        device = bucket.buffer().device
        if not bucket.buffer().is_floating_point():
            raise TypeError(f"OMGS needs floating-point gradients, got {bucket.buffer().dtype}")
        self._device = device
        self._setup_topology()
        self.meter.use_device(device)
        self._selector = topk_mod.get_selector(self.topk_backend, device)
        world = self.world_size
        if self._profile_arg is None:
            self.profile = default_profile(device.type if device.type in ("cpu", "cuda") else "cpu",
                                           world_size=world)
        else:
            self.profile = self._profile_arg
            problems = profile_mismatches(self.profile, world,
                                          dist.get_backend(self.process_group), device.type,
                                          density=self.density)
            for problem in problems + profile_bandwidth_gaps(self.profile):
                warnings.warn(f"omgs_hook: {problem}", RuntimeWarning, stacklevel=2)
        self.memory.move_to(device)

    # ------------------------------------------------------------ cross-rank agreement
    def _gather_rows(self, values, dtype=torch.float64):
        """All-gather one row of numbers per rank (blocking, from the hook only)."""
        work, out = self._start_gather(values, dtype)
        work.wait()
        return self._rows_of(out)

    def _rows_of(self, out):
        """The gathered ``out`` of :meth:`_start_gather` (its work done): a row per rank,
        on the host."""
        return out.view(self.world_size, out.numel() // self.world_size).cpu()

    def _start_gather(self, values, dtype=torch.float64):
        """Start the all-gather of one row of numbers per rank: ``(work, out)``, the rows
        in ``out`` once the work is done (same order on every rank)."""
        # (a list, or a numpy array: the planning row, read without a Python float each)
        row = torch.as_tensor(values, dtype=dtype, device=self._device)
        out = torch.empty(self.world_size * row.numel(), dtype=dtype, device=self._device)
        work = communicator.all_gather_flat(out, row, group=self.process_group, async_op=True)
        return work, out

    def _fingerprint(self):
        """Per-field digests of what every rank must agree on, with readable values."""
        prof = self.profile
        fields = {
            "density": repr(self.density),
            "density_warmup": repr((self.density_warmup_steps, self.density_warmup_start)),
            "strategy": self.strategy,
            "warmup_steps": repr(self.warmup_steps),
            "replan_every": repr(self.replan_every),
            "measure_window": repr(self.meter.window),
            "grad_scaler": repr(self.grad_scaler is not None),
            "allow_dense": repr(self.allow_dense),
            "min_sparse_numel": repr(self.min_sparse_numel),
            "refit_online": repr(self.refit_online),
            # scales the costs every rank plans with (a mismatch changed no plan in a
            # test of 80 steps, but nothing guaranteed it)
            "measured_comm": repr(self.measured_comm),
            "local_clip_norm": repr(self.local_clip_norm),
            "track_staleness": repr(self.track_staleness),
            "topology": self.topology.describe(),
            "nonfinite": self.nonfinite,
            "topk_backend": self._selector.name,
            "profile": repr((prof.comm, prof.dense, prof.topk_for(self._selector.name))
                            # the two link classes a two-level exchange plans with (a
                            # difference there was caught at the first plan only, as
                            # "ranks computed different plans", naming no cause)
                            + ((prof.hierarchy(),) if self.topology.hierarchical else ())),
            "step": repr(self.step),
            "plan": repr(self.plan.checksum() if self.plan is not None else None),
            "select": self.select,
            "pinned_plan": repr(self._pinned_digest()),
            "trial": repr(self._trial.state_dict()["rounds"] if self._trial is not None else None),
            # a resumed run whose ranks saved at different points of a re-plan (a signal
            # handler's save inside one) otherwise hung at the job's switch, where only
            # the ranks holding it issue the readiness all-gather
            "plan_job": repr((self._plan_job["reason"], int(self._plan_job["apply_at_step"]))
                             if self._plan_job is not None else None),
            "parameters": self._parameters_fingerprint(),
        }
        return fields

    def _parameters_fingerprint(self):
        """The trainable parameters' names and shapes (what plans and residuals are keyed
        by), readable in short: another model on one rank, or the module given to the
        state on one rank only, was otherwise caught only at the first plan, as plans
        with different checksums."""
        listing = repr(list(self._shapes.items())).encode()
        return (f"{len(self._shapes)} named trainable parameters, names and shapes "
                f"{hashlib.sha256(listing).hexdigest()[:12]}")

    def _pinned_digest(self):
        if self._pinned is None:
            return None
        if self._pinned[0] == "keys":
            return self._pinned[1].checksum()
        return repr(self._pinned[1:3] + self._pinned[4:])

    def _check_consistency(self):
        fields = self._fingerprint()
        digests = [int.from_bytes(hashlib.sha256(v.encode()).digest()[:7], "big")
                   for v in fields.values()]
        table = self._gather_rows(digests, dtype=torch.int64)
        differing = [name for col, name in enumerate(fields)
                     if len(set(table[:, col].tolist())) > 1]
        if differing:
            detail = ", ".join(f"{name} (this rank: {fields[name]})" for name in differing)
            if "parameters" in differing:
                detail += (" - the trainable parameters' names or shapes differ: every rank "
                           "must wrap the same model the same way and register the hook "
                           "the same way (register(), or an OMGSState given the module)")
            raise RuntimeError(
                f"omgs_hook: ranks are configured differently: {detail}. Every rank must "
                "use the same options, profile and (when resuming) state."
            )

    # ------------------------------------------------------------------ the hook body
    def density_at(self, step):
        """The density of step ``step`` (counted from 0, as ``self.step`` before it runs).

        ``density`` itself, except in the ``density_warmup_steps`` steps after the dense
        warm-up: ``start * (density / start) ** (t / density_warmup_steps)`` at sparse
        step ``t`` = 0, 1, ... - the same float on every rank (same inputs, same formula).
        """
        t = step - self.warmup_steps
        start = self.density_warmup_start
        if t < 0 or t >= self.density_warmup_steps or start <= self.density:
            return self.density
        return start * (self.density / start) ** (t / self.density_warmup_steps)

    def _in_dense_mode(self):
        return self.density >= 1.0 or self.step < self.warmup_steps

    def on_bucket(self, bucket):
        if self._closed:
            # (DDP cannot take a comm hook off: without this, training on failed some
            # steps later, at the next re-plan, with "BackgroundPlanner.submit after close")
            raise RuntimeError(
                "omgs_hook: this OMGSState was closed (close()), so the DDP model it is "
                "registered on cannot train on (DDP cannot remove a comm hook): close the "
                "state once training with it is over, or wrap the module in a new DDP model "
                "and register the hook there")
        entered = time.perf_counter()
        index = bucket.index()
        exchange = None
        try:
            arrived = None
            delayed = index == 0 and self._delayed_bucket(bucket)
            if delayed:
                index = len(self._exchange.layout)
            if index == 0:
                if self._pending_replan is not None:
                    # bucket 0's backward ended here: the re-plan finished at the start of
                    # _begin_step is the hook's time, neither this bucket's backward nor
                    # the next one's (its send window starts here)
                    arrived = self.meter.clock.mark()
                self._begin_step(bucket)
            exchange = self._exchange
            self.meter.bucket_arrived(index, arrived)
            params = bucket.parameters()
            if self.on_unapplied == "rewind":
                self._step_params.extend(params)
            keys = [self._key(p) for p in params]
            for key, param in zip(keys, params):
                self.memory.note_layout(key, param)
            future = exchange.add_bucket(bucket, keys, params, used=self._used_keys)
            last = bucket.is_last() or (delayed and self._all_delayed_arrived(exchange))
            if self._used_keys is not None and last:
                # the marks of no_sync() steps count until here, as DDP's own do
                self._used_keys.clear()
                if exchange.stale:
                    self._undo_discarded_after_ddp(exchange)
            # the two-level stages waited for here are the groups' own work (their
            # reduce-scatter is on the model's compute stream), not this bucket's backward
            self.meter.sends_started(arrived)
            # (flat on the host: what of the window no per-group timer covers is priced
            # per group, measurements.untimed_per_group_s; not the last bucket's, whose
            # flush walks every parameter once a step, whatever the plan)
            window = (exchange.open_window() if exchange.subgroups is None
                      and self._on_host() and not last else None)
            # sparse groups whose collective completed since the last bucket: written
            # back here, on this thread (inside the send window, so the time is not
            # counted as this bucket's backward)
            exchange.write_back_completed()
            exchange.advance()  # two-level groups in flight: one stage on
            if self._in_dense_mode():
                exchange.send_group(keys, dense=True)
            else:
                self._send_ready_groups(exchange, keys)
                if last:
                    self._flush(exchange)
            if window is not None:
                exchange.close_window(window)
            self.meter.sends_finished()
            if last:
                # before the commit (in finish_issuing): a signal handler's state_dict()
                # between the commit and the step count saved the step's residuals as the
                # last step's, with no record of those before it to rewind to
                self._note_step_params()
                exchange.drain()
                # (with every deferred write-back, waiting for their collectives: DDP
                # waits for the bucket futures right after this call anyway; the wait is
                # the network's time, not the hook's)
                exchange.finish_issuing()
                entered += exchange.waited_s
                self._end_step(exchange)
                self._issue_ready_probe()
            exchange.hook_s += time.perf_counter() - entered
        except BaseException as exc:
            if exchange is not None:
                exchange.fail_all(exc)
            raise
        return future

    def _delayed_bucket(self, bucket):
        """True for a bucket that DDP numbers 0 but that continues this backward: with
        ``static_graph=True`` DDP's first iteration reduces every bucket after the
        backward (its delayed all-reduce), numbers each of them 0 and marks none of them
        last when it has several (a model of several dtypes: one bucket per dtype). Such a
        bucket holds parameters the step's unfinished exchange has not received yet (a
        bucket 0 after a backward that raised midway holds received ones)."""
        exchange = self._exchange
        if exchange is None or exchange.finished or not exchange.layout:
            return False
        if any(self._key(p) in exchange.arrived for p in bucket.parameters()):
            return False
        if self.module is None:  # (parameters are then only known as they arrive)
            raise RuntimeError(
                "omgs_hook: DDP handed over several buckets numbered 0 in one backward (the "
                "first iteration of static_graph=True with parameters of several dtypes); "
                "the hook then needs the module to know the last one: register it with "
                "omgs_hook.register(ddp_model, ...) or OMGSState(module=...)")
        return True

    def _all_delayed_arrived(self, exchange):
        """In DDP's delayed all-reduce (:meth:`_delayed_bucket`): whether every parameter
        DDP reduces has arrived, so that this bucket is the last."""
        return all(key in exchange.arrived for key in self._ddp_reduced_keys())

    def _ddp_reduced_keys(self):
        """The keys of the parameters DDP's reducer holds, chosen as DDP chooses them
        (``DistributedDataParallel._build_params_for_reducer``): trainable, not named in
        its ``parameters_to_ignore`` as ``f"{module_name}.{param_name}"``, shared ones
        once. Without the DDP model (``register_comm_hook`` by hand) the ignore list is
        read where DDP reads it, the module's ``_ddp_params_and_buffers_to_ignore``."""
        ddp = self._registered_ddp()
        module = ddp.module if ddp is not None else self.module
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module  # (OMGSState(module=ddp_model))
        ignored = getattr(ddp, "parameters_to_ignore", None)
        if ignored is None:
            ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        seen, keys = set(), []
        for module_name, sub in module.named_modules():
            for name, param in sub.named_parameters(recurse=False):
                if (param.requires_grad and f"{module_name}.{name}" not in ignored
                        and id(param) not in seen):
                    seen.add(id(param))
                    keys.append(self._key(param))
        return keys

    def _issue_ready_probe(self):
        """At the end of a step after which the pending plan job may be put in use (the
        next step is at or past its ``apply_at_step``): start the all-gather of every
        rank's readiness flag, read at the next step's bucket 0. Issued at the same point
        of the same steps on every rank (after this step's collectives and re-plan)."""
        job = self._plan_job
        if job is None or self.step < int(job["apply_at_step"]):
            return
        plans = None
        try:
            if self._polled_result is None and self._planner.ready:
                self._polled_result = self._planner.poll(self.step)
            # this rank's plans now (made from the plan in use at this point: the same
            # on every rank), so that their checksums travel with the flag: the switch
            # then needs no blocking gather at all
            if self._polled_result is not None:
                plans = self._plans_of(job, self._polled_result)
        except Exception as exc:  # noqa: BLE001 - raised at the next bucket 0
            # A failed plan job raises where it always did, at the switch (this step's
            # exchange is complete and stays so); this rank reports itself not ready.
            self._polled_result, self._probe_error = None, exc
        width = 1 + plan_selection.MAX_CANDIDATES
        row = [1] + self._checksum_row(plans) if plans is not None else [0] * (1 + width)
        work, out = self._start_gather(row, dtype=torch.int64)
        self._ready_probe = (job, work, out, plans)

    def _note_step_params(self):
        """The step's parameters and their versions (read before the optimizer can run:
        backward is still in progress), for :meth:`_check_applied`."""
        params, self._step_params = self._step_params, []
        # (collected only with on_unapplied="rewind"; self._hooks: the forward pre-hook
        # that reads it exists, i.e. the module is known)
        if params and self._hooks:
            self._applied_check = (params, [p._version for p in params], None,
                                   self._optimizer_steps, None)

    def _residuals_before_last_step(self):
        """For a checkpoint taken after a step whose gradient no optimizer step has
        touched yet (a GAN saved after its generator step): the residuals before that
        step, so that a run resumed from it rewinds by the same rule as an uninterrupted
        one (:meth:`_check_applied` at its first forward). None otherwise."""
        check = self._applied_check
        if check is None or self.on_unapplied != "rewind":
            return None
        params, versions, loaded, optimizer_steps, candidates = check
        if not self._untouched(params, versions, optimizer_steps):
            return None
        # (loaded: saved again before the decision of the checkpoint it was resumed from)
        return loaded if loaded is not None else self.memory.undo_state_dict()

    def _unapplied_candidates(self):
        """With :meth:`_residuals_before_last_step`: the keys a resumed run may still
        rewind (untouched by any optimizer step so far, not parked), or None when that
        is every parameter of the step (and for a checkpoint without those residuals)."""
        check = self._applied_check
        if check is None or self.on_unapplied != "rewind":
            return None
        params, versions, loaded, optimizer_steps, candidates = check
        untouched = self._untouched(params, versions, optimizer_steps)
        if not untouched:
            return None
        keys = sorted(key for _, key in self._rewindable(untouched, loaded, candidates))
        if candidates is None and len(keys) == len(params):
            return None  # (every parameter of the step: untouched, none parked)
        return keys

    def _rewindable(self, untouched, loaded, candidates):
        """``(param, key)`` of the ``untouched`` parameters whose residual update a rewind
        may undo: named, not parked by this rank in the step (unless resumed: ``loaded``),
        and among ``candidates`` (the keys a checkpoint taken before the decision
        allowed; None: every key)."""
        exchange = self._exchange
        parked = exchange.parked if loaded is None and exchange is not None else ()
        for p in untouched:
            key = self._names.get(id(p))
            if key is not None and key not in parked and (
                    candidates is None or key in candidates):
                yield p, key

    def _raise_after_ddp(self):
        """With ``nonfinite="raise"``: queue, behind DDP's own end-of-backward callback
        (:func:`_queue_behind_ddp`), a check that raises :class:`FloatingPointError` from
        ``backward()`` when this step turned out non-finite. Returns False where the
        engine takes no callback (a hook called outside a backward pass): the exchange
        then fails the futures."""

        def check():
            exchange = self._exchange
            if exchange is not None and exchange.finished and exchange.nonfinite \
                    and exchange.error is None:
                raise FloatingPointError(
                    "omgs_hook: a rank's gradient holds NaN/Inf (nonfinite='raise'): the "
                    "gradients of this step are NaN and its residual updates were "
                    "discarded")

        return _queue_behind_ddp(check)

    def _undo_discarded_after_ddp(self, exchange):
        """Queue, behind DDP's end-of-backward callback (:func:`_queue_behind_ddp`), the
        undo of the residual update of every ``exchange.stale`` parameter that
        no rank used in this backward. Such a parameter's ``.grad`` is the one an earlier
        synchronised step of an accumulation (micro-batches without ``no_sync()``) wrote
        back; the hook added it to the residual and sent part of it, but DDP (with
        ``find_unused_parameters=True``) keeps the ``.grad`` of a parameter no rank used
        and drops the result: the residual would count that gradient a second time and
        lose what was sent. DDP's used map (summed over the ranks by then) tells which
        those are. Where another rank used the parameter, DDP applies the result and
        the update stands. Not with ``gradient_as_bucket_view`` (the result lands in
        ``.grad`` itself, so it is applied) nor ``static_graph``, nor on the two-level
        exchange (shard residuals mix parameters); needs :func:`register` (the DDP
        model)."""
        ddp = self._registered_ddp()
        if (ddp is None or not getattr(ddp, "find_unused_parameters", False)
                or getattr(ddp, "gradient_as_bucket_view", False)
                or getattr(ddp, "static_graph", False)):
            return

        def undo():
            if (exchange.finished and exchange.error is None and not exchange.nonfinite
                    and exchange is self._exchange):
                self._undo_discarded(ddp, exchange)

        _queue_behind_ddp(undo)  # (False: a hook called outside a backward pass)

    def _undo_discarded(self, ddp, exchange):
        used = ddp.reducer._get_local_used_map()
        keys = self._ddp_reduced_keys()
        if used.numel() != len(keys):
            return  # (the reducer's parameters are not those of its construction)
        counts = dict(zip(keys, used.tolist()))
        dropped = sorted(key for key in exchange.stale if counts.get(key) == 0)
        if dropped and self.memory.restore_keys(dropped):
            self._totals["unused_restored"] += len(dropped)

    def _begin_step(self, bucket):
        # the step's own forward, before the load probe below reads it
        self.meter.reanchor_forward()
        # (before the step's clock: the re-plan belongs to the step that started it, as
        # the trial's and the model's step times always counted it)
        self._finish_replan()
        self._step_params = []
        self._applied_check = None
        if self._device is None:
            self._first_bucket_setup(bucket)
        if self._exchange is not None and not self._exchange.finished:
            # The previous backward raised midway: its staged residuals are dropped.
            self._exchange.fail_all(RuntimeError("backward pass abandoned"))
        if self.grad_scaler is not None:
            self._follow_loss_scale()
        if not self._consistency_checked:
            self._check_consistency()
            self._consistency_checked = True
        # the previous step's time (taken when it finished, :meth:`_on_step_finished`),
        # recorded here, on the autograd thread, where the trial runs
        sample, self._step_sample = self._step_sample, None
        # this step's forward, run after the previous step's exchange finished (compute
        # only, whatever the plan): the previous step's load probe, and this step's pace
        forward = (self.step, self._load_probe()) if self._trial is not None else None
        previous_forward, self._step_forward = self._step_forward, forward
        if sample is not None and sample[0] == self.step - 1:
            index, self._last_step_s, excess = sample
            step_s = self._last_step_s - excess
            self._step_times.append((index, step_s))
            if self._trial is not None:
                own = (previous_forward[1] if previous_forward is not None
                       and previous_forward[0] == index else None)
                self._trial.record(index, step_s, forward[1], forward=own)
        probe, self._ready_probe = self._ready_probe, None
        if probe is not None:
            probe[1].wait()  # (issued on every rank at the same point: it completes)
            error, self._probe_error = self._probe_error, None
            if error is not None:
                raise error
            if probe[0] is not self._plan_job:
                probe = None  # for a job replaced since: its flags are not used
        if self._plan_job is not None and self.step >= int(self._plan_job["apply_at_step"]):
            started = time.perf_counter()
            # Switch once every rank's planner has finished, decided from gathered flags
            # (the same on every rank): a slow plan (a large search) never holds a step,
            # the plan in use stays until then, at one tiny all-gather per step. The
            # flags and the plans' checksums were gathered at the end of the previous
            # step, asynchronously (two blocking gathers here waited for the other rank
            # to reach its bucket 0: most of the worst stalls at 1000 buckets). A step
            # no probe was issued for (the first after a resume) gathers them here.
            if probe is not None:
                table = self._rows_of(probe[2])
                ready, plans, checksums = int(table[:, 0].min()) > 0, probe[3], table[:, 1:]
            else:
                ready = float(self._gather_rows(
                    [1.0 if self._polled_result is not None or self._planner.ready
                     else 0.0]).min()) > 0
                if ready:
                    if self._polled_result is None:
                        self._polled_result = self._planner.poll(self.step)
                    plans = self._plans_of(self._plan_job, self._polled_result)
                    checksums = self._gather_rows(self._checksum_row(plans), dtype=torch.int64)
            if ready:
                self._check_plan_checksums(checksums)
                self._put_plans_in_use(self._polled_result, plans)
            self._note_stall(time.perf_counter() - started)
        if self._trial is not None:
            self._advance_trial()
        self._exchange = StepExchange(
            self.memory, self._selector, self.process_group, self.world_size,
            self.density_at(self.step),
            on_finished=_WeakCallback(self._on_step_finished),
            on_comm_sample=self._fitter.add if self._fitter is not None else None,
            # "raise": the step completes as a skipped one (NaN gradients, residuals
            # kept) and FloatingPointError is raised once DDP has finished its own
            # backward work (_raise_after_ddp); failing the bucket futures instead made
            # DDP turn it into "RuntimeError: Unable to cast ..."
            raise_on_nonfinite=(self.nonfinite == "raise"
                                and not self._raise_after_ddp()),
            clip_per_sqrt_element=self._clip_per_sqrt_element(),
            measure_health=self.step % HEALTH_EVERY == 0,
            track_staleness=self.track_staleness,
            topology=self.topology,
            # the plan's exchange; the subgroups exist from the registration either way
            subgroups=self._subgroups if self._step_exchange_kind() == "hierarchical" else None,
            time_stages=self.measured_comm and self._on_host(),
        )
        # the step this backward completes (counted from 1); the counter itself only
        # advances at the last bucket, possibly after the collectives finished
        self._exchange.step_number = self.step + 1
        self._exchange.warmup = self.step < self.warmup_steps
        self._start_group_tracking()

    def _start_group_tracking(self):
        """Per step: how many parameters of each plan group have not arrived yet (a group
        is sent when that reaches 0). A bucket's arrival then costs O(its parameters), not
        a scan of every pending group's parameters (O(parameters^2) per step: 216 ms of a
        600 ms step for one group of 1200 buckets)."""
        plan = self.plan
        if plan is None:
            self._group_missing = []
            return
        if self._group_of[0] is not plan:
            self._group_of = (plan, {key: g for g, keys in enumerate(plan.groups) for key in keys})
        self._group_missing = [len(keys) for keys in plan.groups]

    def _clip_per_sqrt_element(self):
        """``local_clip_norm / sqrt(N * world_size)``: a group of D elements is clipped to
        this times ``sqrt(D)`` (see ``local_clip_norm``); None when clipping is off. In
        the units of the gradients the hook sees: times the loss scale of a GradScaler."""
        if self.local_clip_norm is None:
            return None
        total = sum(math.prod(shape) for shape in self._shapes.values())
        scale = self._residual_scale if self._residual_scale is not None else 1.0
        return self.local_clip_norm * scale / math.sqrt(total * self.world_size)

    def _load_residual_scale(self, saved):
        """The loaded residuals are at loss scale ``saved`` (None: unscaled). With a
        ``grad_scaler`` the next bucket 0 rescales them to its scale; without one they
        are brought back to the gradient's own units now."""
        self._forward_scale = None
        saved = float(saved) if saved is not None else None
        if self.grad_scaler is not None:
            self._residual_scale = saved if saved is not None else 1.0
            return
        if saved is not None and saved != 1.0:
            self.memory.scale_(1.0 / saved)
        self._residual_scale = None

    def _follow_loss_scale(self):
        """At bucket 0 with a ``grad_scaler``: the loss scale of this step (read at its
        first forward, else now); the stored residuals, kept at the scale of the steps
        that stored them, are rescaled to it when it moved. Every rank's scaler holds
        the same scale (GradScaler reduces its inf checks over the ranks' gradients,
        which DDP made identical), so every rank rescales alike."""
        scale, self._forward_scale = self._forward_scale, None
        if scale is None or self._forward_scale_version != self._scale_version():
            # (no forward, or the scale moved since it was read: read it now)
            scale = float(self.grad_scaler.get_scale())
        if not math.isfinite(scale) or scale <= 0:
            raise RuntimeError(f"omgs_hook: the GradScaler's scale is {scale}")
        if self._residual_scale is not None and scale != self._residual_scale:
            self.memory.scale_(scale / self._residual_scale)
        self._residual_scale = scale

    def _send_ready_groups(self, exchange, arrived_keys):
        """Issue, in plan order, every group whose last parameter is among
        ``arrived_keys`` (the bucket that just arrived)."""
        if self.plan is None:
            return
        group_of, missing = self._group_of[1], self._group_missing
        complete = []
        for key in arrived_keys:
            g = group_of.get(key)
            if g is not None:
                missing[g] -= 1
                if missing[g] == 0:
                    complete.append(g)
        for g in sorted(complete):
            exchange.send_group(self.plan.groups[g], dense=self.plan.dense[g])

    def _flush(self, exchange):
        """At the last bucket: send what the plan left (partial groups, unknown parameters)."""
        if self.plan is not None:
            for g, missing in enumerate(self._group_missing):
                if missing <= 0:  # sent when its last parameter arrived
                    continue
                keys = [k for k in self.plan.groups[g] if k in exchange.arrived and k not in exchange.sent]
                if keys:
                    exchange.send_group(keys, dense=self.plan.dense[g])
            self._group_missing = [0] * len(self._group_missing)  # every group is out
        leftover = [k for bucket in exchange.layout for k in bucket if k not in exchange.sent]
        if leftover:
            exchange.send_group(leftover, dense=False)

    def _end_step(self, exchange):
        if self._unplaced_check:
            # every parameter has been in a bucket once now: a loaded residual that none
            # was named for belongs to no parameter of this model
            self._unplaced_check = False
            unplaced = sorted(self.memory.unplaced())
            if unplaced:
                raise ValueError(f"residual for {unplaced[0]!r} ({len(unplaced)} in all): no "
                                 f"such parameter in the model: {MODULELESS_NAMES}")
        self._ingest_finished(before_step=exchange.step_number)
        ddp_layout = tuple(exchange.layout)
        layout = self._layout_after_load(ddp_layout)
        # a step that stands for the checkpoint's layout ran on DDP's transient one: its
        # timings fit no plan, and the meter keeps the checkpoint's (a re-plan due at this
        # step is made from them, as in the uninterrupted run)
        self.meter.end_step(ddp_layout, step=self.step, discard=layout != ddp_layout)
        previous, streak = self._layout_streak
        self._layout_streak = (layout, streak + 1 if previous == layout else 1)
        self.step += 1
        if (self.step == 1 and len(layout) >= ISOLATE_UNITS and self._pinned is None
                and not self._planner.closed):
            # its plans will be computed in the planner's worker process: start it now,
            # so that its start-up does not delay the first plan (without a core to
            # spare: the low-priority one, for the re-plans)
            spare_core = planner_has_a_core(self.world_size)
            if spare_core or LOW_PRIORITY_REPLANS:
                self._planner.start_process(low_priority=not spare_core)
        if self.density >= 1.0 or self.step < self.warmup_steps:
            return
        if self._pinned is not None:
            if self.plan is None:
                self._adopt_pinned(layout)
            return
        reason = self._replan_due(layout)
        if reason:
            self._start_replan(layout, reason)

    def _layout_after_load(self, layout):
        """The layout that counts for the plan at this step: DDP's own, except at the
        first step after :meth:`load_state_dict` with a plan (or a pinned one) to go on
        with. That step runs on the new DDP's first, one-bucket layout, which DDP then
        rebuilds into the checkpoint's; counted as a new layout, it restarted the count
        of steps a layout must hold before it is planned for (LAYOUT_SETTLE_STEPS), so a
        run resumed while DDP's rebuilt buckets were settling re-planned (or adopted its
        pinned plan) later than the uninterrupted run: not bit-identical. That step (and,
        with ``static_graph=True``, the next: DDP keeps its first guess for two) stands
        for the checkpoint's layout here, the streak going on from the saved one."""
        saved, self._resumed_streak = self._resumed_streak, None
        resumed = self._resumed_layout
        if saved is not None:  # the first step after the load
            if resumed is None or (
                    self.plan is None and self._pinned is None and self._plan_job is None):
                # (no plan nor plan job yet: _replan_due waits for DDP's rebuilt layout to
                # settle, and applies the first plan at the step it was due, _first_due_at)
                return layout
            self._layout_streak = (resumed, saved)
            # DDP runs its first guess for 1 step, 2 with static_graph=True (it rebuilds
            # one iteration later): each of them stands for the checkpoint's layout
            self._stand_ins_left = self._first_guess_steps()
        if not self._stand_ins_left:
            return layout
        self._stand_ins_left -= 1
        if layout == resumed:  # DDP's own layout is the checkpoint's (rebuilt, or never new)
            self._stand_ins_left = 0
            return layout
        return resumed

    def _start_replan(self, layout, reason):
        """Start a re-plan at the end of a step: take this rank's numbers now and start
        their all-gather; the re-plan goes on at the next bucket 0
        (:meth:`_finish_replan`), by when the other ranks' rows have arrived.

        A blocking gather here waited for the slowest rank to end its step, and queued
        behind this step's collectives: at 1000 buckets, 2 ranks, that wait was most of
        the largest re-plan stalls. Finished one forward later, at the same step number
        (``self.step`` moves at the end of a step only), with the same rows, the re-plan
        is the one it was: the same job, the same ``apply_at_step``, on every rank."""
        started = time.perf_counter()
        row, meta = self._planning_row(layout)
        work, out = self._start_gather(row)
        self._pending_replan = (layout, reason, work, out, meta, time.perf_counter() - started)

    def _finish_replan(self, reporting=False):
        """Finish the re-plan :meth:`_start_replan` began, if one is pending: at bucket 0,
        or before anything reads what it decides (``stats()``, ``state_dict()``, ...). It
        issues no collective (its gather is in flight on every rank), so a rank may
        finish it earlier than the others: the result is the same.

        ``reporting``: called to report or save (not to train). Where the gather failed
        (a peer died after its step: the SIGTERM torchrun sends the survivors, whose
        handler saves a checkpoint), the re-plan is dropped with a warning instead of
        raising the peer's error there: the state holds everything else, and a run
        resumed from it re-plans. Training calls raise, as any collective does."""
        with self._replan_lock:  # (a caller on another thread waits until it is done)
            pending = self._pending_replan
            # (a signal handler's state_dict() re-entering on this thread while it runs)
            if pending is None or self._finishing_replan:
                return
            # pending until made: a Ctrl-C landing in the wait or the re-plan lost it, and
            # the state saved after it had no plan job where the other ranks' had one (their
            # resumed runs then hung at the switch's all-gather)
            self._finishing_replan = True
            try:
                self._finish_pending_replan(pending, reporting)
            finally:
                self._finishing_replan = False

    def _finish_pending_replan(self, pending, reporting):
        started = time.perf_counter()
        layout, reason, work, out, meta, started_s = pending
        try:
            work.wait()
        except RuntimeError as exc:  # (gloo and NCCL errors derive from it)
            self._pending_replan = None
            if not reporting:
                raise
            logger.warning(
                "omgs_hook: the %s re-plan started at the end of step %d could not "
                "gather the ranks' measurements (%s: %s); it is dropped, and a run "
                "resumed from this state re-plans", reason, self.step,
                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self._totals["replans_dropped"] += 1
            return
        try:
            self._replan(layout, reason,
                         self._instance_from_rows(layout, self._rows_of(out), meta))
        except Exception:
            # a failed re-plan (ranks that disagree, a planner error) raises once, as
            # before; only an interruption (KeyboardInterrupt, SystemExit) keeps it pending
            self._pending_replan = None
            raise
        self._pending_replan = None
        # the re-plan's whole time on this thread: its start at the end of the step too
        self._note_stall(started_s + time.perf_counter() - started)

    def _first_apply_step(self):
        """The step the first plan goes into use: PLAN_LAG steps after it was due, even
        when it waited for a resumed run's layout (:meth:`_replan_due`), as long as that
        is still a later step; else the next one."""
        if self._first_due_at is None:
            return self.step + PLAN_LAG
        return max(self.step + 1, self._first_due_at + PLAN_LAG)

    def _replan_due(self, layout):
        """Why a re-plan is due now (``"first"``, ``"periodic"``, ``"overhead"``,
        ``"layout"``), or None."""
        if self._plan_job is not None:
            return None  # a plan is being computed
        _, streak = self._layout_streak
        if self.plan is None:
            if (self._resumed_layout is not None and layout != self._resumed_layout
                    and streak < LAYOUT_SETTLE_STEPS):
                # resumed before its first plan, and this step ran on DDP's first,
                # one-bucket layout of the new process: plan over the buckets DDP
                # rebuilds (the checkpoint's), or over whatever layout settles instead;
                # it goes into use at the step it would have without the wait, where it
                # can (_first_apply_step), so the resume stays the uninterrupted run
                if self._first_due_at is None:
                    self._first_due_at = self.step
                return None
            return "first"
        layout_changed = layout != self.plan.layout and streak >= LAYOUT_SETTLE_STEPS
        if self._trial is not None:
            # a running trial is only interrupted by a new layout
            return "layout" if layout_changed else None
        if layout != self.plan.layout and not layout_changed:
            # a transient layout (DDP's first, one-bucket iteration after a restart): its
            # measurements say nothing about the plan's buckets; wait for it to settle
            return None
        since = self.step - self.plan.made_at_step
        if since >= self.replan_every:
            return "periodic"
        settled = self.warmup_steps + self.density_warmup_steps + OVERHEAD_SETTLE_STEPS
        if self._awaiting_overhead and since >= OVERHEAD_SETTLE_STEPS and self.step >= settled:
            return "overhead"
        if (not layout_changed and self._check_at is not None and self.step >= self._check_at
                and self.step >= settled):
            return "check"
        if (not layout_changed and self._check_at is None and self._settled_at is not None
                and self.step >= self._settled_at and self.step >= settled):
            return "settled"
        return "layout" if layout_changed else None

    # ------------------------------------------------------------ pinned and trial plans
    def _adopt_pinned(self, layout):
        """Resolve ``plan=`` for ``layout`` (the end of the warm-up) and keep it for good."""
        kind = self._pinned[0]
        if kind == "keys":
            # DDP's buckets, not the saved plan's (a stats()["plan"] has none: its groups
            # stood in for them, and the recorded bucket indices were the groups' own)
            plan = dataclasses.replace(self._pinned[1], layout=tuple(tuple(b) for b in layout))
            _check_plan_keys(plan, {k for bucket in layout for k in bucket})
            _check_sparse_group_sizes(plan, self._shapes)
        else:
            _, units, dense, predicted, _ = self._pinned
            num_units = sum(len(g) for g in units)
            if len(layout) != num_units:
                if self.step < self.warmup_steps + LAYOUT_SETTLE_STEPS:
                    return  # DDP may not have rebuilt its buckets yet
                raise ValueError(
                    f"plan: the pinned plan has {num_units} buckets but DDP's layout has "
                    f"{len(layout)}; pin a plan saved from the same model and bucket_cap_mb"
                )
            unit_plan = planner_mod.Plan(strategy="pinned", groups=units, dense=dense,
                                         predicted_iteration_s=predicted, non_overlapped_s=0.0)
            plan = GroupPlan.from_unit_plan(unit_plan, layout, made_at_step=self.step)
            _check_sparse_group_sizes(plan, self._shapes)
        self.plan = dataclasses.replace(plan, made_at_step=self.step,
                                        exchange=self._pinned_exchange()
                                        or self._registered_exchange())
        self._note_plan("pinned")

    def _restore_pinned(self, saved):
        """After ``load_state_dict`` with ``plan=``: the pinned plan, not the saved one (a
        checkpoint of another run may hold another plan); bucket-index plans are resolved
        over the saved plan's layout when it fits, else at the end of the next step."""
        self.plan = None
        if self.step < self.warmup_steps:
            return
        exchange = self._pinned_exchange() or self._registered_exchange()
        if self._pinned[0] == "keys":
            layout = saved.layout if saved is not None else self._pinned[1].layout
            plan = dataclasses.replace(self._pinned[1], made_at_step=self.step,
                                       exchange=exchange, layout=layout)
        else:
            _, units, dense, predicted, _ = self._pinned
            if saved is None or len(saved.layout) != sum(len(g) for g in units):
                return
            unit_plan = planner_mod.Plan(strategy="pinned", groups=units, dense=dense,
                                         predicted_iteration_s=predicted, non_overlapped_s=0.0)
            plan = GroupPlan.from_unit_plan(unit_plan, saved.layout, made_at_step=self.step,
                                            exchange=exchange)
        if saved is not None and saved.checksum() == plan.checksum():
            # the checkpoint's run used this very plan: in use since then, on record already
            self.plan = dataclasses.replace(plan, made_at_step=saved.made_at_step)
        else:
            # another plan from here on: the history must say so, or a replay of it
            # (train.py --plan from the log) would run the checkpoint's plan
            self.plan = plan
            self._note_plan("pinned")

    def _note_stall(self, seconds):
        """Host seconds a step spent on re-planning on the autograd thread (taking and
        gathering the numbers at its end and planning from them at the next bucket 0,
        together; switching to the plan; waiting for the planner if it was late)."""
        self._replan_stall = (seconds, max(seconds, self._replan_stall[1]))

    def _note_plan(self, reason):
        """Record the plan in use from step ``self.step`` on (``stats()["plan_history"]``)."""
        plan = self.plan
        entry = {"step": self.step, "strategy": plan.strategy, "groups": plan.unit_groups(),
                 "dense": list(plan.dense), "exchange": plan.exchange, "reason": reason,
                 "predicted_s": plan.predicted_iteration_s, "checksum": plan.checksum()}
        self._plan_history.append(entry)
        del self._plan_history[:-PLAN_HISTORY_LIMIT]

    def _group_plan(self, candidate, layout, step):
        unit_plan = planner_mod.Plan(strategy=candidate.name, groups=candidate.groups,
                                     dense=candidate.dense,
                                     predicted_iteration_s=candidate.predicted_s,
                                     non_overlapped_s=0.0)
        return GroupPlan.from_unit_plan(unit_plan, layout, made_at_step=step,
                                        exchange=candidate.exchange or self._registered_exchange())

    def _advance_trial(self):
        """At bucket 0 of step ``self.step``: close a finished round (one all-gather of
        every rank's step times; identical decision everywhere), then put the scheduled
        candidate in place."""
        trial = self._trial
        if trial.round_complete(self.step):
            rows = self._gather_rows(trial.local_row())
            winner = trial.finish_round(rows.tolist(), self.step)
            if winner is not None:
                self.plan = dataclasses.replace(self._trial_plans[winner], made_at_step=self.step)
                self._note_plan("trial winner")
                self._plan_in_use_from(self.step, check=True)
                self._last_trial = self._refit_from_trial(trial)
                if trial.reason in ("periodic", "regret"):  # (later trials: one budget)
                    self._retrial_steps += self.step - trial.start_step
                self._totals["trials"] += 1
                self._trial = None
                self._trial_plans = []
                logger.info("omgs_hook: step %d %s", self.step, trial.summary())
                return
        index = trial.candidate_at(self.step)
        if index is not None and self.plan != self._trial_plans[index]:
            self.plan = self._trial_plans[index]
            self._note_plan("trial")

    def _maybe_regret_trial(self, layout, settled_s):
        """At the settled check of a trial's winner: when it now runs slower than another
        candidate of that trial by more than the trial could resolve
        (:func:`plan_selection.regret_rival`), try the two once more, the winner first
        (it keeps a tie), from this step. Once per trial; gathered numbers only (the
        settled step time, the trial's report): the same on every rank."""
        report = self._last_trial
        if (self.select != "measured" or self._pinned is not None or self._regret_checked
                or not plan_selection.REGRET_TRIAL or report is None or self._trial is not None
                or self._trial_layout != tuple(tuple(b) for b in layout)):
            return
        winner = next((c for c in report["candidates"] if c.get("winner")), None)
        plan = self.plan
        if (winner is None or [list(g) for g in plan.unit_groups()] != winner["groups"]
                or list(plan.dense) != list(winner["dense"])
                or (winner.get("exchange") or plan.exchange) != plan.exchange):
            return  # the plan in use is not the trial's winner (a re-plan replaced it)
        self._regret_checked = True
        rival = plan_selection.regret_rival(report, settled_s)
        if rival is None:
            return
        # each priced under the correction in use now (the trial's refit added to the one
        # its predictions were made with), so the next refit adds only what it finds
        pair = [plan_selection.Candidate.from_dict(
                    dict(c, predicted_s=c.get("refit_s", c["predicted_s"])))
                for c in (winner, rival)]
        logger.info("omgs_hook: step %d the trial's winner %s runs %.1f ms per step, "
                    "%s measured %.1f ms in the trial: trying the two again", self.step,
                    winner["name"], settled_s * 1e3, rival["name"], rival["measured_s"] * 1e3)
        self._start_trial_from(plan_selection.Trial(
            pair, self.step, reason="regret", duel_pairs=plan_selection.duel_pairs_for("regret")))

    def _refit_from_trial(self, trial):
        """The finished trial's report, with the model's correction fitted from it (the
        same on every rank: the report is made of gathered numbers) for the next
        re-plans, and each candidate's prediction under it (``"refit_s"``)."""
        report = trial.report()
        numels = [sum(math.prod(self._shapes[k]) for k in bucket) for bucket in self._trial_layout]
        step = plan_selection.fit_correction(report["candidates"], numels)
        if step is not None:
            for entry in report["candidates"]:
                entry["refit_s"] = entry["predicted_s"] + step.extra_s(
                    *plan_selection.plan_features(entry["groups"], entry["dense"], numels))
            # the candidates were predicted with the previous correction: add the new one
            old = self._correction or plan_selection.Correction()
            self._correction = plan_selection.Correction(
                constant_s=old.constant_s + step.constant_s,
                dense_s_per_element=old.dense_s_per_element + step.dense_s_per_element,
                sparse_group_s=old.sparse_group_s + step.sparse_group_s,
                points=step.points, sparse_groups_ref=step.sparse_groups_ref,
                ref_plan=step.ref_plan)
        report["correction"] = self._correction.to_dict() if self._correction is not None else None
        return report

    def _start_trial_from(self, trial):
        # candidates saved before they carried an exchange ran on the registration's
        kind = self._registered_exchange()
        trial.candidates = [c if c.exchange is not None or kind is None
                            else dataclasses.replace(c, exchange=kind) for c in trial.candidates]
        self._trial = trial
        self._trial_plans = [self._group_plan(c, self._trial_layout, trial.start_step)
                             for c in trial.candidates]

    def measured_instance(self, layout=None):
        """The planner's input from the measurements of all ranks.

        The slowest rank's timeline (tail, forward, per-bucket backward: median over the
        measurement window of the per-step maximum over ranks), the profile's collective
        costs (or the online refit), and its top-k cost plus the hook's measured
        per-group work and receive side (the largest over ranks, as the slowest rank's
        backward). Every rank
        gets the identical instance.
        Collective: every rank must call it at the same point. ``layout`` defaults to the
        bucket layout of the current measurements.
        """
        self._finish_replan()  # its gather was issued first on every rank
        layout = self.meter.layout if layout is None else layout
        if not layout:
            raise RuntimeError("omgs_hook: no measured step yet, nothing to plan")
        return self._build_instance(layout)[0]

    def _topk_scale_pair(self):
        """``(factor, 0.0)`` of the top-k measured in training over the profile's line
        (:class:`~omgs_hook.measurements.TopkTimeMeter`), or None before a sample."""
        factor = self.topk_times.scale(self.profile.topk_for(self._selector.name))
        return None if factor is None else (factor, 0.0)

    def _on_host(self):
        return self._device is None or self._device.type == "cpu"

    def _fresh_step_s(self):
        """Median seconds per step (step end to step end) over the steps the meter
        prefers (those run with the plan in use), or None with fewer than 3 of them."""
        floor = self.meter.prefer_from_step
        times = [t for step, t in self._step_times if floor is None or step >= floor]
        return statistics.median(times) if len(times) >= 3 else None

    def _build_instance(self, layout):
        """The planner's instance and its inputs for ``layout``, from every rank's
        measurements (one blocking all-gather: every rank calls it at the same point)."""
        row, meta = self._planning_row(layout)
        return self._instance_from_rows(layout, self._gather_rows(row), meta)

    def _planning_row(self, layout):
        """This rank's numbers for a re-plan, as one float64 row for the all-gather, and
        where its parts start (``meta``, for :meth:`_instance_from_rows`). Reads only
        this rank's meters: taken at the end of a step, the row is that step's."""
        backward = self.meter.backward_s() if self.meter.layout == layout else []
        if len(backward) != len(layout):
            backward = [0.0] * len(layout)
        local = list(backward) + [self.meter.forward_s(), self.meter.tail_s()]
        fit = self._fitter.fit() if self._fitter is not None else None
        # the hook's own per-group work is timed on the host: meaningful on CPU only (on
        # CUDA the kernels run asynchronously and the profile's top-k cost stands alone)
        on_host = self._device is None or self._device.type == "cpu"
        optional = [  # (a, b) pairs some rank may not have yet
            (fit.alpha_s, fit.beta_s_per_byte) if fit is not None else None,
            self.overhead.estimate() if on_host else None,
            self.writeback.estimate() if on_host else None,
            # the top-k as training runs it, against the profile's (the same line on
            # every rank: one profile, one selector)
            self._topk_scale_pair() if on_host else None,
        ]
        for pair in optional:  # each as a, b, known
            local += [pair[0], pair[1], 1.0] if pair is not None else [0.0, 0.0, 0.0]
        step_at = len(local)  # the step time, then the collectives' measured times
        step_s = self._fresh_step_s()
        local += [step_s, 1.0] if step_s is not None else [0.0, 0.0]
        load_at = len(local)  # the forward's load ratio (host clock only)
        load = self.meter.forward_load() if self._on_host() else None
        local += [load, 1.0] if load is not None else [0.0, 0.0]
        comm_at = len(local)
        local += self._comm_times.table() if self.measured_comm else self._comm_times.empty_table()
        two_level_at = len(local)  # a two-level run's: its stages' measured times too
        if self._subgroups is not None:
            meter = self._two_level_times
            local += meter.table() if self.measured_comm else meter.empty_table()
        # one all-gather for the planning row and the per-step timelines
        row = np.concatenate((np.asarray(local, dtype=np.float64), self._timeline_table(layout)))
        meta = {"width": len(local), "optional": len(optional), "step_at": step_at,
                "load_at": load_at, "comm_at": comm_at, "two_level_at": two_level_at}
        return row, meta

    def _instance_from_rows(self, layout, gathered, meta):
        """The rest of :meth:`_build_instance`: every rank's gathered
        :meth:`_planning_row` in, ``(instance, inputs)`` out, identical on every rank."""
        width = meta["width"]
        step_at, load_at = meta["step_at"], meta["load_at"]
        comm_at, two_level_at = meta["comm_at"], meta["two_level_at"]
        rows, tables = gathered[:, :width], gathered[:, width:]
        mean = rows.mean(dim=0).tolist()  # same order on every rank: identical
        n = len(layout)

        top = rows.max(dim=0).values.tolist()

        def agreed_pair(index, slowest=False):
            """The rank-mean (a, b) of optional pair ``index`` if every rank had it; with
            ``slowest``, each the largest of the ranks' instead."""
            at = n + 2 + 3 * index
            if float(rows[:, at + 2].min()) <= 0:
                return None
            source = top if slowest else mean
            return max(0.0, source[at]), max(0.0, source[at + 1])

        backward_s, forward_s, tail_s = mean[:n], mean[n], mean[n + 1]
        slowest = self._slowest_rank_timeline(tables, layout)
        if slowest is not None:
            tail_s, forward_s, backward_s = slowest[0], slowest[1], slowest[2:]
        # The hook's per-group work (h, w, the top-k's factor) runs on each rank's compute
        # stream, and every collective waits for the rank that issues it last: as for
        # backward, the slowest rank's counts (ResNet-20's 59 groups on 2 ranks: the
        # ranks' send windows differed by 5-7 ms a step, and the rank-mean priced the
        # step 10% short, the largest 4-8%). The network's refit is the ranks' mean.
        refit = agreed_pair(0)
        overhead, writeback, topk_scale = (agreed_pair(i, slowest=True)
                                           for i in range(1, meta["optional"]))
        # what the network itself costs: the profile's, or the online refit
        network = self.profile.comm if refit is None else LinearCost(*refit)
        comm = network
        topk = self.profile.topk_for(self._selector.name)
        if topk_scale is not None and topk_scale[0] > 0:
            # the top-k as training runs it (measurements.TopkTimeMeter)
            topk = topk.scaled(topk_scale[0])
        overhead_known = overhead is not None
        per_group, per_element = overhead or (0.0, 0.0)
        wb_group, wb_element = writeback or (0.0, 0.0)
        # The receive side of a flat sparse group (unpack, scatter-add, average, write
        # back: ``w0 + w1 * D``) runs on the autograd thread (the deferred write-back,
        # measured only on the host), so it is compute-stream work like ``h``: it joins
        # the top-k line below, not the collective's (the measured collective times end
        # at completion, group_exchange._complete). Two-level groups write back on the
        # collective's thread; their base keeps the line without it.
        # (a bucket of zero-element parameters costs nothing; the model's units are >= 1)
        numels = self._layout_numels(layout)
        dense = self.profile.dense if self.allow_dense else None
        two_level = self._two_level_costs()
        scales = {"sparse": None, "dense": None}
        # the lines before the flat exchange's measurements: a two-level run prices its
        # two-level plans by its two-level measurements alone
        plain_comm, plain_dense = comm, dense
        comm_rows = rows[:, comm_at:comm_at + self._comm_times.table_width]
        if float(comm_rows.abs().max()) > 0:  # gathered: the same decision on every rank
            comm, dense, scales = self._scaled_by_measurement(
                comm_rows.reshape(self.world_size, self._comm_times.window, -1), comm, dense)
        measured_step_s = (float(rows[:, step_at].max())
                           if float(rows[:, step_at + 1].min()) > 0 else None)
        loads = [float(x) for x, known in zip(rows[:, load_at], rows[:, load_at + 1]) if known > 0]
        # a sparse group's work on the compute stream has top-k's form: fixed + per element
        group_work = TopkCost(c0=topk.c0 + per_group, c1=topk.c1 + per_element, c2=topk.c2)
        # a flat group's receive side runs on the same thread (deferred write-back)
        flat_work = dataclasses.replace(group_work, c0=group_work.c0 + wb_group,
                                        c1=group_work.c1 + wb_element)
        correction = self._correction if self.select == "measured" else None
        base = Instance(
            layers=units_of(numels, backward_s),
            world_size=self.world_size,
            density=self.density,
            forward_s=forward_s,
            comm=comm,
            topk=flat_work,
            dense=dense,
            tail_s=tail_s,
            min_sparse_numel=self.min_sparse_numel,
        )
        # a two-level run: the base of its two-level plans, with the lines as they were
        # before the flat measurements (those scale the flat candidates' base only), and
        # the link classes scaled by the two-level stages' measured times
        two_level_base, two_level_scales = base, None
        if self._subgroups is not None:
            if comm is not plain_comm or dense is not plain_dense or wb_group or wb_element:
                two_level_base = dataclasses.replace(base, comm=plain_comm, dense=plain_dense,
                                                     topk=group_work)
            if two_level is not None:
                meter = self._two_level_times
                two_level_rows = rows[:, two_level_at:two_level_at + meter.table_width]
                two_level_scales = {"intra": None, "inter": None, "inter_dense": None}
                if float(two_level_rows.abs().max()) > 0:  # gathered: the same on every rank
                    derived = (hierarchical_instance(two_level_base, *two_level).inter_dense_cost()
                               if two_level[3] is None and plain_dense is not None else None)
                    two_level, two_level_scales = self._two_level_scaled_by_measurement(
                        two_level_rows.reshape(self.world_size, meter.window, -1).tolist(),
                        two_level, derived)
                    factor = two_level_scales["inter_dense"]
                    if derived is not None and factor is not None:
                        # the derived inter-node all-reduce is linear in the flat dense
                        # line: scaling that line scales it by the same factor
                        two_level_base = dataclasses.replace(
                            two_level_base, dense=plain_dense.scaled(factor))
        # kept for the model check, which refits the correction against these bases
        self._base_instance = (tuple(tuple(b) for b in layout), base, two_level, two_level_base)
        # what the last trial measured beyond the model (plan_selection.Correction)
        instance = _corrected(base, correction, self._registered_exchange())
        # the flat exchange's instance: what a two-level run's flat candidates are priced by
        self._flat_instance = (self._base_instance[0], instance)
        if two_level_base is not base:
            instance = _corrected(two_level_base, correction, self._registered_exchange())
        if two_level is not None:
            # the two-level exchange: its sparse groups follow the two-level timeline
            # (reduce-scatter and shard top-k, inter-node then intra-node all-gather);
            # dense groups price their inter-node all-reduce by the profile's inter_dense
            # when it has one (else derived from the flat dense cost)
            instance = hierarchical_instance(instance, *_two_level_corrected(two_level, correction))
        inputs = {"forward_s": forward_s, "tail_s": instance.tail_s, "group_overhead_s": per_group,
                  "group_overhead_s_per_element": per_element,
                  "overhead_measured": overhead_known,
                  "correction": correction.to_dict() if correction is not None else None,
                  "writeback_s": wb_group, "writeback_s_per_element": wb_element,
                  "topk_scale": topk_scale[0] if topk_scale is not None else None,
                  "comm_override": network if network is not self.profile.comm else None,
                  "two_level_model": two_level is not None,
                  "comm_scale": scales, "two_level_scale": two_level_scales,
                  "measured_step_s": measured_step_s,
                  "forward_load": max(loads) if loads else None}
        return instance, inputs

    @staticmethod
    def _scaled_by_measurement(table, comm, dense):
        """``comm`` and ``dense`` scaled by the measured collectives (``measured_comm``):
        ``table[rank][step]`` holds every rank's :func:`~omgs_hook.measurements.comm_sums`
        of its recent steps, ``(sparse_s, sparse_count, sparse_bytes, dense_s,
        dense_count, dense_elements)`` (all zero where a rank has fewer steps). Per kind:
        per step the measured over the modelled time of its collectives, per rank the
        median over its steps (one odd step - a GC pause, the first step after a pause -
        does not move it), then the least over the ranks that have samples of that kind
        (the others' times include waiting for the last rank to issue). Gathered numbers:
        identical on every rank."""
        factors = {}
        rows = table.tolist()
        for kind, at, line, bytes_per in (("sparse", 0, comm, 1), ("dense", 3, dense, 4)):
            factors[kind] = least_median_factor(rows, at, line, bytes_per)
        if factors["sparse"] is not None:
            comm = comm.scaled(factors["sparse"])
        if factors["dense"] is not None:
            dense = dense.scaled(factors["dense"])
        return comm, dense, factors

    @staticmethod
    def _two_level_scaled_by_measurement(table, two_level, derived_inter_dense=None):
        """``two_level`` = ``(ranks_per_node, intra, inter, inter_dense)`` with each link
        class scaled by its measured factor (``measured_comm`` in a two-level run):
        ``table[rank][step]`` holds every rank's
        :func:`~omgs_hook.measurements.two_level_comm_sums` of its recent two-level
        steps (zeros where a rank has fewer). Per class the factor is the one of the
        flat exchange (:func:`~omgs_hook.measurements.least_median_factor`: per step
        measured over modelled time, per rank the median, the least over ranks): the
        intra-node all-gathers against ``intra``, the inter-node sparse all-gathers
        against ``inter``, the inter-node all-reduces against ``inter_dense`` or, when
        the profile has none, against ``derived_inter_dense`` (the cost the model
        derives from the flat dense line; the caller scales that line, and so the
        derived cost, by the factor: ``inter_dense`` stays None). Returns the scaled
        tuple and ``{"intra", "inter", "inter_dense"}``, None where nothing was
        measured. Gathered numbers: identical on every rank."""
        per_node, intra, inter, inter_dense = two_level
        dense_line = inter_dense if inter_dense is not None else derived_inter_dense
        factors = {"intra": least_median_factor(table, 0, intra),
                   "inter": least_median_factor(table, 3, inter),
                   "inter_dense": least_median_factor(table, 6, dense_line)}

        def scaled(line, factor):
            if line is None or factor is None:
                return line
            return line.scaled(factor)

        return (per_node, scaled(intra, factors["intra"]), scaled(inter, factors["inter"]),
                scaled(inter_dense, factors["inter_dense"])), factors

    def _two_level_costs(self):
        """``(ranks_per_node, intra, inter, inter_dense)`` for planning a two-level exchange
        with the profile's two link classes (``inter_dense`` None when the profile did not
        measure it), or None: flat topology, or a profile without them
        (then the flat costs stand in, warned about once, and the measured selection
        still times the real plans)."""
        topo = self.topology
        if topo is None or not topo.hierarchical or topo.ranks_per_node < 2:
            return None
        hierarchy = self.profile.hierarchy()
        if hierarchy is None or hierarchy.ranks_per_node != topo.ranks_per_node:
            if not self._two_level_warned:
                self._two_level_warned = True
                found = ("no intra/inter link classes" if hierarchy is None else
                         f"ranks_per_node={hierarchy.ranks_per_node}")
                warnings.warn(
                    f"omgs_hook: topology {topo.describe()} but the profile has {found}; "
                    "planning with the flat costs (run omgs-profile on this cluster to "
                    "measure both link classes)", RuntimeWarning, stacklevel=2)
            return None
        return topo.ranks_per_node, hierarchy.intra, hierarchy.inter, hierarchy.inter_dense

    def _layout_numels(self, layout):
        """Elements per bucket of ``layout`` (at least 1: the model prices an empty bucket
        as one element), cached for the last layout."""
        cached = self._numels_of
        if cached is None or cached[0] != layout:
            cached = self._numels_of = (layout, [
                max(1, sum(math.prod(self._shapes[k]) for k in bucket)) for bucket in layout])
        return cached[1]

    def _timeline_table(self, layout):
        """This rank's per-step timelines for ``layout`` as a flat fixed-size row (a
        window of ``[step, tail, forward, backward per bucket]``, -1 where empty)."""
        width = len(layout) + 2
        own = self.meter.timeline_rows() if self.meter.layout == layout else []
        # numpy rows, no Python float per element: with 1000 buckets the window is 32k
        # numbers, and this runs on the autograd thread
        table = np.full((self.meter.window, width + 1), -1.0, dtype=np.float64)
        for i, (step, row) in enumerate(own[-self.meter.window:]):
            if len(row) == width:
                table[i, 0] = step
                table[i, 1:] = row
        return table.reshape(-1)

    def _slowest_rank_timeline(self, tables, layout):
        """``[tail, forward, backward per bucket]`` of the slowest rank per step, or None
        (see :func:`~omgs_hook.measurements.slowest_rank_timeline`), from every rank's
        gathered :meth:`_timeline_table`."""
        width = len(layout) + 2
        gathered = tables.reshape(self.world_size, self.meter.window, width + 1).numpy()
        per_rank = [[(int(r[0]), r[1:]) for r in rank_rows[rank_rows[:, 0] >= 0]]
                    for rank_rows in gathered]
        return slowest_rank_timeline(per_rank)

    def _replan(self, layout, reason="first", built=None):
        """Re-plan for ``layout`` from every rank's measurements (``built``: the
        ``(instance, inputs)`` of :meth:`_instance_from_rows`; else gathered now, a
        blocking all-gather), compute the plan and the trial's
        candidates on the background planner (its thread, or its worker process for a large
        instance where the host has a core to spare), and put the result in use at
        bucket 0 of step ``self.step + PLAN_LAG`` or the first later step at which every
        rank's planner is done - the same step on every rank."""
        if reason == "check":
            self._check_at = None
        if reason == "settled":
            self._settled_at = None
        instance, inputs = built if built is not None else self._build_instance(layout)
        if reason == "check" and self._postpone_check(inputs["forward_load"]):
            return
        self._plan_instance = (tuple(tuple(b) for b in layout), instance)  # for summary()
        flat_instance = self._flat_instance[1]
        self._comm_override = inputs.pop("comm_override")
        self._planned_with = inputs
        if reason == "settled":
            if self.plan is not None and self.plan.layout == layout:
                self._check_plan_in_use(self._instance_for(self.plan, instance, flat_instance),
                                        inputs["measured_step_s"], kind="settled")
                self.plan = dataclasses.replace(
                    self.plan, predicted_iteration_s=self._model_check["predicted_s"])
                self._maybe_regret_trial(layout, inputs["measured_step_s"])
            return
        if reason in ("check", "overhead") and self.plan is not None and self.plan.layout == layout:
            self._check_plan_in_use(self._instance_for(self.plan, instance, flat_instance),
                                    inputs["measured_step_s"])
            # the settled check measures from here: after the steps right after the plan
            # change that this one saw
            self.meter.prefer_from(self.step)
            if reason == "check" and self.select == "measured":
                # the measured winner stays (a new trial comes with the periodic re-plan);
                # its prediction is now the one made from its own steps
                self.plan = dataclasses.replace(
                    self.plan, predicted_iteration_s=self._model_check["predicted_s"])
                return
        if self.step > self._first_guess_steps():  # (the layout is of step self.step - 1)
            self._warn_if_coarse(layout, [u.numel for u in instance.layers])
        kept = self.plan
        periodic = (self.select == "measured" and reason == "periodic" and kept is not None
                    and kept.layout == layout and self._model_key is not None)
        # the plan in use, for the planner as a start (an upper bound; a search the valve
        # stops returns nothing worse than it on the new numbers)
        start = ({"groups": kept.unit_groups(), "dense": list(kept.dense)}
                 if kept is not None and kept.layout == layout else None)
        # a periodic trial compares the kept plan with the new model plan
        workload_s = plan_selection.compute_s(self._base_instance[1])
        if periodic and self._trial_workload_s is None:
            self._trial_workload_s = workload_s  # the first periodic re-plan after a trial
        longest = plan_selection.trial_steps_bound(
            2, duel_pairs=plan_selection.duel_pairs_for("periodic"))
        job = {
            "instance": instance.to_dict(),
            "layout": [list(b) for b in layout],
            "reason": reason,
            "overhead_known": bool(inputs["overhead_measured"]),
            "apply_at_step": (self._first_apply_step() if reason == "first"
                              else self.step + PLAN_LAG),
            "kept": ({"name": kept.strategy, "groups": start["groups"],
                      "dense": start["dense"], "exchange": kept.exchange}
                     if periodic else None),
            "start": start,
            # the model's plans run on the registration's exchange; with topology="auto"
            # resolved two-level the trial also times flat plans, priced on this instance
            "exchange": self._registered_exchange(),
            "flat_instance": flat_instance.to_dict() if self._compares_exchanges() else None,
            "model_key": ([[list(g) for g in self._model_key[0]], list(self._model_key[1])]
                          if periodic else None),
            # the step's compute now and at the baseline (uncorrected inputs)
            "workload_s": workload_s,
            "trial_workload_s": self._trial_workload_s if periodic else None,
            # (the flat model's plan when the last trial started, for such a flat one)
            "flat_model_key": ([[list(g) for g in self._flat_model_key[0]],
                                list(self._flat_model_key[1])]
                               if periodic and self._flat_model_key is not None else None),
            # a later trial only while all of them stay within the budget
            "retrial_ok": self._retrial_steps + longest <= plan_selection.RETRIAL_SHARE * self.step,
            # steps that budget has left: a later trial with a flat candidate too must fit
            "retrial_room": plan_selection.RETRIAL_SHARE * self.step - self._retrial_steps,
        }
        self._totals["replans"] += 1
        self._submit_plan_job(job)

    def _instance_for(self, plan, instance, flat_instance):
        """The instance that prices ``plan``: the flat one for a flat plan in a two-level
        run, else the registration's."""
        if plan.exchange == "flat" and self._subgroups is not None:
            return flat_instance
        return instance

    def _priced_instance(self, plan):
        """The last re-plan's instance for ``plan`` (its exchange's), or None when that
        re-plan was for another layout (for ``summary()`` and ``plot_timeline``)."""
        if self._plan_instance is None or self._plan_instance[0] != plan.layout:
            return None
        flat = self._flat_instance[1] if self._flat_instance is not None else None
        return self._instance_for(plan, self._plan_instance[1], flat)

    def _plan_in_use_from(self, step, check, postponed=0):
        """A plan runs from ``step`` on: measure it from there and, with ``check``, re-check
        the model on it ``CHECK_SETTLE_STEPS`` later (:meth:`_check_plan_in_use`)."""
        self.meter.prefer_from(step)
        self._check_at = step + CHECK_SETTLE_STEPS if check else None
        self._check_postponed = postponed
        self._settled_at = step + SETTLED_CHECK_STEPS

    def _postpone_check(self, forward_load):
        """True (and the check moved on) when the check's steps ran in a load spell:
        ``forward_load``, the gathered largest ratio of a rank's forward over its recent
        level, is above the spell factor. A spell inflates the backward times the
        check re-plans with as well as the step it compares with; the check then
        measures afresh from this step. Decided from gathered numbers: the same on every
        rank."""
        if (forward_load is None or forward_load <= plan_selection.SPELL_FACTOR
                or self._check_postponed >= MAX_CHECK_POSTPONES):
            return False
        logger.info("omgs_hook: step %d model check waits: its steps' forward ran %.2fx the "
                    "recent level (a load spell)", self.step, forward_load)
        self._plan_in_use_from(self.step, check=True, postponed=self._check_postponed + 1)
        return True

    def _check_plan_in_use(self, instance, measured_s, kind="first"):
        """The plan in use, predicted from the steps it ran (``instance``), against the
        slowest rank's measured step (``stats()["model_check"]``). ``kind``: ``"first"``
        (``CHECK_SETTLE_STEPS`` after the plan went into use) or ``"settled"``
        (``SETTLED_CHECK_STEPS`` after, on the steps since the first)."""
        plan = self.plan
        refit = self._refit_correction(plan.layout, plan.exchange)
        if refit is not None:
            instance = refit
        # (the planner's vectorised walk: this runs on the autograd thread)
        predicted = planner_mod.predicted_iteration_s(instance, plan.unit_groups(),
                                                      list(plan.dense))
        self._model_check = {
            "step": self.step, "kind": kind, "strategy": plan.strategy,
            "groups": len(plan.groups),
            "dense_groups": sum(1 for d in plan.dense if d),
            "planned_s": plan.predicted_iteration_s, "predicted_s": predicted,
            "measured_s": measured_s,
            "error": (predicted - measured_s) / measured_s if measured_s else None,
            "postponed": self._check_postponed,
            "forward_load": self._planned_with.get("forward_load"),
            "comm_scale": dict(self._planned_with.get("comm_scale") or {}),
            "topk_scale": self._planned_with.get("topk_scale"),
            "two_level_scale": (dict(self._planned_with["two_level_scale"])
                                if self._planned_with.get("two_level_scale") else None),
            "correction": (self._correction.to_dict()
                           if self._correction is not None and self.select == "measured" else None),
        }
        logger.info("omgs_hook: step %d %s model check of %s (%d groups): predicted %.4f s, "
                    "measured %s", self.step, kind, plan.strategy, len(plan.groups), predicted,
                    "-" if measured_s is None else f"{measured_s:.4f} s")

    def _refit_correction(self, layout, exchange=None):
        """With ``select="measured"``: refit the correction from the last trial's measured
        candidates against the model as it is now (its inputs measured with the plan in
        use, collective costs scaled by ``measured_comm``), replacing the one fitted at
        the trial's end against the model of the trial's start - which already absorbed
        what the measured collective costs now explain. Returns the instance with the
        new correction for a plan on ``exchange`` (a flat plan of a two-level run: the flat
        instance), or None (nothing to refit from). Gathered numbers only: the same on
        every rank."""
        if self.select != "measured" or self._base_instance is None or not self._last_trial:
            return None
        base_layout, base, two_level, two_level_base = self._base_instance
        if base_layout != tuple(tuple(b) for b in layout) or self._trial_layout != base_layout:
            return None
        uncorrected = (two_level_base if two_level is None
                       else hierarchical_instance(two_level_base, *two_level))
        candidates = []
        for c in self._last_trial.get("candidates") or []:
            if c.get("measured_s") is None:
                continue
            # a flat candidate of a two-level run: priced on the flat model
            model = base if c.get("exchange") == "flat" else uncorrected
            dense = list(c["dense"]) if model.dense is not None else None
            if dense is None and any(c["dense"]):
                continue
            predicted = planner_mod.predicted_iteration_s(model, c["groups"], dense)
            candidates.append(dict(c, predicted_s=predicted))
        fit = plan_selection.fit_correction(candidates, [u.numel for u in base.layers])
        if fit is None:
            return None
        self._correction = fit
        if exchange == "flat" or (two_level is None and two_level_base is base):
            return _corrected(base, fit, self._registered_exchange())
        instance = _corrected(two_level_base, fit, self._registered_exchange())
        if two_level is None:
            return instance
        return hierarchical_instance(instance, *_two_level_corrected(two_level, fit))

    def _submit_plan_job(self, job):
        self._plan_job, self._polled_result = job, None
        many_units = len(job["instance"]["layers"]) >= ISOLATE_UNITS
        large = many_units or self._planner.last_compute_s > REPLAN_STALL_BUDGET_S
        spare_core = planner_has_a_core(self.world_size)
        # no core to spare: a re-plan of a large model (a plan is in use meanwhile) runs
        # at the lowest priority, in the cores' idle time; the first plan at training's
        # own, on a thread. (A small model's job that was slow once - a loaded host -
        # stays on the thread: its plan is not held up for many steps.)
        low = (many_units and not spare_core and self.plan is not None
               and LOW_PRIORITY_REPLANS)
        self._planner.submit(_compute_plan, job, self.strategy, self.select,
                             apply_at_step=int(job["apply_at_step"]),
                             isolate=(large and spare_core) or low, low_priority=low)

    def _plans_of(self, job, result):
        """The GroupPlans of a planner ``result`` for ``job``, made at ``self.step`` (the
        step they go into use at)."""
        layout = tuple(tuple(b) for b in job["layout"])
        candidates = result["candidates"]
        if candidates:
            return [self._group_plan(c, layout, self.step) for c in candidates]
        if result["plan"] is None:  # keep the plan in use (the measured winner)
            return [dataclasses.replace(self.plan, made_at_step=self.step)]
        return [self._group_plan(result["plan"], layout, self.step)]

    @staticmethod
    def _checksum_row(plans):
        width = 1 + plan_selection.MAX_CANDIDATES
        return ([len(plans)] + [p.checksum() for p in plans] + [0] * width)[:width]

    def _check_plan_checksums(self, table):
        """``table``: every rank's :meth:`_checksum_row`; raise unless they are equal."""
        if any(len(set(table[:, col].tolist())) > 1 for col in range(table.shape[1])):
            raise RuntimeError(
                f"omgs_hook: ranks computed different plans at step {self.step} "
                f"(checksums {table[:, 1].tolist()}); refusing to continue with mismatched "
                "collectives"
            )

    def _put_plans_in_use(self, result, plans):
        """Put the pending job's ``plans`` (checked equal on every rank) in use from this
        step (a rank that polled its result at an earlier probe made them then)."""
        job, self._plan_job, self._polled_result = self._plan_job, None, None
        plans = [dataclasses.replace(p, made_at_step=self.step) for p in plans]
        layout = tuple(tuple(b) for b in job["layout"])
        # a trial still running was made for another layout ("layout" re-plans are the
        # only ones a trial lets through): the new plans replace it
        self._trial, self._trial_plans = None, []
        candidates = result["candidates"]
        lead = (self._sparse_lead(candidates, self._registered_exchange())
                if candidates and not job["overhead_known"] and not self._awaiting_overhead
                else None)
        if lead is not None:
            # the candidates were priced before any sparse group ran: without the top-k as
            # training runs it and the hook's per-group work, and on backward times taken
            # beside the dense warm-up's all-reduce. Run the model's best sparse plan for
            # OVERHEAD_SETTLE_STEPS steps; the "overhead" re-plan then makes the trial's
            # candidates from those steps (ResNet-20 on 2 shaped ranks: the set made from
            # the warm-up held a 3-group plan 1% ahead of TopK-SGD's, the model's plan
            # five steps later one 3-5% ahead; docs/results/extra/duel_alternation_probe.py)
            self.plan = plans[lead]  # (the candidates' plans, checked equal on every rank)
            self._note_plan("sparse lead")
            self._awaiting_overhead = True
            self._plan_in_use_from(self.step, check=False)
            logger.debug("omgs_hook: step %d sparse lead %s before the trial", self.step,
                         candidates[lead].name)
            return
        if candidates:
            self._model_key = result["model_key"]
            self._flat_model_key = result.get("flat_key")
            # a later trial's workload is the periodic re-plan's that planned it; the first
            # (or a new layout's) was planned from the warm-up: the next periodic re-plan's
            self._trial_workload_s = (job.get("workload_s") if job["reason"] == "periodic"
                                      else None)
            self._regret_checked = False
            self._trial_layout = layout
            # the sparse lead's steps ran the start-up after the dense warm-up already
            lead = plan_selection.FIRST_TRIAL_LEAD_STEPS if job["reason"] == "first" else 0
            # (a trial after the sparse lead is still the run's or the layout's first)
            reason = "first" if job["reason"] == "overhead" else job["reason"]
            self._start_trial_from(plan_selection.Trial(
                candidates, self.step, reason=reason, lead=lead,
                duel_pairs=plan_selection.duel_pairs_for(reason)))
            self._awaiting_overhead = False  # the trial measures the sparse path itself
            logger.debug("omgs_hook: step %d trial of %s", self.step, [c.name for c in candidates])
            return
        plan = plans[0]
        changed = self.plan is None or self.plan.checksum() != plan.checksum()
        self.plan = plan
        if changed:
            self._note_plan(result["reason"])
        # re-plan once more when the hook's own per-group work is still unknown and the
        # plan sends something sparse (decided from gathered numbers: identical on all
        # ranks)
        self._awaiting_overhead = (not job["overhead_known"] and not self._awaiting_overhead
                                   and not all(plan.dense))
        if changed:
            # a new plan is checked once against its own steps (not after a check: a
            # check that changes the plan ends there, so plans cannot ping-pong)
            self._plan_in_use_from(self.step, check=(job["reason"] != "check"
                                                     and not self._awaiting_overhead))
        logger.debug("omgs_hook: step %d new plan %s", self.step, plan.unit_groups())

    @staticmethod
    def _sparse_lead(candidates, exchange=None):
        """The index of the candidate the sparse lead runs: the first (the model's order)
        with the fewest dense groups among those that send something sparse, on the
        registration's ``exchange`` where one does (the model's plans run on it: its steps
        are the ones the re-plan measures); None if none sends anything sparse."""
        sparse = [(c.exchange not in (None, exchange), sum(c.dense), i)
                  for i, c in enumerate(candidates) if not all(c.dense)]
        return min(sparse)[2] if sparse else None

    def _first_guess_steps(self):
        """How many first steps run DDP's first guess of the buckets before it rebuilds
        them: 1, or 2 with ``static_graph=True`` (it rebuilds one iteration later), known
        where register() was given the DDP model."""
        return 2 if getattr(self._registered_ddp(), "static_graph", False) else 1

    def _registered_ddp(self):
        """The DDP model register() put the hook on (None: registered by hand, or gone)."""
        return self._ddp_ref() if self._ddp_ref is not None else None

    def _warn_if_coarse(self, layout, numels):
        """Warn (once) when DDP's buckets leave the planner little to choose from."""
        if self._coarse_warned or self.strategy == "single":
            return
        largest = max(range(len(layout)), key=lambda i: numels[i])
        share = numels[largest] / max(1, sum(numels))
        if share > 0.5 and len(layout[largest]) >= 4:
            self._coarse_warned = True
            # a cap of a sixteenth of the gradient gives the planner about 16 buckets; a
            # fixed value (such as 1 MB) can still leave a small model in one bucket, since
            # DDP closes a bucket only once it has reached the cap
            total_mb = 4 * sum(numels) / 2 ** 20
            warnings.warn(
                f"omgs_hook: DDP bucket {largest} holds {share:.0%} of the gradient "
                f"({len(layout[largest])} parameters in {len(layout)} buckets); the planner can "
                f"only merge whole buckets. Construct DDP with a smaller bucket_cap_mb (about "
                f"{total_mb / 16:.2g} for this model's {total_mb:.3g} MB of fp32 gradients, or 0 "
                "for one parameter per bucket) to let it plan.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ----------------------------------------------------------------- step results
    def _on_step_finished(self, exchange):
        if exchange.nonfinite:
            self._totals["nonfinite_steps"] += 1
            count = self._totals["nonfinite_steps"]
            if self.nonfinite == "skip" and count & (count - 1) == 0:  # 1, 2, 4, ...
                # without a GradScaler the optimizer applies the NaN gradients, as with
                # plain DDP: say so, without flooding a run that overflows often
                logger.warning(
                    "omgs_hook: step %d: a rank's gradient holds NaN/Inf; this step's "
                    "gradients are NaN (a GradScaler skips such a step) and the residuals "
                    "are kept as they were (%d such steps so far; nonfinite='raise' makes "
                    "backward() raise instead)", exchange.step_number, count)
        if exchange.error is not None:
            return
        self.meter.step_finished(exchange.finish_wall)
        # A whole iteration, as the cluster sees it: from the previous step's end (its
        # last write-back) to this one's. A step ends with its last collective, at about
        # the same moment on every rank, so the ranks agree on this time; bucket 0's
        # arrival is each rank's own compute progress, and the slowest rank's bucket-0
        # to bucket-0 time read 10-14% above the steps' real pace on 4 shaped ranks,
        # with about twice the step-to-step noise (docs/design.md, "Step time").
        now = self._clock()
        index = exchange.step_number - 1
        previous, self._step_end = self._step_end, (index, now)
        if previous is not None and previous[0] == index - 1:
            # What the plan costs leaves out a gap between the steps far above the usual
            # one: the training loop's own work (an evaluation after an epoch took 180 ms
            # in the README job, and it always fell on the same trial candidate). This
            # step's forward began after the gap it reads (the meter times the gaps on
            # the host clock: only comparable with it)
            excess = self.meter.tail_excess_s() if self._clock is time.perf_counter else 0.0
            self._step_sample = (index, now - previous[1], excess)
        # its measurements, fed to the meters by _ingest_finished; by the exchange the
        # step ran: a two-level run's flat steps (a flat trial candidate or winner)
        # measure the flat candidates' model
        flat = exchange.subgroups is None
        sums = None
        if self.measured_comm and self._on_host():
            sums = comm_sums(exchange.records) if flat else two_level_comm_sums(exchange.records)
        # (the windows are read at the ingest: this step's last hook call may still be
        # running on the autograd thread while its last collective completes)
        self._finished.append((exchange.step_number, flat, sums, exchange.density,
                               exchange.overhead_samples, exchange.writeback_samples,
                               exchange.window_samples, exchange.topk_samples))
        records = exchange.records
        numel = sum(r.numel for r in records)
        selected = sum(r.selected for r in records)
        nbytes = sum(r.bytes for r in records)
        dense_bytes = sum(r.numel * 4 for r in records)
        start = self.meter.wall_step_start
        step_number = exchange.step_number
        self._last_exchange = exchange
        if exchange.health and all(res is not None for _, res in exchange.health):
            self._health = (step_number, exchange.health)  # read lazily in stats()
        if exchange.staleness:
            self._staleness = (step_number, exchange.staleness)
        self._last = {
            "step": step_number,
            "bytes_sent": nbytes,
            "dense_bytes": dense_bytes,
            "elements": numel,
            "selected": selected,
            "density": selected / numel if numel else 0.0,
            "step_density": exchange.density,
            "exchange": "hierarchical" if exchange.subgroups is not None else "flat",
            "inter_node_bytes": sum(r.inter_bytes for r in records),
            "intra_node_bytes": sum(r.intra_bytes for r in records),
            "groups": len(records),
            "dense_groups": sum(1 for r in records if r.dense),
            "group_keys": [list(r.keys) for r in records],
            "group_dense": [r.dense for r in records],
            "nonfinite": exchange.nonfinite,
            "forward_backward_comm_s": (exchange.finish_wall - start) if start is not None else None,
            "topk_s": exchange.topk_s,
            "hook_s": exchange.hook_s,
        }
        t = self._totals
        t["steps"] += 1
        t["bytes_sent"] += nbytes
        t["dense_bytes"] += dense_bytes
        t["inter_node_bytes"] += self._last["inter_node_bytes"]
        t["intra_node_bytes"] += self._last["intra_node_bytes"]
        t["elements"] += numel
        t["selected"] += selected
        if getattr(exchange, "warmup", False):
            t["warmup_steps"] += 1
            t["warmup_elements"] += numel
            t["warmup_bytes"] += nbytes
        for r in records:
            if not r.dense:
                t["sparse_group_elements"] += r.numel
                t["sparse_group_selected"] += r.selected
        if self.log_every and step_number % self.log_every == 0:
            logger.info("omgs_hook: %s", self.summary_line(step_number))

    def _ingest_finished(self, before_step=None):
        """Feed the measurements of the finished steps numbered below ``before_step``
        (all finished ones when None) to the meters the planner reads: the collectives'
        times (``measured_comm``) and the per-group work on the host. Called on the
        autograd thread at the end of each step's backward, before a re-plan reads the
        meters, and by :meth:`state_dict`. Steps finish in order: DDP waits for a step's
        collectives before the next step's backward ends."""
        finished = self._finished
        while finished and (before_step is None or finished[0][0] < before_step):
            (_, flat, sums, density, overhead_samples, writeback_samples,
             windows, topk_samples) = finished.popleft()
            if sums is not None:
                if not self._collectives_warm:
                    self._collectives_warm = True  # the process group's first use
                else:
                    (self._comm_times if flat else self._two_level_times).add(sums)
            if density == self.density:  # not in the density warm-up: plans are for this
                untimed = untimed_per_group_s(windows)
                for numel, element_pass, fixed in overhead_samples:
                    self.overhead.add(numel, element_pass, fixed + untimed)
                for numel, seconds in writeback_samples:
                    self.writeback.add(numel, seconds, 0.0)
                if self._on_host():  # (on CUDA the host times a launch, not the kernel)
                    for numel, seconds in topk_samples:
                        self.topk_times.add(numel, seconds)

    def _last_with_hook_time(self):
        if not self._last:
            return None
        last = dict(self._last)
        # read now: the last bucket's hook call may have been still running when the step
        # finished (collective callbacks can complete it first)
        last["hook_s"] = self._last_exchange.hook_s
        return last

    def stats(self):
        """Metrics of the last completed step and cumulative totals.

        Returns a dict with ``"last"`` (bytes sent by this rank, elements, selected
        entries, achieved density, the density asked for ``step_density``, number of
        groups, dense groups, whether the step was non-finite, measured
        forward+backward+communication seconds, host seconds in top-k selection
        ``topk_s`` and in the hook body ``hook_s``), ``"total"``
        (the counts summed over the run - steps, bytes sent and their dense equivalent,
        elements and entries selected, non-finite steps; not the times nor the group
        counts - plus re-plans, finished trials and ``"rewound_steps"``, the
        steps whose residual update was undone because their gradient was cleared
        without an optimizer step, see ``on_unapplied``, ``"partly_rewound_steps"``,
        those undone for some of their parameters only, and ``"unused_restored"``, the
        parameter updates undone because DDP dropped their result - an accumulation's
        earlier gradient, handed over again for a parameter no rank used in a later
        micro-batch (``find_unused_parameters``), and ``"replans_dropped"``, re-plans
        whose gather failed under ``stats()`` or ``state_dict()`` because a peer had
        died: dropped, not raised; ``"density"`` is the
        achieved density of the steps *after* the dense warm-up - dense groups the plan
        chose count with all their elements - ``"sparse_group_density"`` that of the
        sparse groups alone, ``"density_all_steps"`` the old figure with the warm-up
        in, and ``"warmup_steps"``, ``"warmup_elements"``, ``"warmup_bytes"`` the
        warm-up's share), ``"plan"`` (groups as bucket indices and as parameter names
        ``"group_keys"``, modes, strategy - or the trial candidate's name -, predicted
        iteration seconds; it can be passed as ``plan=`` to pin it), ``"plan_history"``
        (every plan put in use: first step, strategy, groups, dense flags, reason -
        ``"model"``, ``"trial"`` (a candidate), ``"trial winner"``, ``"pinned"``),
        ``"selection"`` (``select``, the running trial and the last finished one: every
        candidate's predicted and measured seconds, the winner, and ``"duel"``: the two
        leaders run side by side, the median of the runner-up's paired readings over
        the winner's, the pairs and whether the runner-up took over; None without one),
        ``"backward_s_per_unit"`` (median measured per bucket), ``"forward_s"``,
        ``"tail_s"`` (median seconds from a step's last write-back to the next forward),
        ``"measured_iteration_s"`` (wall time from the start of one step's first
        forward with autograd to the start of the next step's, on the host clock - a
        step that calls the model twice, or runs ``no_sync`` micro-batches first, counts
        from its first forward; needs ``module``; what
        ``"predicted_iteration_s"`` predicts), ``"median_iteration_s"`` (the median of
        those over the last 32 steps, of the plan in use's own steps once it has run 3:
        what ``summary()`` compares the prediction with), ``"step_s"`` (this rank's seconds
        from the end of the step before the last to the last step's end: a whole
        iteration, the trial's measure; works without ``module``),
        ``"cost_correction"`` (what the last trial measured beyond the model - a
        constant, seconds per densely sent element,
        seconds per sparse group - added to the model at later re-plans;
        :class:`~omgs_hook.plan_selection.Correction`), ``"planner_wait_s"`` (how long the last
        switch to a background-computed plan waited for the planner thread: the stall
        re-planning cost that step), ``"replan_stall_s"`` (``last`` and ``max``: host
        seconds a step spent on re-planning on the autograd thread - taking its numbers
        at the end of a step and, once their all-gather has arrived, planning from them
        at the next bucket 0, the two together; switching plans at the start of a step;
        the wait for the planner included), ``"planned_with"`` (the forward, tail and
        per-group overhead the last plan was made with, ``"comm_scale"``: the factors
        ``measured_comm`` applied to the sparse and dense collective costs, None where
        there was nothing to measure, and ``"topk_scale"``: the factor the profile's
        top-k line was multiplied by, the top-k as training ran it on the host - None
        before a sparse step and on CUDA), ``"model_check"`` (the model against reality for
        the plan in use: ``CHECK_SETTLE_STEPS`` = 5 steps after a plan goes into use, it
        is re-evaluated with the times measured in its own steps - ``predicted_s``,
        beside ``planned_s`` that it was chosen with - and compared with the slowest
        rank's median step over those steps, ``measured_s``; ``error`` is
        ``(predicted - measured) / measured``; with ``select="measured"`` the winner's
        ``predicted_iteration_s`` becomes ``predicted_s``; ``kind`` ``"first"``, then
        ``"settled"``: ``SETTLED_CHECK_STEPS`` = 20 steps after the plan went into use
        the check runs once more on the steps since the first, and the plan's
        ``predicted_iteration_s`` becomes its ``predicted_s`` in either select mode),
        ``"error_feedback"`` (measured
        every ``HEALTH_EVERY`` = 10 steps: ``step``, this rank's ``gradient_norm`` - its
        local gradient after any ``local_clip_norm`` - the ``residual_norm`` left after
        sending, and their ratio ``residual_to_gradient``; a ratio that keeps growing
        means error feedback is holding back more than it releases) and, with
        ``track_staleness``, ``"staleness"`` (per sparse group of the last step: its
        elements and the ``max`` and ``mean`` steps since an element was last sent).
        """
        # a re-plan started at the end of the last step decides what is reported here
        self._finish_replan(reporting=True)
        total = dict(self._totals)
        all_elements, all_selected = total["elements"], total["selected"]
        sparse_elements = all_elements - total["warmup_elements"]
        sparse_selected = all_selected - total["warmup_elements"]  # warm-up sends all
        total["density"] = sparse_selected / sparse_elements if sparse_elements else 0.0
        total["density_all_steps"] = all_selected / all_elements if all_elements else 0.0
        total["sparse_group_density"] = (total["sparse_group_selected"] / total["sparse_group_elements"]
                                         if total["sparse_group_elements"] else 0.0)
        total["compression"] = total["dense_bytes"] / total["bytes_sent"] if total["bytes_sent"] else 0.0
        plan = None
        if self.plan is not None:
            plan = {
                "strategy": self.plan.strategy,
                "groups": self.plan.unit_groups(),
                "group_keys": [list(g) for g in self.plan.groups],
                "dense": list(self.plan.dense),
                "exchange": self.plan.exchange,
                "num_groups": len(self.plan.groups),
                "made_at_step": self.plan.made_at_step,
                "predicted_iteration_s": self.plan.predicted_iteration_s,
            }
        return {
            "step": self.step,
            "topology": self.topology.to_dict() if self.topology is not None else None,
            "last": self._last_with_hook_time(),
            "total": total,
            "plan": plan,
            "backward_s_per_unit": self.meter.backward_s(),
            "forward_s": self.meter.forward_s(),
            "measured_iteration_s": self.meter.last_iteration_s,
            "median_iteration_s": self.meter.iteration_s(
                since_step=self._plan_history[-1]["step"] if self._plan_history else None),
            "step_s": self._last_step_s,
            "planner_wait_s": self._planner.last_wait_s,
            "replan_stall_s": {"last": self._replan_stall[0], "max": self._replan_stall[1]},
            "cost_correction": self._correction.to_dict() if self._correction is not None else None,
            "plan_history": [dict(e) for e in self._plan_history],
            "selection": {
                "select": self.select,
                "pinned": self._pinned is not None,
                "trial": self._trial.report() if self._trial is not None else None,
                "last_trial": self._last_trial,
            },
            "predicted_iteration_s": self.plan.predicted_iteration_s if self.plan else None,
            "model_check": dict(self._model_check) if self._model_check else None,
            "planned_with": dict(self._planned_with) if self._planned_with else None,
            "tail_s": self.meter.tail_s(),
            "residual_norm": self.memory.total_norm(),
            "comm_model": self._comm_model_report(),
            "error_feedback": self._error_feedback_report(),
            "staleness": self._staleness_report(),
        }

    def _error_feedback_report(self):
        if self._health is None:
            return None
        step, per_group = self._health
        grad = math.sqrt(sum(float(g) for g, _ in per_group))
        residual = math.sqrt(sum(float(r) for _, r in per_group))
        return {"step": step, "gradient_norm": grad, "residual_norm": residual,
                "residual_to_gradient": residual / grad if grad > 0 else None}

    def _staleness_report(self):
        if self._staleness is None:
            return None
        step, groups = self._staleness
        return {"step": step, "groups": [
            {"group": i, "elements": ages.numel(), "max": int(ages.max()),
             "mean": float(ages.double().mean())} for i, (_, ages) in enumerate(groups)]}

    def _comm_model_report(self):
        if self.profile is None:
            return None
        comm = self._comm_override or self.profile.comm
        return {"alpha_s": comm.alpha_s, "beta_s_per_byte": comm.beta_s_per_byte,
                "refit_online": self._comm_override is not None,
                "profile": self.profile.path or self.profile.source}

    def summary(self):
        """The run so far in a few lines of text: the plan - its groups, which are dense
        and why (the model's cost of sending each group sparse and dense) and how it was
        chosen -, the achieved density of the sparse steps, bytes per step against dense
        all-reduce, and the predicted and measured step. ``scripts/train.py`` prints it
        at the end of a run."""
        s = self.stats()  # (which finishes a pending re-plan first)
        lines = []
        plan = self.plan
        if plan is None and self.density >= 1.0:
            lines.append(f"omgs_hook after {s['step']} steps: density 1, so every step is a "
                         f"dense all-reduce and nothing is planned")
        elif plan is None and s["step"] < self.warmup_steps:
            lines.append(f"omgs_hook after {s['step']} steps: no plan yet (dense warm-up of "
                         f"{self.warmup_steps} steps)")
        elif plan is None:
            # past the warm-up: the first plan is being made, or a load dropped the
            # checkpoint's (other options, world size or trainable parameters)
            lines.append(f"omgs_hook after {s['step']} steps: no plan in use yet (one is "
                         f"being made: the first, or after a load that dropped the saved "
                         f"plan); until then each step is sent as one sparse group")
        else:
            history = s["plan_history"]
            how = history[-1]["reason"] if history else "model"
            # (the history's step: a later re-plan that kept the plan moves made_at_step)
            since = history[-1]["step"] if history else plan.made_at_step
            lines.append(
                f"omgs_hook after {s['step']} steps: plan '{plan.strategy}' ({how}, in use "
                f"since step {since}): {len(plan.groups)} groups, "
                f"{sum(plan.dense)} dense, density {self.density:g}, select={self.select}"
                + (f", topology {self.topology.describe()}" if self.topology is not None else "")
                + (f", exchange {plan.exchange}" if self._subgroups is not None else ""))
            costs = self._priced_instance(plan)
            for g, units in enumerate(plan.unit_groups()):
                numel = sum(math.prod(self._shapes[k]) for k in plan.groups[g])
                span = f"bucket {units[0]}" if len(units) == 1 else f"buckets {units[0]}-{units[-1]}"
                text = f"  group {g}: {span}, {numel:,} elements, {'dense' if plan.dense[g] else 'sparse'}"
                if costs is not None:
                    # (priced as the planner prices it: an empty bucket as one element)
                    priced = max(1, numel)
                    sparse_s = costs.topk_time(priced) + costs.sparse_comm_time(priced)
                    text += f"; model: sparse {sparse_s * 1e3:.2f} ms (top-k + all-gather)"
                    if costs.dense is not None:
                        text += f", dense {costs.dense_comm_time(priced) * 1e3:.2f} ms (all-reduce)"
                    else:
                        text += ", dense not allowed"
                if plan.dense[g] and numel < self.min_sparse_numel:
                    text += (f"; under min_sparse_numel ({self.min_sparse_numel}): dense "
                             "whatever it costs")
                lines.append(text)
            last_trial = s["selection"]["last_trial"]
            if last_trial:
                tried = ", ".join(
                    f"{c['name']} {c['predicted_s'] * 1e3:.0f}/"
                    f"{'-' if c.get('measured_s') is None else format(c['measured_s'] * 1e3, '.0f')} ms"
                    for c in last_trial["candidates"])
                lines.append(f"  measured selection (predicted/measured): {tried}; "
                             f"winner {last_trial['winner']}")
                if last_trial.get("reason") == "regret":
                    lines.append("  (a second trial: the winner before ran slower once "
                                 "settled than the other measured in its trial)")
        total, last = s["total"], s["last"] or {}
        if plan is not None or self.density < 1.0:  # (at density 1 no step is sparse)
            lines.append(f"  achieved density after the warm-up: {total['density']:.4g} "
                         f"(sparse groups alone: {total['sparse_group_density']:.4g})")
        if last:
            lines.append(f"  bytes sent per step: {last['bytes_sent'] / 1e3:,.1f} kB against "
                         f"{last['dense_bytes'] / 1e3:,.1f} kB dense "
                         f"({_saving(last['bytes_sent'], last['dense_bytes'])}); "
                         f"to other nodes {last['inter_node_bytes'] / 1e3:,.1f} kB, within "
                         f"the node {last['intra_node_bytes'] / 1e3:,.1f} kB")
        predicted = s["predicted_iteration_s"]
        measured = s["median_iteration_s"] or s["measured_iteration_s"] or s["step_s"]
        if predicted is not None and measured:
            error = (predicted / measured - 1) * 100
            lines.append(f"  step: predicted {predicted:.4f} s, measured (median) {measured:.4f} s "
                         + (f"(the prediction {abs(error):.0f}% "
                            f"{'low' if error < 0 else 'high'})" if abs(error) >= 0.5
                            else "(the prediction within 0.5%)"))
        return "\n".join(lines)

    def plot_timeline(self, path):
        """Draw the last step's timeline as the model predicted it (for the plan in use)
        above the one measured on this rank's host clock, and save it to ``path`` (PNG,
        SVG or PDF). Needs matplotlib; the measured panel needs ``module`` (forward
        timing). Raises RuntimeError before the first planned, measured step."""
        self._finish_replan(reporting=True)
        from .cost_model import schedule
        from .timeline_plot import measured_schedule, plot_timelines

        exchange = self._last_exchange
        if self.plan is not None and exchange is not None and self.module is None:
            # without the module there is no forward hook: no step start to measure from
            raise RuntimeError(
                "omgs_hook.plot_timeline: the measured timeline needs the forward's timing; "
                "register the hook with omgs_hook.register(ddp_model, ...) or build the "
                "state with module=ddp_model.module")
        if self.plan is None or exchange is None or self.meter.wall_step_start is None:
            raise RuntimeError("omgs_hook.plot_timeline: no planned, measured step yet")
        panels = []
        instance = self._priced_instance(self.plan)
        if instance is not None:
            panels.append((f"predicted ({self.plan.strategy})",
                           schedule(instance, self.plan.unit_groups(), self.plan.dense)))
        end = self._forward_end_wall
        start = self.meter.wall_step_start
        panels.append((f"measured, step {exchange.step_number}",
                       measured_schedule(start, end if end is not None and end >= start else None,
                                         exchange.arrival_wall, exchange.layout, exchange.records)))
        return plot_timelines(panels, path, title=f"omgs_hook timeline, density {self.density:g}, "
                                                  f"{self.world_size} ranks")

    def summary_line(self, step_number=None):
        s = self.stats()
        if step_number is not None:
            s["step"] = step_number
        last = s["last"] or {}
        plan = s["plan"]
        measured = s["measured_iteration_s"]
        return (
            f"step {s['step']} groups {last.get('groups', 0)}"
            f" (dense {last.get('dense_groups', 0)}) density {last.get('density', 0):.4g}"
            f" sent {last.get('bytes_sent', 0) / 1e6:.3f} MB"
            # (the run's total, dense warm-up included: not this step's, beside it)
            f" compression so far {s['total']['compression']:.1f}x"
            f" iter {measured if measured is None else round(measured, 4)} s"
            f" predicted {None if plan is None else round(plan['predicted_iteration_s'], 4)} s"
            f" plan {None if plan is None else plan['strategy']}"
            + (f" topology {self.topology.describe()}"
               f" inter-node {last.get('inter_node_bytes', 0) / 1e6:.3f} MB"
               if self.topology is not None else "")
            # a two-level run's plan may run on either exchange (the trial compares them)
            + (f" exchange {plan['exchange']}"
               if self._subgroups is not None and plan is not None else "")
            + (f" ({self._trial.summary()} running)" if self._trial is not None else "")
            + (f" last {plan_selection.summary_of(self._last_trial)}"
               if self._last_trial is not None and self._trial is None else "")
        )

    # ------------------------------------------------------------------ persistence
    def state_dict(self):
        """Tensors and plain values only (``torch.load(..., weights_only=True)`` works).

        ``"residuals"`` maps each parameter name (as in ``module.named_parameters()``;
        ``paramN`` without a module) to its residual, shaped like the parameter. Each
        rank saves its own. ``"residuals_before_last_step"`` (or None) holds them as
        they were before the last step while that step's gradient is neither applied
        nor known to be dropped (``on_unapplied``), so that a resumed run can rewind it;
        ``"unapplied_candidates"`` then lists the parameters a resumed run may still
        rewind when an optimizer step has already touched the others (None: all).
        """
        # the re-plan the last step started, whose job (``plan_job``) a resumed run must
        # go on with, as this one does at its next bucket 0
        self._finish_replan(reporting=True)
        # the finished steps' measurements, which the next step would have fed to the
        # meters before its re-plan: the resumed run's meters start where this one's are
        self._ingest_finished()
        # DDP's buckets at the last step, and how many steps in a row they had held; with
        # no step since a load, the loaded ones (saved again right after the load, the
        # state must carry them on, or the next resume plans over DDP's first layout)
        layout, streak = self._layout_streak
        if layout is None:
            layout, streak = self._resumed_layout, self._resumed_streak or 0
        return {
            "format_version": STATE_FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size if dist.is_initialized() else None,
            "rank": dist.get_rank(self.process_group) if dist.is_initialized() else None,
            # the job's rank: with a DDP model on a subgroup, "rank" repeats in every group
            "global_rank": dist.get_rank() if dist.is_initialized() else None,
            "density": self.density,
            "strategy": self.strategy,
            "select": self.select,
            "allow_dense": self.allow_dense,
            "min_sparse_numel": self.min_sparse_numel,
            "residuals": self.memory.state_dict(),
            "residuals_before_last_step": self._residuals_before_last_step(),
            "unapplied_candidates": self._unapplied_candidates(),
            # the loss scale the residuals are at (grad_scaler; None: unscaled)
            "residual_scale": self._residual_scale,
            "topology": self._saved_topology(),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "measurements": self.meter.state_dict(),
            "group_overhead": self.overhead.state_dict(),
            "writeback": self.writeback.state_dict(),
            "topk_times": self.topk_times.state_dict(),
            "awaiting_overhead": self._awaiting_overhead,
            "refit": self._fitter.state_dict() if self._fitter is not None else None,
            "totals": dict(self._totals),
            "select": self.select,
            "trial": self._trial.state_dict() if self._trial is not None else None,
            # (also after the trial: the refit of the model check and the settled
            # check's second look at the winner are for that layout only)
            "trial_layout": ([list(b) for b in self._trial_layout]
                             if self._trial_layout is not None else None),
            "regret_checked": self._regret_checked,
            "last_trial": self._last_trial,
            # a resumed run's first steps run on DDP's first, one-bucket layout: its first
            # plan waits for these, and its settle count goes on from this one
            "layout": [list(b) for b in layout] if layout is not None else None,
            "layout_streak": streak,
            "first_due_at": self._first_due_at,
            "model_key": ([[list(g) for g in self._model_key[0]], list(self._model_key[1])]
                          if self._model_key is not None else None),
            "retrial_steps": self._retrial_steps,
            "trial_workload_s": self._trial_workload_s,
            "correction": self._correction.to_dict() if self._correction is not None else None,
            "plan_history": [dict(e) for e in self._plan_history],
            "plan_job": self._plan_job,
            "comm_times": self._comm_times.state_dict(),
            "two_level_comm_times": self._two_level_times.state_dict(),
            "flat_model_key": ([[list(g) for g in self._flat_model_key[0]],
                                list(self._flat_model_key[1])]
                               if self._flat_model_key is not None else None),
            "step_times": [list(e) for e in self._step_times],
            "check_at": self._check_at,
            "check_postponed": self._check_postponed,
            "settled_at": self._settled_at,
            "model_check": self._model_check,
        }

    def _residual_mismatch(self, sd):
        """Why the residuals of state dict ``sd`` are not this rank's to load - another world
        size, another rank, another topology - as ``(kind, message)``: kind ``"world"``,
        ``"rank"`` or ``"topology"``, the message naming the problem; or None.
        (Resolves the topology when the others match: it is compared too.)"""
        if not dist.is_initialized():
            return None
        saved_world = sd.get("world_size")
        if saved_world is not None and saved_world != self.world_size:
            return "world", (f"state saved with world_size={saved_world}, this run has "
                    f"world_size={self.world_size}: residuals are per-rank error feedback and "
                    "cannot be re-split; pass on_world_size_change='reset' to drop them")
        saved_rank, own_rank = sd.get("rank"), dist.get_rank(self.process_group)
        # Ranks within the process group repeat in every group when the DDP model runs on
        # a subgroup (replica groups [0, 1] and [2, 3]: global ranks 0 and 2 are both
        # rank 0), so the job's rank is compared too, where the state recorded it.
        saved_global, own_global = sd.get("global_rank"), dist.get_rank()
        if (saved_rank is not None and saved_rank != own_rank) or (
                saved_global is not None and saved_global != own_global):
            # typically a checkpoint written by rank 0 alone and loaded by every rank:
            # rank 0's residual would be counted world_size times, the others' lost
            if saved_global is not None and self._group_members()[0] is not None:
                where = (f"global rank {saved_global} (rank {saved_rank} of its process "
                         f"group), loaded on global rank {own_global} (rank {own_rank} of "
                         "its process group)")
            else:
                where = f"rank {saved_rank}, loaded on rank {own_rank}"
            return "rank", (f"rank: state saved by {where}: "
                    "residuals are each rank's own error feedback, so every rank must "
                    "save its own state_dict() and load that one (e.g. "
                    "f'omgs_state.rank{rank}.pt'); pass on_world_size_change='reset' "
                    "to drop them instead")
        self._setup_topology()
        saved_topo, own_topo = sd.get("topology"), self._saved_topology()
        if saved_topo != own_topo:
            return "topology", (f"topology: state saved with topology {saved_topo or 'flat'}, this "
                    f"run has {own_topo or 'flat'}: residuals are per-rank (per-shard "
                    "with the two-level exchange) error feedback and cannot be "
                    "re-split; pass on_world_size_change='reset' to drop them")
        return None

    @staticmethod
    def _parsed_field(sd, name, parse):
        """``parse(sd[name])``, None where the field is absent or empty; a malformed
        field raises ValueError naming it (not a KeyError from deep inside)."""
        value = sd.get(name)
        if value is None or (isinstance(value, (dict, list, tuple, str)) and not value):
            return None  # (a number 0 is parsed)
        try:
            return parse(value)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"state dict field {name!r} is malformed "
                             f"({type(exc).__name__}: {exc})") from None

    def load_state_dict(self, sd):
        """Restore a ``state_dict()`` (before the first step of the new run).

        Validates first and raises ValueError naming the problem, before anything of the
        state changes: unknown format, residuals for parameters the module does not have
        or of the wrong shape, a different world size or topology, a state saved by
        another rank (see ``on_world_size_change``), a malformed plan, trial, correction,
        layout or count. (A saved plan job or trial that does not fit the saved layout -
        only a hand-edited file holds one - fails later in the load.) Loaded later in a
        run, every rank must load at the same point; the next step compares the ranks'
        states again (step, plan, trial) and raises on every rank when they differ.
        """
        if not isinstance(sd, dict) or sd.get("format_version") != STATE_FORMAT_VERSION:
            raise ValueError(
                f"not an OMGSState state dict of format_version {STATE_FORMAT_VERSION}"
            )
        residuals = sd.get("residuals", {})
        mismatch = self._residual_mismatch(sd)
        if mismatch is not None and self.on_world_size_change == "error":
            raise ValueError(mismatch[1])
        drop_residuals = mismatch is not None
        # every field that is parsed into an object is parsed before anything of this
        # state changes: a malformed one (a hand-edited file) leaves the state as it was
        plan = self._parsed_field(sd, "plan", lambda v: GroupPlan.from_dict(
            v, default_exchange=self._registered_exchange()))
        trial = self._parsed_field(sd, "trial", plan_selection.Trial.from_state_dict)
        correction = self._parsed_field(sd, "correction", plan_selection.Correction.from_dict)
        layouts = {name: self._parsed_field(sd, name, lambda v: tuple(tuple(b) for b in v))
                   for name in ("trial_layout", "layout")}
        counts = {name: self._parsed_field(sd, name, int)
                  for name in ("layout_streak", "first_due_at")}
        before = sd.get("residuals_before_last_step")
        rewind = bool(before) and not drop_residuals and self.on_unapplied == "rewind" \
            and self.module is not None
        if rewind:
            check_residuals(before, self._shapes, where="residuals_before_last_step")
        # Another world size or topology is the same finding on every rank, and the plan
        # was made for the old one. Another rank's state (a checkpoint rank 0 wrote alone)
        # is not: rank 0 keeps its residuals, so the plan, the trial and the rest that
        # every rank shares must stay on every rank too, or the ranks would disagree.
        layout_changed = mismatch is not None and mismatch[0] != "rank"
        if not drop_residuals and self.module is None:
            # its keys are param0, param1, ...: a residual under another name (a state
            # saved by register(), with the module's names) would never be sent
            for key in residuals:
                if not (isinstance(key, str) and key.startswith("param")
                        and key[5:].isdigit()):
                    raise ValueError(f"residual for {key!r}: no such parameter in this "
                                     f"state: {MODULELESS_NAMES}")
            self._unplaced_check = True
        if not drop_residuals:
            self.memory.load_state_dict(residuals, self._shapes if self.module is not None else None)
            self._load_residual_scale(sd.get("residual_scale"))
        else:
            norm = math.fsum(float(squared_norm(t)) for t in residuals.values()) ** 0.5
            logger.warning(
                "omgs_hook: world size, topology or rank changed (%s, %s, rank %s, global "
                "rank %s -> %s, %s, rank %s, global rank %s): dropping residuals (L2 norm "
                "%.4g)", sd.get("world_size"), sd.get("topology") or "flat", sd.get("rank"),
                sd.get("global_rank"), self.world_size, self._saved_topology() or "flat",
                dist.get_rank(self.process_group), dist.get_rank(), norm,
            )
            self.memory.load_state_dict({})
        # a plan saved before plans carried their exchange ran on the registration's
        self.plan = plan
        # options changed since the checkpoint: its plan was made for the old ones; the
        # next step re-plans (and, with select="measured", runs a fresh trial)
        # (a pinned plan is not made from options: nothing to drop)
        changed = [f"{name} {sd[name]!r} -> {getattr(self, name)!r}" for name in PLAN_OPTIONS
                   if self._pinned is None and name in sd and sd[name] != getattr(self, name)]
        if changed and self.plan is not None:
            logger.info("omgs_hook: options changed since the checkpoint (%s): its plan is "
                        "dropped, the next step re-plans", ", ".join(changed))
        # parameters frozen since the checkpoint (the module wrapped in a new DDP model
        # after a change of its trainable set): its plan and trial name parameters this
        # state does not train, whose sizes summary() and the trial's refit looked up
        # (KeyError); like other options, that plan is dropped and the next steps re-plan
        stale = set()
        if self.module is not None:
            stale = {k for g in (plan.groups if plan is not None else ()) for k in g}
            stale.update(k for bucket in layouts["trial_layout"] or () for k in bucket)
            stale -= set(self._shapes)
        if stale and self.plan is not None:
            logger.info("omgs_hook: the checkpoint's plan names %d parameters this model does "
                        "not train (e.g. %s): its plan is dropped, the next steps re-plan",
                        len(stale), min(stale))
        replan = layout_changed or bool(changed) or bool(stale)
        if replan:
            self.plan = None  # planned for another world size, options or parameters
        self.step = int(sd.get("step", 0))
        # the residuals are the checkpoint's; if it was taken before the decision on its
        # last step (see _residuals_before_last_step), the first forward decides it here
        self._applied_check = None
        if rewind:
            params = [p for p in self.module.parameters() if p.requires_grad]
            before = {k: v.detach().clone() for k, v in before.items()}
            saved_scale = sd.get("residual_scale")
            if self.grad_scaler is None and saved_scale is not None and saved_scale != 1.0:
                # at the saved loss scale, like the residuals that _load_residual_scale
                # brought to unscaled units: a rewind to them must be in those units too
                for tensor in before.values():
                    tensor.mul_(1.0 / float(saved_scale))
            candidates = sd.get("unapplied_candidates")
            self._applied_check = (params, [p._version for p in params], before,
                                   self._optimizer_steps,
                                   None if candidates is None else frozenset(candidates))
        self.meter.load_state_dict(sd.get("measurements") or {})
        self.overhead.load_state_dict(sd.get("group_overhead") or {})
        self.writeback.load_state_dict(sd.get("writeback") or {})
        self.topk_times.load_state_dict(sd.get("topk_times") or {})
        self._awaiting_overhead = bool(sd.get("awaiting_overhead", False)) and self.plan is not None
        if self._fitter is not None and sd.get("refit"):
            self._fitter.load_state_dict(sd["refit"])
        for k, v in (sd.get("totals") or {}).items():
            if k in self._totals:
                self._totals[k] = int(v)
        self._trial, self._trial_plans, self._trial_layout = None, [], None
        if layouts["trial_layout"] and not replan:
            self._trial_layout = layouts["trial_layout"]
        if trial is not None and not replan and self._pinned is None:
            self._start_trial_from(trial)
        self._regret_checked = bool(sd.get("regret_checked", False))
        self._last_trial = sd.get("last_trial")
        self._resumed_layout = layouts["layout"]
        # (0 in a state saved before the count was: the new layout counted from 1, as then)
        self._resumed_streak = (counts["layout_streak"] or 0
                                if self._resumed_layout is not None else None)
        # this state's own last layout is not the checkpoint's (a load mid-run: a state
        # saved now must carry the checkpoint's, as state_dict reads this first)
        self._layout_streak = (None, 0)
        self._stand_ins_left = 0
        self._first_due_at = counts["first_due_at"]
        key = sd.get("model_key")
        self._model_key = ((tuple(tuple(g) for g in key[0]), tuple(bool(d) for d in key[1]))
                           if key else None)
        self._retrial_steps = int(sd.get("retrial_steps", 0))
        workload = sd.get("trial_workload_s")  # (None in a state saved before it existed)
        self._trial_workload_s = float(workload) if workload is not None else None
        self._correction = correction
        self._plan_history = [dict(e) for e in sd.get("plan_history") or []]
        self._finished.clear()  # this run's steps before the load measure nothing of it
        self._comm_times.load_state_dict(sd.get("comm_times"))
        self._two_level_times.load_state_dict(sd.get("two_level_comm_times"))
        key = sd.get("flat_model_key")
        self._flat_model_key = ((tuple(tuple(g) for g in key[0]), tuple(bool(d) for d in key[1]))
                                if key else None)
        self._step_times.clear()
        self._step_times.extend((int(a), float(b)) for a, b in sd.get("step_times") or [])
        self._check_at = None if sd.get("check_at") is None or replan else int(sd["check_at"])
        self._check_postponed = int(sd.get("check_postponed", 0))
        self._settled_at = (None if sd.get("settled_at") is None or replan
                            else int(sd["settled_at"]))
        self._model_check = dict(sd["model_check"]) if sd.get("model_check") else None
        self._step_end, self._step_sample, self._step_forward = None, None, None
        if self._pinned is not None:
            self._restore_pinned(self.plan)
        self._planner.cancel()
        self._plan_job, self._polled_result = None, None
        if self._pending_replan is not None:
            # a re-plan of the run before the load (issued on every rank: it completes)
            self._pending_replan[2].wait()
            self._pending_replan = None
        if sd.get("plan_job") and not replan and self._pinned is None:
            self._submit_plan_job(sd["plan_job"])
        if self._device is not None:
            self.memory.move_to(self._device)
        # The ranks must agree again on the step counter, plan and trial just loaded: a
        # load after the first step (a rollback to an earlier checkpoint, every rank at
        # the same point) was never compared, and ranks that loaded checkpoints of
        # different steps ran their trials and re-plans at different steps - mismatched
        # collectives (garbage read as a non-finite status word, then a gloo abort).
        self._consistency_checked = False

    def _saved_topology(self):
        """What a checkpoint must match to reuse this rank's residuals: None for a flat
        run, else the two-level exchange's node shape."""
        if self.topology is None or not self.topology.hierarchical:
            return None
        return {"kind": self.topology.kind, "nodes": self.topology.nodes,
                "ranks_per_node": self.topology.ranks_per_node}

    def track_local_use(self):
        """Note which parameters this rank's backward computes a gradient for, so that a
        parameter it left unused is recognised with ``zero_grad(set_to_none=False)``
        too: DDP with ``find_unused_parameters=True`` discards the result for a
        parameter no rank used, so the hook must not send its residual (it "parks" it).
        Without this, only a parameter with no ``.grad`` at all counts as unused.
        The same holds for a rank that joined (``ddp.join()``): its shadow steps run no
        backward of its own while its last step's ``.grad`` may still be set.
        :func:`register` calls it; with ``register_comm_hook`` call it yourself for a
        model with ``find_unused_parameters=True`` or a ``join()`` (it needs ``module``).
        Costs one Python call per parameter gradient per backward pass (0.4 us each,
        measured on 160 parameters on this project's 2-core CPU host)."""
        if self.module is None:
            raise ValueError("track_local_use needs the state's module (OMGSState(module=...))")
        if self._used_keys is not None:
            return
        self._used_keys = set()
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                self._hooks.append(param.register_hook(_MarkUsed(self._used_keys, name)))

    def close(self):
        """Remove the forward hooks this state put on the module; stop the planner (its
        threads and its worker process). ``stats()``, ``summary()`` and ``state_dict()``
        still work; a backward pass through the DDP model raises RuntimeError."""
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._planner.close(timeout=10.0)


def omgs_hook(state, bucket):
    """DDP communication hook implementing OMGS-SGD (see :class:`OMGSState`).

    Register with ``ddp_model.register_comm_hook(OMGSState(...), omgs_hook)`` or, better,
    :func:`register` (which also gives residuals their parameter names).
    """
    return state.on_bucket(bucket)


# the DDP models register() put the hook on (weakly: an attribute of the model holding
# the state made copy.deepcopy(ddp_model) and torch.save(ddp_model) fail on its process
# group; a copy of a DDP model has no hook anyway, DDP rebuilds its reducer without one)
_REGISTERED = weakref.WeakKeyDictionary()


def _queue_behind_ddp(callback):
    """Queue ``callback`` on the autograd engine to run after DDP's end-of-backward
    callback (which waits for the bucket futures and copies the gradients out): DDP queues
    that one after the hook has seen the last bucket, so a callback queued from the hook
    queues ``callback`` when it runs, behind DDP's. Returns False where the engine takes
    no callback (a hook called outside a backward pass)."""
    engine = torch.autograd.Variable._execution_engine

    def behind_ddp():
        engine.queue_callback(callback)

    try:
        engine.queue_callback(behind_ddp)
    except RuntimeError:
        return False
    return True


def _saving(sent, dense):
    """``sent`` bytes against ``dense`` bytes in words: "12.3x less", "1.6x more" (a
    density high enough that indices cost more than they save) or "as much"."""
    if sent <= 0:
        return "nothing sent"
    ratio = dense / sent
    if round(ratio, 1) > 1.0:
        return f"{ratio:.1f}x less"
    if round(1 / ratio, 1) > 1.0:
        return f"{1 / ratio:.1f}x more"
    return "as much"


def register(ddp_model, **options):
    """Validate ``options``, build an :class:`OMGSState` for ``ddp_model`` and register the hook.

    ``options`` are :class:`OMGSState`'s arguments; ``process_group`` defaults to the
    model's. Returns the state (keep it for ``stats()`` and ``state_dict()``).
    Raises TypeError for a non-DDP model and RuntimeError when a hook is registered already.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"omgs_hook.register needs a torch.nn.parallel.DistributedDataParallel model, "
            f"got {type(ddp_model).__name__}"
        )
    if ddp_model in _REGISTERED:
        raise RuntimeError("omgs_hook.register: this DDP model already has the OMGS hook")
    if getattr(ddp_model, "skip_all_reduce_unused_params", False):
        # DDP then never hands over a bucket whose parameters all went unused, the last
        # one included: the hook would never see a step end (a sparse step hung)
        raise ValueError(
            "omgs_hook.register: DDP(skip_all_reduce_unused_params=True) is not supported: "
            "DDP skips the hook for a bucket of unused parameters, so the hook cannot tell "
            "where a step ends. Construct DDP without it; the hook already sends nothing "
            "for a parameter no rank used and keeps its residual")
    if getattr(ddp_model, "mixed_precision", None) is not None:
        # DDP registers a hook of its own for it (gradients cast back to fp32, then its
        # all-reduce), and a DDP model takes one: register_comm_hook would say "can only
        # be called once", about a call the user never made
        raise ValueError(
            "omgs_hook.register: DDP(mixed_precision=...) is not supported: DDP then "
            "registers its own communication hook, and a DDP model takes only one. Construct "
            "DDP without it and train under torch.autocast (with a GradScaler for float16, "
            "passed as grad_scaler=)")
    options.setdefault("process_group", ddp_model.process_group)
    state = OMGSState(module=ddp_model.module,
                      _ddp_ignored=getattr(ddp_model, "parameters_to_ignore", ()), **options)
    state._ddp_ref = weakref.ref(ddp_model)
    # every DDP mode: besides find_unused_parameters, a rank that joined (ddp.join())
    # runs shadow steps with no backward of its own while its last .grad is still set
    state.track_local_use()
    try:
        ddp_model.register_comm_hook(state, omgs_hook)
    except RuntimeError as exc:
        state.close()
        raise RuntimeError(f"omgs_hook.register: DDP refused the hook ({exc})") from exc
    _REGISTERED[ddp_model] = True
    return state


omgs_hook.register = register
