"""Measured plan selection: time a few candidate plans for real and keep the fastest.

The cost model's optimum is the fastest plan *of the model*. Where the model is wrong
(on CPU gloo's dense all-reduce reduces on the cores backward needs; TopK-SGD's single
group is underestimated) it is not the fastest plan of the real system. This module
holds the pure logic of the check the hook runs after each model-based plan:

* :func:`model_candidates` - a small, deduplicated candidate set from the model: the
  model's choice, the optimum without dense groups, an all-dense plan (DDP's own
  all-reduce per bucket), ``single`` (TopK-SGD), ``layerwise`` (LAGS-SGD), ``greedy``, and
  the model's best plans one group fewer and one group more than the sparse optimum;
  in a two-level run with ``topology="auto"`` also the flat model's ``optimal`` and
  ``single`` on the flat exchange (``flat:optimal``, ``flat:single``), so the trial
  measures the exchange as well as the grouping.
* :class:`Trial` - the deterministic schedule (every candidate in turn: ``settle`` steps
  not counted, then ``measure`` counted steps), the slowest-rank reduction of the
  numbers every rank gathered, the near-tie re-measure and the winner.

Nothing here reads a clock or talks to other ranks: the hook feeds the trial its own
per-step times, all-gathers :meth:`Trial.local_row` once per round and hands every
rank's row back to :meth:`Trial.finish_round`. Every rank therefore decides from the
same numbers, in the same order, and picks the same winner even when the ranks' clocks
disagree.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import cost_model
from . import planner as planner_mod
from .cost_model import Instance
from .group_plan import check_exchange

#: steps run with a candidate before its steps are counted (new buffer sizes, caches)
SETTLE_STEPS = 1
#: counted steps per candidate turn in the screening round (every candidate)
MEASURE_STEPS = 1
#: the screening round runs every candidate this many times, in index order then in
#: reverse and so on: a machine that speeds up over the trial's first steps (allocator,
#: caches, TCP windows on shaped links) made the first candidates of a one-pass screen
#: read 10-30% slow and dropped the fastest plan (VGG-16 N = 4: `single` 2.19 s in the
#: screen at steps 13-15, 1.58 s timed later; the default lost 8% to TopK-SGD)
SCREEN_PASSES = 2
#: the first trial of a run starts with this many uncounted steps of the model's choice
#: when its candidates were made with the sparse path measured already (a resumed run);
#: otherwise the hook's sparse lead runs before the trial instead (docs/design.md):
#: the same start-up (the steps right after the dense warm-up ran 20-40% slow on the
#: shaped cluster, falling off over about ten steps) hit whichever candidates ran first
FIRST_TRIAL_LEAD_STEPS = 6
#: counted steps per candidate in the confirm round (and in a retake)
CONFIRM_STEPS = 3
#: counted steps per turn in the tie-break round; each contender runs two turns there, in
#: mirrored order (a b c c b a), so a drift that is linear over the round costs every
#: contender alike
TIEBREAK_STEPS = 2
#: turns per contender in the tie-break round
TIEBREAK_TURNS = 2
#: after screening, candidates within this fraction of the best are measured again
#: (screening has 2 samples each, and a plan's step time moves by 10-25% under load)
CONFIRM_WINDOW = 0.3
#: at most this many candidates (the best included) take part in the confirm round
MAX_CONFIRM = 3
#: at most this many candidates in a full trial
MAX_CANDIDATES = 7
#: after confirming, contenders closer than max(NEAR_TIE, NOISE_TIE * noise) to the best
#: are measured once more. noise: the larger of the confirm samples' median relative
#: deviation and the screen's turn-to-turn noise (how far one candidate's second screen
#: turn moved against its first, beyond what every candidate moved). A trial reading
#: sat 4-9% (quartiles) above the same plan's timed median on the shaped cluster (with
#: steps timed between bucket-0 arrivals; docs/design.md, "Step time"), and
#: consecutive steps of one turn share their load, so the spread within a turn
#: understated the noise between turns: at N = 8, d = 0.001 it read 0.8% while `single`
#: and the 3-group winner, 1.6% apart in the trial, ran 7% apart the other way
NEAR_TIE = 0.03
NOISE_TIE = 1.5
#: at most this many contenders (the best included) take part in the tie-break round:
#: every confirmed one (the third of a near tie was left out when only two were)
MAX_REMEASURE = 3
#: a trial's winner that runs, once settled (the model's settled check, 20 steps after it
#: went into use), slower than another candidate measured in the trial by more than the
#: trial's tie margin (``max(NEAR_TIE, NOISE_TIE * noise)``) is tried once more against
#: that candidate: a two-candidate trial, once per trial (:func:`regret_rival`). The
#: held-out transformer on 4 shaped ranks: one dense group won its trial at 142 ms
#: against 148 ms for ``single``, then ran 156-165 ms while TopK-SGD ran 123-128 ms
REGRET_TRIAL = True
#: after its decision the trial runs the winner and its runner-up (the best other member
#: of the deciding round, when within ``confirm_window`` of the winner) side by side for
#: ``DUEL_PAIRS`` pairs of turns of ``settle`` + ``DUEL_STEPS`` counted steps, in the
#: order W R, R W, W R, ...; the runner-up takes over when the median over the pairs of
#: its reading over the winner's is below 1. The trial's rounds are a few turns each
#: and the host's phases last about ten steps, so a trial's readings of one plan share
#: their error: on the held-out MLP-Mixer (4 shaped ranks) TopK-SGD's one group was the
#: fastest plan by about 5% and the trial picked it in 5 of 12 runs. Pairs of adjacent
#: steps share their phase, and 20 of them spread over 80 steps average it out: in the
#: offline simulation (docs/results/extra/trial_sim/duel_steps.py) the mean regret of the
#: choice fell from 2.56% to 1.13% (one group best by 5%), 0.89% to 0.82% (near-ties),
#: 2.05% to 1.59% (three groups best by 12%); on the Mixer the trial then picked
#: TopK-SGD's plan in 10 of 14 runs (docs/benchmarks.md)
DUEL_PAIRS = 20
#: counted steps per turn of the duel (each after ``settle`` uncounted steps)
DUEL_STEPS = 1
#: a plan other than the *baseline* (TopK-SGD's one sparse group: the plan the default
#: must never lose to) has to read faster than it by more than this fraction to be chosen
#: over it: in every decision of a trial (the screen's and confirm round's windows, the
#: tie-break, the winner, the duel) its time counts ``1 + BASELINE_MARGIN`` times. Over
#: 100 stored cluster runs (docs/results/extra/trial_vs_timed.py), multi-group winners
#: the trial had read within 2% of ``single`` then ran 0.998-1.070x (mean 1.034x) the
#: time of the same run's TopK-SGD A/A copy, those read 2-3% faster 0.979-1.039x (mean
#: 1.002x), and those read 3-5% faster 0.936-1.003x (mean 0.974x): within this margin
#: the trial's lead of a multi-group plan was not real, and VGG-16 (4 shaped ranks) ran
#: 0.96x TopK-SGD after its duel read a 2-group plan 0.992 of ``single``
BASELINE_MARGIN = 0.03
#: the baseline reaches the confirm round whenever the screen read it within this
#: fraction of the best (wider than ``CONFIRM_WINDOW``), taking the round's last place
#: when it is full: two screen turns in host phases 20-30% apart, each divided by its
#: pace, are too few to rule out the plan the default must not lose to. On the held-out
#: MLP-Mixer (4 shaped ranks), where TopK-SGD's one group was the fastest plan, the
#: screen read it 1.35x the best twice in 16 runs and left it out (docs/benchmarks.md).
#: Offline (docs/results/extra/trial_sim/baseline_window.py) it moved the mean regret
#: from 0.44% to 0.32% (`single` best by 5%) and 0.60% to 0.46% (best by 1%), against
#: 1.04% to 1.14% and 1.56% to 1.63% where a multi-group plan was best by 2% and 12%
BASELINE_WINDOW = 0.6
#: the trials that run no duel: later ones (a periodic re-plan's, which share the
#: ``RETRIAL_SHARE`` budget, and the regret trial, itself a side-by-side re-check)
LATER_TRIALS = ("periodic", "regret")
#: later trials (a periodic re-plan whose model plan changed) start only while all of
#: them together stay within this share of the steps run so far
RETRIAL_SHARE = 0.03
#: a periodic re-plan runs a later trial of the full candidate set (within the budget
#: above) when the step's compute - forward, backward and tail, as the model's inputs
#: measure them - has moved by more than this factor since the last trial was planned
#: (for the first trial, and a new layout's, since the first periodic re-plan after it:
#: those were planned from the dense warm-up, whose backward is slower) - a
#: larger batch or another sequence length leaves the trial's measurements stale even
#: where the model's own plan stays the same (measured: 8 Linear layers of 256, batch
#: 32 -> 512 at step 120; the trial's winner then ran 46-55 ms per step where the
#: prediction, refitted to that trial, still said 14-19 ms)
WORKLOAD_FACTOR = 1.5
#: candidates the model predicts slower than this factor times its best are not tried
#: (the model's errors measured so far are within +-40%)
PRUNE_FACTOR = 1.5
#: a counted step is *disturbed* when, on some rank, the load probe (the forward pass
#: that follows it: compute only, the same for every plan) took more than this factor
#: times that rank's median probe of the trial: something else took the cores
SPELL_FACTOR = 1.3
#: at most this many candidate turns per trial are run again because every sample of
#: the candidate in a round was disturbed (each retake: ``settle + confirm`` steps)
MAX_RETAKES = 2
#: divide each counted step by its *pace*: the mean over ranks of each rank's forward
#: pass of that step over that rank's median forward in the trial (compute only, the
#: same for every plan; clamped to [1 / spell_factor, spell_factor], beyond which a
#: step is a spell, not a pace). On 2 shaped ranks sharing 2 cores the host ran in
#: phases 20-30% apart that lasted about ten steps; the step and its own forward
#: correlated at 0.69-0.92, and dividing cut the round-to-round spread of one plan's
#: step time from 7-12% to 3-4%; at 4 ranks from 7-15% to 3-6% (the mean over ranks:
#: the largest ratio, as the load probe takes, left 5-12%) (docs/design.md, "Pace")
ADJUST_PACE = True


def trial_steps_bound(num_candidates, settle=SETTLE_STEPS, measure=MEASURE_STEPS,
                      confirm=CONFIRM_STEPS, max_confirm=MAX_CONFIRM,
                      max_remeasure=MAX_REMEASURE, max_retakes=MAX_RETAKES,
                      screen_passes=SCREEN_PASSES, lead=0, tiebreak=TIEBREAK_STEPS,
                      tiebreak_turns=TIEBREAK_TURNS, duel_pairs=None, duel_steps=DUEL_STEPS):
    """Most steps a trial of ``num_candidates`` can run (its lead, all three rounds, the
    retakes of disturbed candidates and the duel; ``duel_pairs`` None: ``DUEL_PAIRS``)."""
    if duel_pairs is None:  # (read now: a test may set the module's value)
        duel_pairs = DUEL_PAIRS
    n = int(num_candidates)
    steps = n * (settle + measure)
    if n > 1:
        steps *= int(screen_passes)
        contenders = min(max_confirm, n)
        steps += contenders * (settle + confirm)
        if contenders > 1:
            steps += (min(max_remeasure, contenders) * int(tiebreak_turns)
                      * (settle + tiebreak))
        # (a single candidate wins whatever its samples read: never retaken)
        steps += int(max_retakes) * (settle + confirm)
        steps += 2 * int(duel_pairs) * (settle + int(duel_steps))
    return steps + int(lead)


def duel_pairs_for(reason) -> int:
    """The duel's pairs in a trial started for ``reason``: none in later trials."""
    return 0 if reason in LATER_TRIALS else DUEL_PAIRS


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan to try: groups of unit indices, dense flags, the model's prediction, and
    the exchange it runs on (``"flat"``, ``"hierarchical"``; None: the registration's)."""

    name: str
    groups: Tuple[Tuple[int, ...], ...]
    dense: Tuple[bool, ...]
    predicted_s: float
    exchange: Optional[str] = None

    @property
    def key(self):
        """The plan's groups and modes (its exchange aside)."""
        return (self.groups, self.dense)

    @property
    def is_baseline(self):
        """One sparse group: TopK-SGD's plan (``single``, whatever the candidate's name:
        the model's choice can be it), on either exchange."""
        return len(self.groups) == 1 and not self.dense[0]

    def to_dict(self):
        return {"name": self.name, "groups": [list(g) for g in self.groups],
                "dense": list(self.dense), "predicted_s": self.predicted_s,
                "exchange": self.exchange}

    @classmethod
    def from_dict(cls, d):
        # a candidate saved before candidates carried an exchange: None (the registration's)
        return cls(name=str(d["name"]), groups=tuple(tuple(int(u) for u in g) for g in d["groups"]),
                   dense=tuple(bool(x) for x in d["dense"]), predicted_s=float(d["predicted_s"]),
                   exchange=check_exchange(d.get("exchange"), "trial"))

    @classmethod
    def from_plan(cls, name, plan, exchange=None):
        return cls(name=name, groups=tuple(tuple(g) for g in plan.groups),
                   dense=tuple(bool(x) for x in plan.dense),
                   predicted_s=float(plan.predicted_iteration_s), exchange=exchange)


def baseline_weight(is_baseline, margin) -> float:
    """What a candidate's time counts in a trial's decisions: 1 for the baseline
    (:attr:`Candidate.is_baseline`), ``1 + margin`` (``baseline_margin``) for the others."""
    return 1.0 if is_baseline else 1.0 + margin


def dedupe(candidates: Sequence[Candidate], limit: Optional[int] = None) -> List[Candidate]:
    """Drop candidates whose (groups, dense, exchange) an earlier one has; keep the first
    ``limit``."""
    seen = set()
    out = []
    for c in candidates:
        if (c.key, c.exchange) in seen:
            continue
        seen.add((c.key, c.exchange))
        out.append(c)
        if limit is not None and len(out) >= limit:
            break
    return out


def neighbour_plans(inst: Instance, groups, more=True) -> List[Tuple[str, object]]:
    """The model's best sparse plan one group fewer (one merge of two neighbouring groups
    of ``groups``) and, with ``more``, one group more (one split of a group at a unit
    boundary), as ``(name, Plan)`` pairs; ties - times within ``NEIGHBOUR_TIE`` of the
    least, relative - go to the earlier position.

    A plan of g groups over L units has g - 1 merges and L - g splits. Walking each of
    them through :func:`~omgs_hook.planner.evaluate` is O(L) Python apiece: at 1000
    units, 2-3 groups, about 0.5 s of a planning job's 0.6 s. So every option is priced
    at once with numpy (:func:`_neighbour_times`; the same sums in another order, so
    equal up to rounding), and only the one chosen is walked. Ties need the tolerance:
    on a plateau of options whose times differ only by rounding (identical units, a
    network-bound plan) the earliest one is taken, as the walk over all of them would."""
    groups = [tuple(g) for g in groups]
    out = []
    splits = [(i, j) for i, g in enumerate(groups) for j in range(1, len(g))]

    def merged(k):
        return groups[:k] + [groups[k] + groups[k + 1]] + groups[k + 2:]

    def split(k):
        i, j = splits[k]
        return groups[:i] + [groups[i][:j], groups[i][j:]] + groups[i + 1:]

    def walk(groups_k, label):
        return planner_mod.evaluate(inst, groups_k, [False] * len(groups_k), strategy=label)

    def best_of(count, option, times, label):
        if count == 0:
            return
        plans = None
        if times is None:  # (no pricing at once: every option walked)
            plans = [walk(option(k), label) for k in range(count)]
            times = np.array([p.predicted_iteration_s for p in plans])
        else:
            times = times + inst.fixed_s  # (relative to the whole step)
        floor = float(times.min())
        first = int(np.flatnonzero(times <= floor + NEIGHBOUR_TIE * abs(floor))[0])
        out.append((label, plans[first] if plans is not None else walk(option(first), label)))

    priced = _neighbour_times(inst, groups, splits=more) or (None, None)
    best_of(len(groups) - 1, merged, priced[0], f"{len(groups) - 1}-groups")
    if more:
        best_of(len(splits), split, priced[1], f"{len(groups) + 1}-groups")
    return out


#: neighbour plans priced within this relative distance of the cheapest tie with it
#: (rounding is ~1e-15; a nanosecond of a second-long step is no difference to plan by)
NEIGHBOUR_TIE = 1e-9

#: at most this many coarser plans (:func:`fewer_group_plans`) in a trial
MAX_FEWER_GROUPS = 2
#: the chain of merges that makes them walks at most this many plans through
#: ``evaluate`` (one per merge where merges are priced at once, every merge of the plan
#: otherwise): about 0.15 s at 1000 units; a coarser plan beyond it is not offered
MAX_CHAIN_WALKS = 200


def fewer_group_plans(inst: Instance, sparse_opt) -> List[Tuple[str, object]]:
    """Coarser sparse plans for the trial: up to ``MAX_FEWER_GROUPS`` plans at group
    counts spread over the gap between ``single`` and one merge of the sparse optimum
    ``sparse_opt`` (which ``single`` and :func:`neighbour_plans` cover), as ``(name,
    Plan)`` pairs, coarsest last; none when the optimum has fewer than four groups.

    Why: what a step costs beyond the model is mostly a cost per sparse group (a
    collective's start-up the profile underrates, the hook's own work per group; the
    trial's :class:`Correction` fits it). Where it is large the optimum's neighbours are
    all too fine: ResNet-20 on 8 ranks (2026-12-05) measured 33 ms per group beyond the
    model, its trial chose among 5-7 groups, and the 4-group optimum of a fixed run was
    9% faster than the winner.

    How: from the optimum's G groups, merge the two neighbouring groups whose merge the
    model prices fastest (the merge of :func:`neighbour_plans`), again and again; keep
    the plans at ``round(1 + j (G - 2) / 3)`` groups for ``j = 2, 1`` (distinct counts in
    ``[2, G - 2]``). Each merge is priced with numpy at once, so the chain costs about
    ``G`` vectorised passes, not a search; where they cannot be (a two-level instance)
    every merge is walked, and ``MAX_CHAIN_WALKS`` bounds the chain (a count beyond it
    is not offered). (A penalty per group in the planner does not serve: top-k's fixed
    cost lengthens only the compute chain, which the network can hide, and raising it
    made the 1000-unit optimum *finer*.)"""
    count = len(sparse_opt.groups)
    targets = sorted({round(1 + j * (count - 2) / (MAX_FEWER_GROUPS + 1))
                      for j in range(1, MAX_FEWER_GROUPS + 1)} & set(range(2, count - 1)),
                     reverse=True)
    out = []
    groups = [tuple(g) for g in sparse_opt.groups]
    priced = _priced_at_once(inst)
    walks = 0
    while targets:
        walks += 1 if priced else len(groups) - 1
        if walks > MAX_CHAIN_WALKS:
            break
        (_, plan), = neighbour_plans(inst, groups, more=False)
        groups = [tuple(g) for g in plan.groups]
        if len(groups) == targets[0]:
            out.append((plan.strategy, plan))
            targets.pop(0)
    return out


def _priced_at_once(inst: Instance):
    """Whether :func:`_neighbour_times` can price ``inst``'s plans (flat, and no sparse
    group the index range could cut)."""
    total = sum(u.numel for u in inst.layers)
    return inst.hierarchy is None and total <= cost_model.MAX_SPARSE_GROUP_NUMEL


def _neighbour_times(inst: Instance, groups, splits=True):
    """``(merge times, split times)``: each merge's and each split's (in
    :func:`neighbour_plans`' order) final network time, all sparse, with numpy (split
    times None without ``splits``: the L - g splits are most of the work); or None
    where the plain walk must price them (a two-level instance; a sparse group the index
    range could cut). A plan is a prefix state ``(c, e)`` before the changed groups, the
    changed groups, and the unchanged suffix as ``(Ys, G)``: its end is
    ``max(e + Ys, c + G)`` (docs/cost-model.md, the flow-shop identity)."""
    if not _priced_at_once(inst):
        return None
    prefix = planner_mod._prefix_sums(inst)
    ends = np.cumsum([len(g) for g in groups])
    starts = np.concatenate(([0], ends[:-1]))
    if ends[-1] != inst.num_units or any(list(g) != list(range(a, b)) for g, a, b
                                         in zip(groups, starts.tolist(), ends.tolist())):
        return None  # not contiguous runs: evaluate raises its own error

    def costs(lo, hi):  # (X, Y) of sparse groups lo .. hi-1
        return planner_mod._group_terms(inst, prefix, lo, hi)[0]

    m = len(groups)
    # the state before group j, and the suffix from group j on (the polish's own pricing)
    c_before, e_before, ys, g = (np.asarray(a) for a in planner_mod._heads_and_tails(
        inst, prefix, ends.tolist(), [False] * m))
    # merge i: groups i and i + 1 as one
    i = np.arange(m - 1)
    mx, my = costs(starts[i], ends[i + 1])
    c = c_before[i] + mx
    e = np.maximum(e_before[i], c) + my
    merge_times = np.maximum(e + ys[i + 2], c + g[i + 2])
    if not splits:
        return merge_times, None
    # split of group i before unit p
    i = np.repeat(np.arange(m), ends - starts - 1)
    p = np.concatenate([np.arange(a + 1, b) for a, b in zip(starts.tolist(), ends.tolist())]
                       + [np.zeros(0, dtype=np.int64)]).astype(np.int64)
    x1, y1 = costs(starts[i], p)
    x2, y2 = costs(p, ends[i])
    c = c_before[i] + x1
    e = np.maximum(e_before[i], c) + y1
    c = c + x2
    e = np.maximum(e, c) + y2
    split_times = np.maximum(e + ys[i + 1], c + g[i + 1])
    return merge_times, split_times


#: the flat candidates of a two-level run with ``topology="auto"`` (strategy "optimal";
#: another strategy: its own plan on the flat exchange)
FLAT_STRATEGIES = ("optimal", "single")
#: the prefix of a flat candidate's name in a two-level run
FLAT_PREFIX = "flat:"


def compute_s(inst: Instance) -> float:
    """The step's compute as ``inst`` measures it: forward, every unit's backward and the
    tail (what no plan changes; the trial's measurements hold for this workload)."""
    return inst.forward_s + sum(u.backward_s for u in inst.layers) + inst.tail_s


def workload_moved(now_s, then_s, factor: Optional[float] = None) -> bool:
    """Whether the compute ``now_s`` is more than ``factor`` (None: ``WORKLOAD_FACTOR``,
    read at the call) times ``then_s`` or less than its ``1 / factor`` (False while either
    is unknown or not positive)."""
    factor = WORKLOAD_FACTOR if factor is None else factor
    if not now_s or not then_s or now_s <= 0 or then_s <= 0:
        return False
    return max(now_s / then_s, then_s / now_s) > factor


def model_candidates(inst: Instance, strategy: str, model_plan=None,
                     limit: int = MAX_CANDIDATES, prune_factor: float = PRUNE_FACTOR,
                     exchange: Optional[str] = None,
                     flat_inst: Optional[Instance] = None) -> List[Candidate]:
    """The candidate set of a trial, the model's choice first.

    ``inst`` is the instance the model planned (``inst.dense`` set when dense groups are
    allowed); ``strategy`` the user's strategy; ``model_plan`` its plan (computed here
    when None); ``exchange`` the exchange these candidates run on (None: the
    registration's). For ``strategy="optimal"`` the set is: the model's choice, the optimum
    without dense groups, an all-dense plan (every unit its own dense all-reduce: DDP's
    default), ``single``, ``layerwise``, ``greedy`` (all three sparse, as in the papers),
    then the best plans one group fewer and one more than the sparse optimum. For another
    strategy only its own groups are in question: its plan, and the same groups all
    sparse when the model sent some dense. "Sparse" here is up to the instance's floor
    (``min_sparse_numel``): groups below it are sent dense in every candidate.

    ``flat_inst`` (a two-level run with ``topology="auto"``: the flat instance, before
    ``hierarchical_instance``) adds candidates on the flat exchange, named
    ``flat:<strategy>``: the flat model's ``optimal`` and ``single`` (another strategy:
    its own plan), which take the last places of the set so that the exchange itself is
    measured too.

    Duplicates are dropped; for ``strategy="optimal"`` candidates predicted slower than
    ``prune_factor`` times the best prediction (over both exchanges) are left out (never
    the model's choice); at most ``limit`` remain, the flat ones included (the model's
    own set gives up its last places to them).
    """
    strategy = planner_mod.parse_strategy(strategy)
    if model_plan is None:
        model_plan = planner_mod.make_plan(inst, strategy)
    pool = _own_candidates(inst, strategy, model_plan, exchange)
    flat = []
    if flat_inst is not None:
        names = FLAT_STRATEGIES if strategy == "optimal" else (strategy,)
        flat = [Candidate.from_plan(FLAT_PREFIX + name, planner_mod.make_plan(flat_inst, name),
                                    exchange="flat") for name in names]
    rest = pool[1:]
    if strategy == "optimal":  # (another strategy's two or three plans are all tried)
        best = min(c.predicted_s for c in pool + flat)
        rest = [c for c in rest if c.predicted_s <= prune_factor * best]
        flat = [c for c in flat if c.predicted_s <= prune_factor * best]
    flat = dedupe(flat, max(0, limit - 1))
    return dedupe([pool[0]] + rest, max(1, limit - len(flat))) + flat


def _own_candidates(inst, strategy, model_plan, exchange):
    """The candidate pool on the model's own exchange (``model_candidates``), unpruned.

    The "sparse" candidates are planned without the dense cost; every candidate then gets
    the instance's floor for sparse groups (``inst.min_sparse_numel``: smaller groups
    sent dense, :func:`~omgs_hook.planner.small_groups_dense`; the model's own plan and
    the all-dense one have it already): a trial step is a training step, and a candidate
    that isolates a small tensor in a sparse group can harm training in the few steps it
    runs, or win the trial."""
    sparse_inst = dataclasses.replace(inst, dense=None) if inst.dense is not None else inst
    named = [(strategy, model_plan)]
    if strategy != "optimal":
        if any(model_plan.dense):
            named.append((f"{strategy}-sparse", planner_mod.evaluate(
                sparse_inst, model_plan.groups, [False] * len(model_plan.groups))))
    else:
        sparse_opt = planner_mod.make_plan(sparse_inst, "optimal")
        named.append(("optimal-sparse", sparse_opt))
        if inst.dense is not None:
            units = tuple((u,) for u in range(inst.num_units))
            named.append(("all-dense", planner_mod.evaluate(inst, units, [True] * len(units),
                                                            strategy="all-dense")))
        named += [(name, planner_mod.make_plan(sparse_inst, name))
                  for name in ("single", "layerwise", "greedy")]
        neighbours = neighbour_plans(sparse_inst, sparse_opt.groups)
        # one merge, then the coarser plans (what the model misses is mostly per group,
        # so they are likelier winners than one more group), then one split
        named += ([n for n in neighbours if len(n[1].groups) < len(sparse_opt.groups)]
                  + fewer_group_plans(sparse_inst, sparse_opt)
                  + [n for n in neighbours if len(n[1].groups) > len(sparse_opt.groups)])
    return [Candidate.from_plan(name, planner_mod.small_groups_dense(inst, plan), exchange)
            for name, plan in named]


def tie_margin(noise, near_tie: float = NEAR_TIE, noise_tie: float = NOISE_TIE) -> float:
    """The relative gap a trial cannot resolve: ``max(near_tie, noise_tie * noise)``
    (``noise`` None: unknown, ``near_tie`` alone). Contenders closer than this to the best
    are measured again (:class:`Trial`); a winner that runs slower than another candidate
    by more than this once settled is tried again (:func:`regret_rival`)."""
    return max(near_tie, noise_tie * (noise or 0.0))


def _median(values):
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.inf


def _relative_spread(values):
    """Median absolute deviation over the median of the known values (None for < 3)."""
    values = [v for v in values if not math.isnan(v)]
    if len(values) < 3:
        return None
    centre = statistics.median(values)
    if not centre > 0:
        return None
    return statistics.median(abs(v - centre) for v in values) / centre


SCREEN, CONFIRM, TIEBREAK, RETAKE, DUEL = "screen", "confirm", "tiebreak", "retake", "duel"


def _require_int(name, value, minimum):
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``
    (the hook's options have their twin, ``hook._check_int``; this module stays below
    the hook)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def clamped_pace(ratio, spell_factor=SPELL_FACTOR):
    """A step's pace (its forward over the usual one) as a step's time is divided by it:
    clamped to ``[1 / spell_factor, spell_factor]`` (beyond, a step is a spell, not a
    pace); 1.0 where unknown (NaN, not positive). The trial's rule, and the benchmark's
    paced figures (``scripts/bench_cluster.py``)."""
    if not 0 < ratio < math.inf:
        return 1.0
    return min(spell_factor, max(1.0 / spell_factor, ratio))


def _step_loads(probe_rows, reference, combine=max):
    """Per counted step, probe / that rank's reference combined over ranks (NaN where no
    rank has both): by ``max``, the load of the probes; by ``statistics.fmean``, the
    pace of the forwards."""
    loads = []
    for j in range(len(probe_rows[0]) if probe_rows else 0):
        ratios = [row[j] / ref for row, ref in zip(probe_rows, reference)
                  if not math.isnan(row[j]) and ref is not None and ref > 0]
        loads.append(combine(ratios) if ratios else math.nan)
    return loads


class Trial:
    """The schedule and the decision of one measured selection.

    Three rounds, each a list of candidates run one after the other; a candidate's turn
    is ``settle`` steps (not counted) then its counted steps:

    1. *screen*: every candidate in index order, then in reverse index order and so on
       for ``screen_passes`` passes, ``measure`` counted steps per turn (a candidate's
       screen samples are those of all its turns). With two passes candidate ``i`` runs
       at positions ``i`` and ``2n - 1 - i``: a drift of the machine over the round (it
       speeds up over its first steps) costs every candidate alike where it is linear;
    2. *confirm*: the candidates within ``confirm_window`` of the screen's best (at most
       ``max_confirm``, best first), in reverse index order, ``confirm`` counted steps;
       the baseline (below) also when within ``baseline_window``, in the last place;
    3. *tie-break*: the confirmed candidates within ``max(near_tie, noise_tie * noise)``
       of the best (at most ``max_remeasure``), ``tiebreak_turns`` turns each in mirrored
       order (index order, then reverse: ``a b c c b a``), ``tiebreak`` counted steps per
       turn. ``noise`` is the larger of the median relative deviation of the confirm
       round's samples and the screen's turn-to-turn noise (:meth:`turn_noise`), so a
       difference the measurements cannot resolve is measured again.

    Reversing the order from round to round makes a slow drift of the machine (load
    that comes and goes) hit the contenders alike, instead of favouring whichever ran
    last. A round with a single candidate is skipped: it is the winner. The winner is
    the candidate with the lowest time (below) among the last round's members; ties go
    to the lower index (the model's choice first). A candidate's time
    is the geometric mean over the rounds it ran in of its median in that round,
    weighted by its turns there (2 in the screen, 1 in the confirm round, 2 in the
    tie-break): a turn's steps share their load, so turns, not steps, are the
    independent readings. Every contender of a round ran in all the earlier rounds, so
    they are compared over the same rounds, and a drift that favours late positions in
    one round favours early ones in the next.

    *Load spells.* A step that something else slowed down (another job on the cores, a
    GC pause) says nothing about the plan. With each step the hook records a *load
    probe*: the time of the forward pass that follows the step, which is compute only
    and the same for every plan. A counted step is *disturbed* when on some rank its
    probe exceeds ``spell_factor`` times that rank's median probe over the trial so far.
    Disturbed samples are left out of a candidate's median while it has undisturbed
    ones in the round; a candidate with none gets a *retake*: a round of its own right
    after, ``confirm`` counted steps, whose samples then stand in for it in the round
    (or, when the retake was disturbed too, whichever of the two sets has the lower
    median: a spell only slows a step down). A candidate is not retaken when even its
    samples divided by their load (as if the whole step had slowed with its forward: a
    lower bound of its quiet time) are beyond ``confirm_window`` of the round's best
    undisturbed candidate: it could not contend. At most ``max_retakes`` candidate
    turns per trial are retaken, so the budget stays bounded (:func:`trial_steps_bound`).
    Without probes (NaN: e.g. on CUDA, where the host clock would time launches) no
    step is disturbed and the trial is the plain three-round one.

    *Baseline.* TopK-SGD's one sparse group (:attr:`Candidate.is_baseline`) is the plan
    the default must never lose to. Every other candidate's time counts ``1 +
    baseline_margin`` times in every decision (:meth:`weight`: the screen's windows, the
    tie margin, the winner, the duel), so it is chosen over the baseline only when it
    reads more than the margin faster; and the baseline reaches the confirm round when
    the screen read it within ``baseline_window`` of the best. Without a baseline among
    the candidates every weight is the same and nothing moves.

    *Duel.* Once the rounds above have a winner, it and its runner-up (the best other
    member of the deciding round, if within ``confirm_window`` of it) alternate for
    ``duel_pairs`` pairs of turns, ``settle`` + ``duel_steps`` steps each, in the order
    W R, R W, W R, ... . Each pair gives the ratio of the runner-up's reading (the median
    of its turn's counted steps, divided by their pace) to the winner's; the runner-up
    wins when the median of these ratios is below 1. The two turns of a pair run within a
    few steps of each other, where the host's phase is about the same, and the pairs
    spread over the duel's length: the rounds before compare turns that lie further
    apart and read one plan a few times only. The duel's readings decide between the two
    alone (:meth:`measured_s` and the report's times are those of the rounds before);
    ``duel_pairs=0`` leaves it out.

    *Pace.* Short of a spell, the host still runs faster and slower in phases (other
    ranks' threads on the same cores, the network's interrupts): on 2 shaped ranks on 2
    cores, 20-30% apart, each lasting about ten steps, so a candidate whose turns fell
    in a slow phase read slow. With ``adjust_pace`` the hook also reports the step's own
    forward pass (``forward`` of :meth:`record`), and every counted step is divided by
    its pace: the mean over ranks of each rank's forward over its median forward in
    the trial so far, clamped to ``[1 / spell_factor, spell_factor]``. All decisions
    (the screen, the confirm window, the noise, the tie-break, the winner) use the
    divided times. Where the forwards are unknown (NaN) the step is used as it is.

    The hook reports this rank's seconds per step and its probe (:meth:`record`); when a
    round is complete (:meth:`round_complete`) it all-gathers :meth:`local_row` and
    calls :meth:`finish_round` with every rank's row. A step's time is the *slowest*
    rank's (collectives wait for it). A missing sample (NaN: e.g. the first step after a
    resume has no previous arrival) is ignored. All of it is a function of the gathered
    numbers only.
    """

    def __init__(self, candidates: Sequence[Candidate], start_step: int, reason: str = "model",
                 settle: int = SETTLE_STEPS, measure: int = MEASURE_STEPS,
                 near_tie: float = NEAR_TIE, max_remeasure: int = MAX_REMEASURE,
                 confirm: int = CONFIRM_STEPS, confirm_window: float = CONFIRM_WINDOW,
                 max_confirm: int = MAX_CONFIRM, noise_tie: float = NOISE_TIE,
                 spell_factor: Optional[float] = None, max_retakes: int = MAX_RETAKES,
                 screen_passes: int = SCREEN_PASSES, lead: int = 0,
                 tiebreak: int = TIEBREAK_STEPS, tiebreak_turns: int = TIEBREAK_TURNS,
                 adjust_pace: Optional[bool] = None, duel_pairs: Optional[int] = None,
                 duel_steps: int = DUEL_STEPS, baseline_margin: Optional[float] = None,
                 baseline_window: Optional[float] = None):
        if len(candidates) < 1:
            raise ValueError("a trial needs at least one candidate")
        if settle < 0 or measure < 1 or confirm < 1 or tiebreak < 1:
            raise ValueError("settle must be >= 0, measure, confirm and tiebreak >= 1")
        _require_int("tiebreak_turns", tiebreak_turns, 1)
        if confirm_window < 0 or near_tie < 0 or noise_tie < 0 or max_confirm < 1 \
                or max_remeasure < 1:
            raise ValueError("windows must be >= 0, max_confirm and max_remeasure >= 1")
        if spell_factor is None:  # (read now: a test may set the module's value)
            spell_factor = SPELL_FACTOR
        if not spell_factor > 1.0 or max_retakes < 0:
            raise ValueError("spell_factor must be > 1 and max_retakes >= 0")
        _require_int("screen_passes", screen_passes, 1)
        _require_int("lead", lead, 0)
        if duel_pairs is None:  # (read now, as SPELL_FACTOR)
            duel_pairs = DUEL_PAIRS
        _require_int("duel_pairs", duel_pairs, 0)
        _require_int("duel_steps", duel_steps, 1)
        if baseline_margin is None:  # (read now, as SPELL_FACTOR)
            baseline_margin = BASELINE_MARGIN
        if isinstance(baseline_margin, bool) or not isinstance(baseline_margin, (int, float)) \
                or not 0.0 <= baseline_margin < 1.0:
            raise ValueError(f"baseline_margin must be a number in [0, 1), got {baseline_margin!r}")
        self.baseline_margin = float(baseline_margin)
        if baseline_window is None:  # (read now, as SPELL_FACTOR)
            baseline_window = BASELINE_WINDOW
        if isinstance(baseline_window, bool) or not isinstance(baseline_window, (int, float)) \
                or not baseline_window >= 0.0:
            raise ValueError(f"baseline_window must be a number >= 0, got {baseline_window!r}")
        self.baseline_window = float(baseline_window)
        self.duel_pairs = int(duel_pairs)
        self.duel_steps = int(duel_steps)
        # {"winner", "rival": candidate indices, "ratios": per pair} once the duel started
        self.duel = None
        if adjust_pace is None:  # (read now, as SPELL_FACTOR)
            adjust_pace = ADJUST_PACE
        if not isinstance(adjust_pace, bool):
            raise ValueError(f"adjust_pace must be a bool, got {adjust_pace!r}")
        self.adjust_pace = adjust_pace
        self.candidates = list(candidates)
        self.reason = str(reason)
        self.settle = int(settle)
        self.measure = int(measure)
        self.confirm = int(confirm)
        self.tiebreak = int(tiebreak)
        self.tiebreak_turns = int(tiebreak_turns)
        self.confirm_window = float(confirm_window)
        self.max_confirm = int(max_confirm)
        self.near_tie = float(near_tie)
        self.noise_tie = float(noise_tie)
        self.max_remeasure = int(max_remeasure)
        self.spell_factor = float(spell_factor)
        self.max_retakes = int(max_retakes)
        self.screen_passes = int(screen_passes)
        self.lead = int(lead)
        self.retakes_used = 0
        self.start_step = int(start_step)
        # a round is its list of turns (candidate indices; the screen's repeat them)
        self.rounds = [self._screen_turns()]
        self.round_kinds = [SCREEN]
        self.round_start = self.start_step + self.lead
        self.samples = [[] for _ in self.candidates]  # slowest-rank seconds, per round order
        self.round_samples = []  # per finished round: {candidate: its samples there}
        self.noise = None
        self.disturbed = [0 for _ in self.candidates]  # counted steps left out, per candidate
        self.probes = []  # per rank: every gathered load probe of the trial's counted steps
        self.forwards = []  # per rank: every gathered forward of the trial's counted steps
        self.paces = [[] for _ in self.candidates]  # per sample: the pace it was divided by
        self.local = self._empty_local()
        self.local_probe = self._empty_local()
        self.local_forward = self._empty_local()
        self.winner = None
        self.decided_at = None

    # -- schedule ---------------------------------------------------------------------
    def _screen_turns(self):
        order = list(range(len(self.candidates)))
        if len(order) == 1:  # it wins whatever it reads: one turn is enough
            return order
        turns = []
        for p in range(self.screen_passes):
            turns.extend(order if p % 2 == 0 else order[::-1])
        return turns

    @property
    def done(self):
        return self.winner is not None

    def weight(self, index):
        """:func:`baseline_weight` of candidate ``index``. Without a baseline among the
        candidates every weight is the same, and no decision moves."""
        return baseline_weight(self.candidates[index].is_baseline, self.baseline_margin)

    def _duel_to_beat(self):
        """The median ratio (rival over winner) the duel's rival must read below to take
        over: 1 between equals, ``1 / (1 + margin)`` against the baseline, and so on."""
        return self.weight(self.duel["winner"]) / self.weight(self.duel["rival"])

    def scored_s(self, index) -> float:
        """:meth:`measured_s` times :meth:`weight`: the time the decisions compare."""
        return self.measured_s(index) * self.weight(index)

    def _counted_in(self, kind):
        """Counted steps per turn in a round of ``kind``."""
        return (self.measure if kind == SCREEN else self.tiebreak if kind == TIEBREAK
                else self.duel_steps if kind == DUEL else self.confirm)

    @property
    def counted(self):
        """Counted steps per turn in the current round."""
        return self._counted_in(self.round_kinds[-1])

    @property
    def per_candidate(self):
        return self.settle + self.counted

    @property
    def round_end(self):
        """The first step after the current round."""
        return self.round_start + len(self.rounds[-1]) * self.per_candidate

    def max_steps(self):
        """Upper bound of the steps this trial runs (all rounds)."""
        return trial_steps_bound(len(self.candidates), self.settle, self.measure,
                                 self.confirm, self.max_confirm, self.max_remeasure,
                                 self.max_retakes, self.screen_passes, self.lead,
                                 self.tiebreak, self.tiebreak_turns, self.duel_pairs,
                                 self.duel_steps)

    def _slot(self, step):
        """(position in the current round, counted index or None) of ``step``, or None."""
        offset = step - self.round_start
        if self.done or offset < 0 or step >= self.round_end:
            return None
        position, within = divmod(offset, self.per_candidate)
        return position, (within - self.settle if within >= self.settle else None)

    def candidate_at(self, step) -> Optional[int]:
        """Index of the candidate that runs ``step``, or None outside the current round
        (the lead's steps run the first screen turn's candidate, uncounted)."""
        if not self.done and len(self.rounds) == 1 and self.start_step <= step < self.round_start:
            return self.rounds[0][0]
        slot = self._slot(step)
        return None if slot is None else self.rounds[-1][slot[0]]

    def record(self, step, seconds, probe=None, forward=None):
        """This rank's duration of ``step``, its load probe (seconds of the forward pass
        after it) and its own forward pass (seconds; the pace); None: unknown. Kept when
        it is a counted step of the round."""
        slot = self._slot(step)
        if slot is not None and slot[1] is not None:
            self.local[slot[0]][slot[1]] = float(seconds)
            self.local_probe[slot[0]][slot[1]] = math.nan if probe is None else float(probe)
            self.local_forward[slot[0]][slot[1]] = (math.nan if forward is None
                                                    else float(forward))

    def round_complete(self, step):
        """True at (the start of) ``step`` when the current round's steps are all over."""
        return not self.done and step >= self.round_end

    def _empty_local(self):
        return [[math.nan] * self.counted for _ in self.rounds[-1]]

    def local_row(self) -> List[float]:
        """This rank's counted seconds of the round, then their load probes, then their
        forwards, flat (NaN where missing): ``3 * turns * counted`` numbers, the same
        count on every rank."""
        return ([x for row in self.local for x in row]
                + [x for row in self.local_probe for x in row]
                + [x for row in self.local_forward for x in row])

    # -- decision ---------------------------------------------------------------------
    def _measured_rounds(self):
        """(kind, turns, samples) of every finished round but the retakes (whose samples
        stand in for those of the round before them) and the duel (which decides between
        its two alone)."""
        rounds = [(k, t) for k, t in zip(self.round_kinds, self.rounds)
                  if k not in (RETAKE, DUEL)]
        return [(k, t, samples) for (k, t), samples in zip(rounds, self.round_samples)]

    def measured_s(self, index) -> float:
        """Geometric mean over the rounds ``index`` ran in of its median there, weighted
        by its turns in the round (inf when a round has no sample of it, or it never
        ran)."""
        parts = [(_median(samples[index]), turns.count(index))
                 for _, turns, samples in self._measured_rounds() if index in samples]
        if not parts or any(not (0 < m < math.inf) for m, _ in parts):
            return math.inf
        weight = sum(w for _, w in parts)
        return math.exp(sum(w * math.log(m) for m, w in parts) / weight)

    def turn_noise(self):
        """The screen's turn-to-turn noise: per candidate with two known screen turns,
        the log ratio of its second turn's median to its first; their median absolute
        deviation from the median ratio (what every candidate moved alike, a drift, is
        not noise). None with fewer than 3 such candidates or one screen pass."""
        if not self.round_samples or self.screen_passes < 2:
            return None
        moves = []
        for samples in self.round_samples[0].values():
            if len(samples) != self.screen_passes * self.measure:
                continue  # (retaken: its samples are one turn of another length)
            turns = [_median(samples[t * self.measure:(t + 1) * self.measure])
                     for t in range(2)]
            if all(0 < m < math.inf for m in turns):
                moves.append(math.log(turns[1] / turns[0]))
        if len(moves) < 3:
            return None
        centre = statistics.median(moves)
        return statistics.median(abs(m - centre) for m in moves)

    def _next_round(self, kind, members, step):
        members = list(members)
        if kind == TIEBREAK:  # mirrored turns: a b c c b a
            members = [i for t in range(self.tiebreak_turns)
                       for i in (members if t % 2 == 0 else members[::-1])]
        self.rounds.append(members)
        self.round_kinds.append(kind)
        self.round_start = int(step)
        self.local = self._empty_local()
        self.local_probe = self._empty_local()
        self.local_forward = self._empty_local()

    @staticmethod
    def _ratios_of_round(histories, rows, combine=max):
        """``rows`` (per rank) added to each rank's ``histories``; per counted step the
        ratios to each rank's median so far, combined over ranks (:func:`_step_loads`)."""
        if len(histories) != len(rows):
            histories[:] = [[] for _ in rows]  # (a trial restored on another world)
        reference = []
        for history, row in zip(histories, rows):
            history.extend(row)
            known = [x for x in history if not math.isnan(x)]
            reference.append(statistics.median(known) if known else None)
        return _step_loads(rows, reference, combine)

    def _loads_of_round(self, probe_rows):
        """Per counted step the load of its probes against each rank's median probe."""
        return self._ratios_of_round(self.probes, probe_rows)

    def _paces_of_round(self, forward_rows):
        """Per counted step the pace its time is divided by (1.0: not adjusted)."""
        # (the mean: a phase of the host slows every rank; the largest of 4 ranks' ratios
        # is mostly one rank's jitter)
        paces = self._ratios_of_round(self.forwards, forward_rows, statistics.fmean)
        if not self.adjust_pace:
            return [1.0] * len(paces)
        return [clamped_pace(p, self.spell_factor) for p in paces]

    def _decided_round(self):
        """(kind, members) of the last round that was not a retake."""
        for kind, members in zip(reversed(self.round_kinds), reversed(self.rounds)):
            if kind != RETAKE:
                return kind, list(dict.fromkeys(members))
        raise AssertionError("a trial starts with its screen round")

    def finish_round(self, rows, step):
        """Close the round with every rank's :meth:`local_row` (the same list on every rank)
        at hook step ``step``. Returns the winner's index, or None when another round
        starts at ``step``."""
        counted = self.counted
        width = len(self.rounds[-1]) * counted
        rows = [list(map(float, r)) for r in rows]
        # (rows without probes, ``width`` numbers, are accepted: nothing is disturbed;
        # without forwards, ``2 * width``: nothing is divided by its pace)
        if not rows or len({len(r) for r in rows}) != 1 or len(rows[0]) not in (
                width, 2 * width, 3 * width):
            raise ValueError(f"expected rows of {3 * width} numbers, got {[len(r) for r in rows]}")
        probe_rows = [r[width:2 * width] or [math.nan] * width for r in rows]
        forward_rows = [r[2 * width:] or [math.nan] * width for r in rows]
        loads = self._loads_of_round(probe_rows)
        paces = self._paces_of_round(forward_rows)
        this_round, all_disturbed, quiet_bound = {}, [], {}
        gathered = {}  # candidate -> (raw, clean, bound) over all its turns of the round
        turn_readings = []  # per turn: the median of its counted steps (for the duel)
        for position, index in enumerate(self.rounds[-1]):
            raw, clean, bound = gathered.setdefault(index, ([], [], []))
            first = len(raw)
            for j in range(counted):
                column = [r[position * counted + j] for r in rows]
                known = [x for x in column if not math.isnan(x)]
                slowest = max(known) if known else math.nan
                disturbed = (not math.isnan(slowest)
                             and loads[position * counted + j] > self.spell_factor)
                self.disturbed[index] += disturbed
                pace = paces[position * counted + j]
                x = slowest / pace
                self.paces[index].append(pace)  # (aligned with self.samples)
                raw.append(x)
                clean.append(math.nan if disturbed else x)
                if disturbed:  # as if the whole step had slowed with its forward
                    bound.append(slowest / loads[position * counted + j])
            turn_readings.append(_median(raw[first:]))
        for index, (raw, _, _) in gathered.items():
            self.samples[index].extend(raw)
        if self.round_kinds[-1] == DUEL:
            return self._finish_duel(turn_readings, step)
        for index, (raw, clean, bound) in gathered.items():
            if any(not math.isnan(x) for x in raw) and all(math.isnan(x) for x in clean):
                all_disturbed.append(index)
                quiet_bound[index] = _median(bound)
                this_round[index] = raw  # the best there is, unless a retake does better
            else:
                this_round[index] = clean
        if self.round_kinds[-1] == RETAKE:
            # the retake's samples stand in for the disturbed ones of the round before it
            retaken = self.round_samples[-1]
            for index, samples in this_round.items():
                if index not in all_disturbed or _median(samples) < _median(retaken[index]):
                    retaken[index] = samples
        else:
            self.round_samples.append(this_round)
            # a candidate that could not contend even if its whole step had slowed with
            # its forward (the network part did not: a lower bound of its quiet time) is
            # not worth a retake
            best = min((_median(v) for i, v in this_round.items() if i not in all_disturbed),
                       default=math.inf)
            hopeless = [i for i in all_disturbed
                        if quiet_bound[i] > best * (1.0 + self.confirm_window)]
            retake = [i for i in all_disturbed if i not in hopeless]
            retake = retake[:self.max_retakes - self.retakes_used]
            if retake and len(set(self.rounds[-1])) > 1:
                self.retakes_used += len(retake)
                self._next_round(RETAKE, sorted(retake), step)
                return None
        kind, members = self._decided_round()
        this_round = self.round_samples[-1]
        times = {i: self.scored_s(i) for i in members}
        ranked = sorted(members, key=lambda i: (times[i], i))
        best = ranked[0]
        if math.isfinite(times[best]) and kind != TIEBREAK:
            if kind == SCREEN:
                limit = times[best] * (1.0 + self.confirm_window)
                contenders = [i for i in ranked if times[i] <= limit][:self.max_confirm]
                # the baseline, when within its wider window, takes the last place
                reach = times[best] * (1.0 + self.baseline_window)
                base = [i for i in ranked if self.candidates[i].is_baseline
                        and i not in contenders and times[i] <= reach]
                if base and self.max_confirm > 1:
                    contenders = contenders[:self.max_confirm - 1] + base[:1]
                if len(contenders) > 1:
                    self._next_round(CONFIRM, sorted(contenders, reverse=True), step)
                    return None
            else:
                spreads = [x for x in (_relative_spread(this_round[i]) for i in members)
                           if x is not None]
                noises = [x for x in (statistics.median(spreads) if spreads else None,
                                      self.turn_noise()) if x is not None]
                self.noise = max(noises) if noises else None
                tie = tie_margin(self.noise, self.near_tie, self.noise_tie)
                tied = [i for i in ranked if times[i] <= times[best] * (1.0 + tie)]
                tied = tied[:self.max_remeasure]
                if len(tied) > 1:
                    self._next_round(TIEBREAK, sorted(tied), step)
                    return None
        rival = ranked[1] if len(ranked) > 1 else None
        if (self.duel_pairs > 0 and rival is not None and math.isfinite(times[best])
                and times[rival] <= times[best] * (1.0 + self.confirm_window)):
            self.duel = {"winner": best, "rival": rival, "ratios": []}
            turns = [i for p in range(self.duel_pairs)
                     for i in ((best, rival) if p % 2 == 0 else (rival, best))]
            self._next_round(DUEL, turns, step)
            return None
        self.winner = best
        self.decided_at = int(step)
        return best

    def _finish_duel(self, turn_readings, step):
        """The duel's winner from its turns' readings (in the round's order)."""
        winner, rival = self.duel["winner"], self.duel["rival"]
        turns = self.rounds[-1]
        ratios = []
        for p in range(len(turns) // 2):
            reading = {turns[2 * p]: turn_readings[2 * p],
                       turns[2 * p + 1]: turn_readings[2 * p + 1]}
            if all(0 < reading[i] < math.inf for i in (winner, rival)):
                ratios.append(reading[rival] / reading[winner])
        self.duel["ratios"] = ratios
        # (no pair known - every sample missing: the rounds before decide); the rival's
        # reading counts with its weight, as in the rounds before
        self.winner = (rival if ratios and statistics.median(ratios) < self._duel_to_beat()
                       else winner)
        self.decided_at = int(step)
        return self.winner

    def duel_report(self):
        """The duel's two candidates, its pairs' median ratio (runner-up over winner of
        the rounds before) and whether the runner-up took over; None without a duel."""
        if self.duel is None:
            return None
        ratios = self.duel["ratios"]
        return {"winner": self.candidates[self.duel["winner"]].name,
                "rival": self.candidates[self.duel["rival"]].name,
                "pairs": len(ratios), "planned_pairs": self.duel_pairs,
                "median_ratio": statistics.median(ratios) if ratios else None,
                "to_beat": self._duel_to_beat(),
                "switched": self.done and self.winner == self.duel["rival"]}

    def _members(self, kind):
        members = [i for r, k in zip(self.rounds, self.round_kinds) if k == kind for i in r]
        return list(dict.fromkeys(members))  # (the screen's turns repeat candidates)

    def steps_run(self):
        """Per candidate, the steps it ran so far in this trial (lead, settle and counted
        steps of every finished round)."""
        out = [0] * len(self.candidates)
        out[self.rounds[0][0]] += self.lead
        finished = len(self.rounds) if self.done else len(self.rounds) - 1
        for turns, kind in zip(self.rounds[:finished], self.round_kinds[:finished]):
            for i in turns:
                out[i] += self.settle + self._counted_in(kind)
        return out

    def excess_steps(self) -> Optional[float]:
        """What the trial cost against running its winner throughout, in steps of the
        winner: the sum over candidates of steps run times (measured / winner's - 1).
        Candidates never measured count as the winner's pace. None until decided."""
        if not self.done:
            return None
        best = self.measured_s(self.winner)
        if not 0 < best < math.inf:
            return None
        total = 0.0
        for i, steps in enumerate(self.steps_run()):
            measured = self.measured_s(i)
            if measured < math.inf:
                total += steps * (measured / best - 1.0)
        return total

    def round_medians(self, index):
        """``[kind, median seconds or None]`` of ``index`` in each finished round it ran
        in (retakes folded into the round they stand in for)."""
        out = []
        for kind, _, samples in self._measured_rounds():
            if index in samples:
                m = _median(samples[index])
                out.append([kind, None if math.isinf(m) else m])
        return out

    def report(self):
        """Every candidate with its prediction and measurement, and the winner."""
        out = []
        for i, c in enumerate(self.candidates):
            measured = self.measured_s(i)
            out.append({"name": c.name, "groups": [list(g) for g in c.groups],
                        "dense": list(c.dense), "exchange": c.exchange,
                        "predicted_s": c.predicted_s,
                        "measured_s": None if math.isinf(measured) else measured,
                        "samples": sum(1 for x in self.samples[i] if not math.isnan(x)),
                        "disturbed": self.disturbed[i],
                        "pace": self._median_pace(i),
                        "rounds": self.round_medians(i),
                        "baseline": c.is_baseline,
                        "winner": i == self.winner})
        return {"reason": self.reason, "start_step": self.start_step, "lead": self.lead,
                "decided_at": self.decided_at,
                "winner": None if self.winner is None else self.candidates[self.winner].name,
                "confirmed": [self.candidates[i].name for i in self._members(CONFIRM)],
                "remeasured": [self.candidates[i].name for i in self._members(TIEBREAK)],
                "retaken": [self.candidates[i].name for i in self._members(RETAKE)],
                "noise": self.noise, "turn_noise": self.turn_noise(),
                "baseline_margin": self.baseline_margin,
                "baseline_window": self.baseline_window,
                "duel": self.duel_report(),
                "steps": sum(self.steps_run()), "excess_steps": self.excess_steps(),
                "candidates": out}

    def _median_pace(self, index):
        """The median pace the known samples of ``index`` were divided by (None: none)."""
        paces = [p for p, x in zip(self.paces[index], self.samples[index]) if not math.isnan(x)]
        return statistics.median(paces) if paces else None

    def summary(self):
        """One line: ``name predicted/measured ms`` per candidate, the winner marked."""
        return summary_of(self.report())

    # -- persistence --------------------------------------------------------------------
    def state_dict(self):
        return {"candidates": [c.to_dict() for c in self.candidates], "reason": self.reason,
                "settle": self.settle, "measure": self.measure, "confirm": self.confirm,
                "confirm_window": self.confirm_window, "max_confirm": self.max_confirm,
                "near_tie": self.near_tie, "noise_tie": self.noise_tie,
                "tiebreak": self.tiebreak, "tiebreak_turns": self.tiebreak_turns,
                "max_remeasure": self.max_remeasure, "start_step": self.start_step,
                "spell_factor": self.spell_factor, "max_retakes": self.max_retakes,
                "screen_passes": self.screen_passes, "lead": self.lead,
                "duel_pairs": self.duel_pairs, "duel_steps": self.duel_steps,
                "baseline_margin": self.baseline_margin,
                "baseline_window": self.baseline_window,
                "duel": (None if self.duel is None else
                         {"winner": self.duel["winner"], "rival": self.duel["rival"],
                          "ratios": list(self.duel["ratios"])}),
                "retakes_used": self.retakes_used, "disturbed": list(self.disturbed),
                "probes": [list(p) for p in self.probes],
                "local_probe": [list(r) for r in self.local_probe],
                "adjust_pace": self.adjust_pace,
                "forwards": [list(f) for f in self.forwards],
                "paces": [list(p) for p in self.paces],
                "local_forward": [list(r) for r in self.local_forward],
                "rounds": [list(r) for r in self.rounds], "round_kinds": list(self.round_kinds),
                "round_start": self.round_start,
                "samples": [list(s) for s in self.samples], "noise": self.noise,
                "round_samples": [[[int(i), list(v)] for i, v in r.items()]
                                  for r in self.round_samples],
                "local": [list(r) for r in self.local],
                "winner": self.winner, "decided_at": self.decided_at}

    @classmethod
    def from_state_dict(cls, sd):
        # a state saved before the confirm round existed: its second round was the
        # tie-break, measured with the screen's step count
        legacy = "round_kinds" not in sd
        confirm = int(sd.get("confirm", sd["measure"]))
        trial = cls([Candidate.from_dict(c) for c in sd["candidates"]], int(sd["start_step"]),
                    reason=sd.get("reason", "model"), settle=int(sd["settle"]),
                    measure=int(sd["measure"]), near_tie=float(sd["near_tie"]),
                    max_remeasure=int(sd["max_remeasure"]),
                    confirm=confirm,
                    # a state saved before the mirrored tie-break: one turn of the
                    # confirm round's length
                    tiebreak=int(sd.get("tiebreak", confirm)),
                    tiebreak_turns=int(sd.get("tiebreak_turns", 1)),
                    confirm_window=float(sd.get("confirm_window", CONFIRM_WINDOW)),
                    max_confirm=int(sd.get("max_confirm", MAX_CONFIRM)),
                    noise_tie=float(sd.get("noise_tie", NOISE_TIE)),
                    # a state saved before load probes: nothing was disturbed
                    spell_factor=float(sd.get("spell_factor", SPELL_FACTOR)),
                    max_retakes=int(sd.get("max_retakes", MAX_RETAKES)),
                    # a state saved before the two-pass screen ran one pass
                    screen_passes=int(sd.get("screen_passes", 1)), lead=int(sd.get("lead", 0)),
                    # a state saved before the pace: its trial goes on without it
                    adjust_pace=bool(sd.get("adjust_pace", False)),
                    # a state saved before the duel: its trial ends without one
                    duel_pairs=int(sd.get("duel_pairs", 0)),
                    duel_steps=int(sd.get("duel_steps", DUEL_STEPS)),
                    # a state saved before the baseline's margin: its trial goes on without
                    baseline_margin=float(sd.get("baseline_margin", 0.0)),
                    baseline_window=float(sd.get("baseline_window", 0.0)))
        duel = sd.get("duel")
        trial.duel = (None if duel is None else
                      {"winner": int(duel["winner"]), "rival": int(duel["rival"]),
                       "ratios": [float(x) for x in duel["ratios"]]})
        trial.rounds = [[int(i) for i in r] for r in sd["rounds"]]
        trial.round_kinds = ([SCREEN] + [TIEBREAK] * (len(trial.rounds) - 1) if legacy
                             else [str(k) for k in sd["round_kinds"]])
        trial.round_start = int(sd["round_start"])
        trial.winner = None if sd.get("winner") is None else int(sd["winner"])
        trial.decided_at = None if sd.get("decided_at") is None else int(sd["decided_at"])
        trial.samples = [[float(x) for x in s] for s in sd["samples"]]
        if legacy:  # rebuild the finished rounds' samples from the flat lists
            finished = len(trial.rounds) - 1 if trial.winner is None else len(trial.rounds)
            used = [0] * len(trial.candidates)
            trial.round_samples = []
            for members in trial.rounds[:finished]:
                this_round = {}
                for i in members:
                    this_round[i] = trial.samples[i][used[i]:used[i] + trial.measure]
                    used[i] += trial.measure
                trial.round_samples.append(this_round)
        else:
            trial.round_samples = [{int(i): [float(x) for x in v] for i, v in r}
                                   for r in sd["round_samples"]]
        trial.noise = None if sd.get("noise") is None else float(sd["noise"])
        trial.local = [[float(x) for x in r] for r in sd["local"]]
        trial.retakes_used = int(sd.get("retakes_used", 0))
        trial.disturbed = [int(x) for x in sd.get("disturbed", [0] * len(trial.candidates))]
        trial.probes = [[float(x) for x in p] for p in sd.get("probes", [])]
        trial.local_probe = ([[float(x) for x in r] for r in sd["local_probe"]]
                             if "local_probe" in sd else [[math.nan] * len(r) for r in trial.local])
        trial.forwards = [[float(x) for x in f] for f in sd.get("forwards", [])]
        trial.paces = [[float(x) for x in p]
                       for p in sd.get("paces", [[] for _ in trial.candidates])]
        trial.local_forward = ([[float(x) for x in r] for r in sd["local_forward"]]
                               if "local_forward" in sd
                               else [[math.nan] * len(r) for r in trial.local])
        return trial


def regret_rival(report, settled_s, near_tie: float = NEAR_TIE,
                 noise_tie: float = NOISE_TIE) -> Optional[dict]:
    """The candidate of a finished trial ``report`` (:meth:`Trial.report`) that its winner,
    measured at ``settled_s`` per step once settled, now looks slower than: the fastest
    other candidate whose trial time times ``1 + margin`` is below ``settled_s``, where
    ``margin = max(near_tie, noise_tie * noise)`` is the trial's own tie margin. None
    when there is none, or nothing to compare (no winner, no measurement).

    The trial's times are read at the trial's pace, and they sat 4-9% above the same
    plan's steady steps on the shaped cluster (``NEAR_TIE``), so a winner that runs
    above another candidate's trial time by more than the margin lost to it by more
    than the trial could resolve: the two are measured again, side by side. The loser
    of the trial's duel is no rival: the two ran side by side already, for longer. A
    rival's time counts with its weight against the winner's, as in the trial's own
    decisions (``baseline_margin``): a baseline winner is not retried against a plan
    that the margin would keep out again."""
    if not settled_s or not settled_s > 0 or report is None:
        return None
    candidates = report.get("candidates") or []
    if not any(c.get("winner") for c in candidates):
        return None
    margin = tie_margin(report.get("noise"), near_tie, noise_tie)
    duel = report.get("duel") or {}
    dueled = {duel.get("winner"), duel.get("rival")} if duel.get("pairs") else set()
    # (a report saved before the margin: every weight 1)
    handicap = float(report.get("baseline_margin") or 0.0)

    def weight(c):
        return baseline_weight(c.get("baseline", False), handicap)

    winner = next(c for c in candidates if c.get("winner"))
    rivals = [c for c in candidates if not c.get("winner") and c.get("measured_s")
              and c["name"] not in dueled
              and c["measured_s"] * weight(c) / weight(winner) * (1.0 + margin) < settled_s]
    return min(rivals, key=lambda c: c["measured_s"] * weight(c)) if rivals else None


def summary_of(report):
    """:meth:`Trial.summary` of a :meth:`Trial.report` (e.g. one restored from a state dict)."""
    parts = []
    for entry in report["candidates"]:
        measured = "-" if entry["measured_s"] is None else f"{entry['measured_s'] * 1e3:.1f}"
        mark = "*" if entry["winner"] else ""
        # (samples a load spell disturbed, left out: "~N")
        spelled = f" ~{entry['disturbed']}" if entry.get("disturbed") else ""
        parts.append(f"{mark}{entry['name']} {entry['predicted_s'] * 1e3:.1f}/{measured}{spelled}")
    line = "trial (predicted/measured ms): " + ", ".join(parts)
    if report.get("retaken"):
        line += f"; retaken after a load spell: {', '.join(report['retaken'])}"
    duel = report.get("duel")
    if duel and duel.get("median_ratio") is not None:
        kept = duel["rival"] if duel["switched"] else duel["winner"]
        # (against the baseline the rival had to read below 1 / (1 + margin), or above)
        to_beat = duel.get("to_beat", 1.0)
        bar = "" if to_beat == 1.0 else f", to beat {to_beat:.3f}"
        line += (f"; side by side, {duel['rival']} over {duel['winner']}: "
                 f"{duel['median_ratio']:.3f} (median of {duel['pairs']} pairs{bar}), {kept} kept")
    return line


# --------------------------------------------------------------------------- correction
@dataclasses.dataclass(frozen=True)
class Correction:
    """What a step costs beyond the model, fitted from a trial's measured candidates.

    ``measured - predicted ~= constant_s + dense_s_per_element * E_dense
    + sparse_group_s * G_sparse`` per step, where ``E_dense`` is the number of gradient
    elements a plan sends dense and ``G_sparse`` its number of sparse groups. On CPU the
    dense term is the all-reduce's contention with backward (gloo reduces on the same
    cores), which the model counts as free overlap; the group term is what each sparse
    group costs beyond the profile's top-k and the measured overhead; the constant is
    the level the model misses. The hook adds two of them to the instance it plans
    with: the dense cost's ``beta += dense_s_per_element / 4`` (per fp32 byte) and the
    top-k's ``c0 += sparse_group_s`` (each clamped at zero). The constant is reported,
    not added: the tail and the rest of the step are measured afresh, and the trial's
    level moves with the load of its steps.

    ``sparse_groups_ref`` is where the group term is centred: the sparse groups of the
    trial's winner (without a winner among the points: the median number of sparse
    groups of the candidates; 0 without a group term). The constant is the fit's value
    at *no* sparse group, an extrapolation far from every candidate; a plan with the
    reference's groups gets none of the group term, so the term moves plans relative to
    the reference instead of lifting them all. (ResNet-20, 8 ranks, 2026-12-05: 49 ms per
    sparse group with -138 ms of constant, fitted on 1-4 groups; added from zero groups
    it priced the 3-group winner 22% too slow.) ``ref_plan`` is that plan,
    ``(groups, dense, exchange)`` over the trial's units: the winner - the plan the hook
    runs next and the best-measured point of the fit, so its own prediction is the
    model's from its own steps and the fitted slope only prices the other plans
    against it - or, without one, the candidate whose sparse group count is nearest
    the reference (the first such in the trial's order). Centred on the trial's median
    plan instead, a slope fitted through the extremes moved the winner's own
    prediction: ResNet-20, N = 8, d = 0.01 (ac11f8f), 43 ms per group fitted through
    `single` and a 3-group plan, centred at 3.5 groups, priced the 2-group winner 14%
    under its measured step. The hook's ``level_s`` takes back what the term adds to
    *that plan's timeline*, not ``sparse_group_s * sparse_groups_ref``: the term goes in
    as top-k work, and where the network is the critical path part of it is hidden, so
    taking back the full product priced every plan too fast (the same ResNet-20 at 8
    ranks: 31 ms per group, 6 groups taken back, the 5-group winner predicted 14% under
    its measured step). The dense term stays anchored at zero: a plan with nothing dense
    has no all-reduce to contend with.
    """

    constant_s: float = 0.0
    dense_s_per_element: float = 0.0
    sparse_group_s: float = 0.0
    points: int = 0
    sparse_groups_ref: float = 0.0
    ref_plan: Optional[tuple] = None

    def extra_s(self, dense_elements, sparse_groups):
        return (self.constant_s + self.dense_s_per_element * dense_elements
                + self.sparse_group_s * sparse_groups)

    def to_dict(self):
        d = dataclasses.asdict(self)
        if self.ref_plan is not None:  # plain lists: JSON and weights_only loads
            groups, dense, exchange = self.ref_plan
            d["ref_plan"] = [[list(g) for g in groups], list(dense), exchange]
        return d

    @classmethod
    def from_dict(cls, d):
        # (saved before the centring: no reference, the group term counted from zero;
        # before the reference plan: the term taken back as sparse_group_s * ref)
        ref_plan = d.get("ref_plan")
        if ref_plan is not None:
            ref_plan = _ref_plan(*ref_plan[:2], check_exchange(ref_plan[2], "ref_plan"))
        return cls(constant_s=float(d["constant_s"]),
                   dense_s_per_element=float(d["dense_s_per_element"]),
                   sparse_group_s=float(d["sparse_group_s"]), points=int(d["points"]),
                   sparse_groups_ref=float(d.get("sparse_groups_ref", 0.0)),
                   ref_plan=ref_plan)


def plan_features(groups, dense, numels):
    """``(elements sent dense, number of sparse groups)`` of a plan over units ``numels``."""
    dense_elements = sum(numels[u] for g, d in zip(groups, dense) if d for u in g)
    return dense_elements, sum(1 for d in dense if not d)


def _solve(rows, targets):
    """Least squares of ``rows @ x = targets`` by normal equations (tiny systems), or None
    when they are singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(rows, targets)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        scale = max(abs(a[i][j]) for i in range(n) for j in range(n)) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def _least_absolute(rows, targets):
    """The ``x`` with the least sum of ``|rows @ x - targets|`` over all points but the
    one furthest *above* it (all points when there are fewer than two more points than
    terms, or none lies above); None when every square subsystem is singular.

    Why trimmed: on a busy CPU one candidate can sit far off any line - LAGS-SGD's
    9 groups on the README job measured 116 ms above the model where the other five were
    within 6-12 ms - and as the plan with the most groups it has the leverage to tilt a
    least-squares (or even a least-absolute) fit: 15 ms per sparse group and -18 ms of
    constant, which priced the 3-group winner 38-60% too slow once the group term was
    applied without the constant. Dropping the worst point leaves the others' line. A
    least-absolute fit passes through as many points as it has terms, so it is sought
    among the exact solutions of each such choice of points (a trial has at most a few
    candidates and three terms: at most a few hundred tiny systems).

    Why only a point above the line: what throws a step off on a busy machine (a load
    spell, a straggler) adds time, never takes it away. A point left out *below* the
    line means the line runs through the wrong points: on the selection test's trial
    (2026-12-04) leaving out the all-dense plan (6 dense groups, 47 ms) fitted the dense
    term to one small dense group 90 ms above the model, and priced the all-dense plan
    at 523 ms."""
    n = len(rows[0])
    trim = len(rows) >= n + 2
    best, best_cost = None, math.inf
    for chosen in itertools.combinations(range(len(rows)), n):
        x = _solve([rows[i] for i in chosen], [targets[i] for i in chosen])
        if x is None:
            continue
        residuals = [t - sum(a * b for a, b in zip(r, x)) for r, t in zip(rows, targets)]
        cost = sum(abs(e) for e in residuals)
        if trim:
            cost -= max(0.0, max(residuals))
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = x, cost
    return best


def fit_correction(candidates, numels) -> Optional[Correction]:
    """Fit a :class:`Correction` to a trial's :meth:`Trial.report` candidates (those with a
    measurement) over units of ``numels`` elements. Terms whose feature does not vary
    between the candidates are left out (they cannot be told from the constant), a
    negative dense term is dropped (contention does not speed anything up), and with
    fewer points than terms the constant alone is fitted. None without a measured point.
    """
    points, measured = [], []
    for c in candidates:
        if c.get("measured_s") is None:
            continue
        dense_elements, sparse_groups = plan_features(c["groups"], c["dense"], numels)
        points.append((dense_elements, sparse_groups, c["measured_s"] - c["predicted_s"]))
        measured.append(c)
    if not points:
        return None
    targets = [p[2] for p in points]
    terms = [t for t in (0, 1) if len({p[t] for p in points}) > 1]
    while True:
        if len(points) < len(terms) + 1:
            terms = []
        rows = [[1.0] + [float(p[t]) for t in terms] for p in points]
        solution = _least_absolute(rows, targets) if terms else [statistics.median(targets)]
        if solution is None:
            terms = terms[:-1]
            continue
        coef = dict(zip(terms, solution[1:]))
        if coef.get(0, 0.0) < 0:
            terms = [t for t in terms if t != 0]
            continue
        ref, ref_plan = _reference(measured, points) if 1 in coef else (0.0, None)
        return Correction(constant_s=solution[0], dense_s_per_element=coef.get(0, 0.0),
                          sparse_group_s=coef.get(1, 0.0), points=len(points),
                          sparse_groups_ref=ref, ref_plan=ref_plan)


def _reference(candidates, points):
    """``(sparse_groups_ref, ref_plan)`` of a fit over ``candidates`` (their ``points``):
    the winner's sparse groups and plan; without a winner among them, the median sparse
    group count and the candidate nearest it (the first in the given order on a tie:
    ``min`` keeps the first)."""
    winners = [cp for cp in zip(candidates, points) if cp[0].get("winner")]
    if winners:
        (c, point), = winners[:1]
        ref = float(point[1])
    else:
        ref = float(statistics.median(p[1] for p in points))
        c, _ = min(zip(candidates, points), key=lambda cp: abs(cp[1][1] - ref))
    return ref, _ref_plan(c["groups"], c["dense"], c.get("exchange"))


def _ref_plan(groups, dense, exchange):
    """A :attr:`Correction.ref_plan`: hashable, of plain ints and bools."""
    return (tuple(tuple(int(u) for u in g) for g in groups),
            tuple(bool(x) for x in dense), exchange)
