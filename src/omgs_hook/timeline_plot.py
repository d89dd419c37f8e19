"""Gantt charts of an iteration's timeline: the planned one, and one measured in training.

Three lanes per timeline, as in the cost model (docs/cost-model.md): **compute** (the
forward pass, then each unit's backward, alternating shades), **selection** (each
sparse group's top-k and the hook's own work on the compute stream) and **network**
(each group's collective, dense ones hatched). Groups share a colour across lanes, so
one can follow a group from its last unit's backward through its top-k to its
collective. Only plain numbers go in (:class:`~omgs_hook.cost_model.Schedule`);
matplotlib is imported when a plot is drawn, never at import time, so ``omgs-plan``
stays torch- and matplotlib-free unless ``--plot`` is asked for.
"""

from __future__ import annotations

from omgs_hook.cost_model import Schedule

LANES = ("compute", "selection", "network")


def _bars(schedule: Schedule):
    """(lane, start, width, group or None, dense) for every interval of ``schedule``."""
    bars = [("compute", schedule.forward[0], schedule.forward[1] - schedule.forward[0], None, False)]
    unit_group = {}
    for g, units in enumerate(schedule.groups):
        for u in units:
            unit_group.setdefault(u, g)
    for u, (start, end) in enumerate(schedule.backward):
        bars.append(("compute", start, end - start, unit_group[u], False))
    for g, (start, end) in enumerate(schedule.selection):
        if end > start:
            bars.append(("selection", start, end - start, g, False))
    for g, (start, end) in enumerate(schedule.network):
        if end > start:
            bars.append(("network", start, end - start, g, schedule.dense[g]))
    return bars


def plot_timelines(panels, path, title=None):
    """Draw one Gantt panel per ``(label, Schedule)`` in ``panels``, one above the other,
    on a shared time axis, and save the figure to ``path`` (PNG, SVG or PDF by suffix)."""
    if not panels:
        raise ValueError("plot_timelines: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.6 + 1.3 * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (label, schedule) in zip(axes[:, 0], panels):
        for lane, start, width, group, dense in _bars(schedule):
            y = len(LANES) - 1 - LANES.index(lane)
            colour = "0.75" if group is None else colours[group % len(colours)]
            ax.barh(y, width * 1e3, left=start * 1e3, height=0.7, color=colour,
                    edgecolor="black", linewidth=0.4, hatch="//" if dense else None)
        ax.set_yticks(range(len(LANES)))
        ax.set_yticklabels(list(reversed(LANES)))
        end = schedule.tail[1]
        ax.axvline(end * 1e3, color="black", linestyle=":", linewidth=1)
        ax.set_title(f"{label}: {end * 1e3:.1f} ms, {len(schedule.groups)} groups "
                     f"({sum(schedule.dense)} dense)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the start of forward (hatched: dense group)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measured_schedule(forward_start, forward_end, arrivals, layout, records, tail_end=None):
    """A :class:`~omgs_hook.cost_model.Schedule` of one measured step, from host marks.

    Args:
        forward_start, forward_end: ``perf_counter`` seconds of the forward pass (the end
            may be None: then backward starts at ``forward_start``).
        arrivals: per bucket, when the hook received it (``StepExchange.arrival_wall``).
        layout: per bucket, its parameter keys (``StepExchange.layout``).
        records: the step's ``GroupRecord``s in send order (``started``/``issued``/``done``).
        tail_end: when the next forward started (None: the last write-back).

    Units are the step's buckets: bucket i's backward runs from the previous arrival (the
    end of forward for bucket 0) to its own arrival, so it includes the hook's work on the
    autograd thread, which the selection lane shows on top. On CUDA these are host
    (launch) times.
    """
    origin = forward_start
    begin = forward_end if forward_end is not None else forward_start
    backward, previous = [], begin
    for arrival in arrivals:
        backward.append((previous - origin, arrival - origin))
        previous = arrival
    owner = {key: index for index, bucket in enumerate(layout) for key in bucket}
    groups, selection, network, dense = [], [], [], []
    for record in records:
        units = sorted({owner[key] for key in record.keys if key in owner})
        groups.append(tuple(units))
        started = record.started if record.started is not None else record.issued
        selection.append((started - origin, record.issued - origin))
        network.append((record.issued - origin, record.done - origin))
        dense.append(bool(record.dense))
    # every bucket needs a group for its colour: buckets no record names get none
    covered = {u for units in groups for u in units}
    for u in range(len(arrivals)):
        if u not in covered:
            groups.append((u,))
            selection.append((0.0, 0.0))
            network.append((0.0, 0.0))
            dense.append(False)
    last = max([end for _, end in network] + [backward[-1][1] if backward else 0.0])
    tail = tail_end - origin if tail_end is not None else last
    return Schedule(forward=(0.0, begin - origin), backward=tuple(backward),
                    selection=tuple(selection), network=tuple(network), groups=tuple(groups),
                    dense=tuple(dense), tail=(last, max(last, tail)))
