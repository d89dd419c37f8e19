"""``omgs-plan``: plan merged-gradient groups for instances given as JSON.

Usage::

    omgs-plan [FILE | -] [--strategy optimal|greedy|layerwise|single|threshold:BYTES]
              [--plot TIMELINE.png]

Reads one instance (a JSON object) or a JSON list of instances from ``FILE`` (standard
input when ``FILE`` is ``-`` or missing) and prints, as JSON, one plan per instance (a
list for a list)::

    {"strategy": "optimal", "groups": [[0, 1], [2]], "predicted_iteration_s": 0.0123,
     "non_overlapped_s": 0.0011}

plus ``"dense": [false, true]`` when the instance has a ``dense`` cost (with its optional
``"min_sparse_numel"``, sparse groups of fewer elements are sent dense, as the hook does
with its default of 1024; an instance without the field has no such floor). A two-level
instance (with ``"hierarchy": {"ranks_per_node": L, "intra": {...}, "inter": {...}}``,
see docs/cost-model.md) is planned for the two-level timeline, and its result also has
``"inter_node_bytes"`` (bytes one rank sends to other nodes per step, by the plan) and
``"lower_bound_s"`` (:func:`omgs_hook.planner.relaxed_lower_bound`: no plan is faster
where the search is exact). ``--plot FILE``
(one instance only) also draws the plan's timeline - backward per unit, selection per
group, the collectives - as a Gantt chart (:mod:`omgs_hook.timeline_plot`, needs
matplotlib). The instance
format is that of :meth:`omgs_hook.cost_model.Instance.from_dict` (see
``docs/cost-model.md``).

Errors (unreadable file, invalid JSON, a missing, mistyped or out-of-range field, an
unknown strategy) print one line on standard error naming the problem - e.g.
``omgs-plan: error: [1].layers[2].numel: must be a positive integer, got -3 (int)``
- and exit with status 2.

The command never imports torch (nor does anything it imports), so it starts in a
fraction of a second; matplotlib is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from omgs_hook.cost_model import Instance, InstanceError, schedule, step_inter_node_bytes
from omgs_hook.planner import (
    STRATEGIES,
    SearchBudgetWarning,
    make_plan,
    parse_strategy,
    relaxed_lower_bound,
)

PROG = "omgs-plan"
EXIT_USAGE = 2
#: standard output closed by its reader: Python's own status for SIGPIPE's case
EXIT_BROKEN_PIPE = 1


class _UsageError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage too: keep it to one line
        raise _UsageError(message)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Plan OMGS-SGD gradient groups for one instance or a list of instances.",
        epilog="Instance format: see docs/cost-model.md. Bad input exits with status 2.",
    )
    parser.add_argument(
        "file",
        nargs="?",
        default="-",
        metavar="FILE",
        help="JSON file with one instance or a list of instances ('-' or omitted: stdin)",
    )
    parser.add_argument(
        "--strategy",
        default="optimal",
        help=f"one of {', '.join(STRATEGIES)} (default: optimal)",
    )
    parser.add_argument(
        "--indent",
        type=int,
        default=0,
        help="indent the JSON output by this many spaces (default: 0, one line)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the plan's timeline to FILE (.png/.svg/.pdf; one instance only)",
    )
    return parser


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise _UsageError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise _UsageError(f"cannot read {path}: not UTF-8 text") from None


def _parse_json(text: str, source: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise _UsageError(
            f"{source}: invalid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except RecursionError:
        raise _UsageError(f"{source}: invalid JSON: nested too deeply") from None
    except ValueError as error:  # an integer of more digits than Python converts (4300)
        raise _UsageError(f"{source}: invalid JSON: {error}") from None


def _plan_one(data, strategy: str, where: str) -> dict:
    """Plan one instance; ``where`` prefixes field names in errors ("" or "[3].")."""
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise _UsageError(
            f"{where.rstrip('.') or 'input'}: an instance must be a JSON object, got {kind}"
        )
    try:
        inst = Instance.from_dict(data)
    except InstanceError as error:
        raise _UsageError(f"{where}{error}") from None
    plan = make_plan(inst, strategy)
    return inst, plan


def run(args: argparse.Namespace) -> object:
    """Plan what ``args`` names; returns the JSON-ready result (raises _UsageError)."""
    try:
        strategy = parse_strategy(args.strategy)
    except ValueError as error:
        raise _UsageError(f"--strategy: {error}") from None
    if args.plot is not None:
        _check_plot_path(args.plot)
    source = "<stdin>" if args.file == "-" else args.file
    data = _parse_json(_read(args.file), source)
    if isinstance(data, list):
        if args.plot is not None:
            raise _UsageError("--plot draws one instance; the input is a list")
        planned = [_plan_one(item, strategy, f"[{i}].") for i, item in enumerate(data)]
    else:
        planned = [_plan_one(data, strategy, "")]
    if args.plot is not None:
        _plot(*planned[0], args.plot)
    results = [_result(inst, plan) for inst, plan in planned]
    return results if isinstance(data, list) else results[0]


def _result(inst, plan) -> dict:
    result = plan.to_dict(include_dense=inst.dense is not None)
    if inst.hierarchy is not None:
        result["inter_node_bytes"] = step_inter_node_bytes(inst, plan.groups, plan.dense)
        result["lower_bound_s"] = relaxed_lower_bound(inst)
    return result


#: what --plot may end in (matplotlib picks the format by it)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _check_plot_path(path):
    """--plot must name a file of a format :data:`PLOT_SUFFIXES` lists: matplotlib
    writes a name without a suffix (a directory's too) to NAME.png instead, and an
    empty name was skipped without a word."""
    if os.path.isdir(path):
        raise _UsageError(f"--plot {path!r}: is a directory; give a file path, e.g. "
                          f"{os.path.join(path, 'timeline.png')}")
    if os.path.splitext(path)[1].lower() not in PLOT_SUFFIXES:
        raise _UsageError(f"--plot {path!r}: must end in {', '.join(PLOT_SUFFIXES[:-1])} or "
                          f"{PLOT_SUFFIXES[-1]}")


def _plot(inst, plan, path):
    try:
        from omgs_hook.timeline_plot import plot_timelines
    except ImportError as error:  # pragma: no cover - matplotlib is in the scripts extra
        raise _UsageError(f"--plot needs matplotlib ({error})") from None
    try:
        plot_timelines([(f"{plan.strategy} plan (predicted)",
                         schedule(inst, plan.groups, plan.dense))], path)
    except ImportError as error:
        raise _UsageError(f"--plot needs matplotlib: pip install matplotlib ({error})") from None
    except (OSError, ValueError) as error:
        raise _UsageError(f"--plot {path}: {error}") from None


def main(argv=None) -> int:
    """Entry point of ``omgs-plan``; returns the exit status."""
    try:
        args = _build_parser().parse_args(argv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SearchBudgetWarning)
            result = run(args)
    except _UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    for warning in caught:
        print(f"{PROG}: warning: {warning.message}", file=sys.stderr)
    try:
        json.dump(result, sys.stdout, indent=args.indent if args.indent > 0 else None)
        sys.stdout.write("\n")
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a printed traceback
    except BrokenPipeError:
        # the reader stopped early (omgs-plan many.json | head): end quietly, as Unix tools do
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    return 0


def _discard_stdout():
    """Point standard output at /dev/null, so that the interpreter's final flush of what
    is still buffered does not hit the closed pipe again (Python's documented recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's stream)
        pass


if __name__ == "__main__":
    sys.exit(main())
