"""The calibration profile: measured cost models the hook plans with.

``omgs-profile`` (``omgs_hook.profile_run``) measures the process group and the top-k
selectors and writes a versioned JSON file; the hook loads it with :func:`load_profile`
(``register(model, profile="profile.json")``) or, without one, plans with
:func:`default_profile`.

File format (``schema_version`` 1; only the keys marked * are read back, the rest is a
record of how the numbers were obtained)::

    {
      "schema_version": 1,                      *
      "created": "2025-01-01T12:00:00+00:00",
      "world_size": 2,                          *  ranks the collectives were timed with
      "backend": "gloo",                        *  torch.distributed backend
      "device": "cpu",                          *  torch device type ("cpu", "cuda")
      "device_name": "...", "torch_version": "2.13.0+cpu", "cupy_version": null,
      "comm":  {"alpha_s": 2.4e-4, "beta_s_per_byte": 1.1e-9},   *  packed all-gather
      "dense": {"alpha_s": 2.6e-4, "beta_s_per_byte": 6.0e-10},  *  all-reduce
      "topk":  {"backend": "sampled", "c0": 1e-5, "c1": 2e-9, "c2": 0.0},  *
      "topk_all": {"torch": {"c0": ..., "c1": ..., "c2": ...}, ...},       *  (optional)
      "ranks_per_node": 4,                                       *  (optional, two-level)
      "intra": {"alpha_s": 2e-5, "beta_s_per_byte": 1e-11},      *  (with ranks_per_node)
      "inter": {"alpha_s": 3e-4, "beta_s_per_byte": 8e-9},       *  (with ranks_per_node)
      "inter_dense": {"alpha_s": 3e-4, "beta_s_per_byte": 9e-9}, *  (optional, with them)
      "settings": {...}, "samples": {...}, "fit_errors": {...}
    }

Two link classes (optional, all three keys or none): ``intra`` is an intra-node
collective among the node's ``ranks_per_node`` ranks (reduce-scatter / all-gather),
``inter`` the packed sparse all-gather among the ``world_size / ranks_per_node`` ranks
with the same local rank, timed with all local ranks exchanging at once; both against
the bytes one rank contributes, as :class:`omgs_hook.cost_model.Hierarchy` expects
(:meth:`Profile.hierarchy`). Files without them load as before. ``inter_dense``
(optional, only next to the three) is the all-reduce of a dense group's float32 shard
among those same ranks, all local ranks at once, against the shard's bytes; without it
the cost model derives it from ``dense`` (``Instance.inter_dense_cost``).

Byte conventions (they must match the planner's ``Instance``): ``comm`` is timed
against the bytes ONE rank contributes to the packed all-gather (``k`` values + ``k``
int32 indices = ``8 * k`` bytes); ``dense`` against the bytes of the all-reduced float32
tensor (``4 * numel``). Both fits hold for the ``world_size`` they were measured with
only - the all-gather's received volume grows with the number of ranks - which is why
:func:`profile_mismatches` reports a different world size.

This module never imports torch (the planner CLI loads profiles too).
"""

import json
import math
import os
from dataclasses import dataclass, field

from omgs_hook.cost_model import Hierarchy, LinearCost, TopkCost

SCHEMA_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used; ``field`` names the offending key (or None)."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


@dataclass
class Profile:
    """Cost models for one (world size, backend, device type) combination.

    comm: packed sparse all-gather, ``t = alpha + beta * bytes per rank``.
    dense: all-reduce, ``t = alpha + beta * tensor bytes``.
    topk: cost of ``topk_backend`` selecting at ``topk_density``.
    topk_backend: the selector the coefficients in ``topk`` belong to (the device's
        default, what ``get_selector("auto", device)`` picks).
    world_size, backend, device_type: what the numbers were measured with.
    path: the file it was loaded from; None for a default profile.
    topk_all: coefficients for every measured selector (includes ``topk_backend``).
    topk_density: density the selectors were timed at (None when unknown).
    source: one line saying where the numbers come from.
    ranks_per_node, intra, inter: the two link classes of a multi-GPU-node profile
        (all None for a flat profile; see the module docstring).
    inter_dense: the measured inter-node all-reduce of a dense group's shard (None when
        the file has none: older two-level profiles, flat profiles).
    """

    comm: LinearCost
    dense: LinearCost
    topk: TopkCost
    topk_backend: str
    world_size: int
    backend: str
    device_type: str
    path: "str | None" = None
    topk_all: dict = field(default_factory=dict)
    topk_density: "float | None" = None
    source: str = ""
    ranks_per_node: "int | None" = None
    intra: "LinearCost | None" = None
    inter: "LinearCost | None" = None
    inter_dense: "LinearCost | None" = None

    def topk_for(self, backend):
        """The top-k cost of ``backend``; falls back to :attr:`topk` when it was not measured."""
        return self.topk_all.get(backend, self.topk)

    def hierarchy(self):
        """The :class:`~omgs_hook.cost_model.Hierarchy` of a two-level profile, else None
        (``cost_model.hierarchical_instance(flat, h.ranks_per_node, h.intra, h.inter,
        h.inter_dense)``); its ``inter_dense`` is None when the file has none."""
        if self.ranks_per_node is None:
            return None
        return Hierarchy(self.ranks_per_node, self.intra, self.inter, self.inter_dense)


# ---------------------------------------------------------------------------------------
# Default profiles (used when the hook gets profile=None)
# ---------------------------------------------------------------------------------------
#
# Defaults describe the network the hook is meant for rather than this development
# machine's loopback: on loopback a dense all-reduce costs about as much as CPU top-k
# (ddp-hook-facts.md), so sparsification never pays there and a loopback-derived default
# would mislead every real deployment. Collective costs follow the ring algorithms gloo
# and NCCL use: an all-gather takes (W-1) steps, each moving one rank's payload; an
# all-reduce takes 2(W-1) steps, each moving 1/W of the tensor.
#
#   CPU / gloo: 1 GbE. Per-step start-up 0.30 ms: gloo's own software latency is
#     0.24-0.34 ms (fitted alpha of the 2-rank loopback all-gather, ddp-hook-facts.md and
#     docs/calibration.md), a LAN round trip adds ~0.05 ms. Bandwidth 117 MB/s: measured
#     single-flow TCP goodput on a 1 Gbit/s link (119 MB/s) less a little protocol overhead.
#   CUDA / NCCL: 10 GbE. Per-step start-up 0.05 ms (NCCL socket transport), 1.17 GB/s.
#
# Top-k defaults:
#   CPU "sampled": median of six 2-rank profiles on the 2-core development machine
#     (docs/calibration.md), density 0.001, one thread per rank, both ranks selecting at
#     once: c0 = 0.13 ms of per-call overhead, 3.2 ns per element.
#   CUDA "cupy": an order-of-magnitude estimate (~0.1 ms of launches, 100 G elements/s);
#     profile a GPU machine to replace it.
_DEFAULT_NETWORKS = {
    # device type: (backend, per-step alpha seconds, bytes per second, description)
    "cpu": ("gloo", 0.30e-3, 117e6, "gloo over 1 GbE"),
    "cuda": ("nccl", 0.05e-3, 1.17e9, "NCCL over 10 GbE"),
}
_DEFAULT_TOPK = {
    "cpu": ("sampled", TopkCost(c0=1.3e-4, c1=3.2e-9, c2=0.0)),
    "cuda": ("cupy", TopkCost(c0=1.0e-4, c1=1.0e-11, c2=0.0)),
}
_DEFAULT_TOPK_DENSITY = 0.001


def default_profile(device_type="cpu", world_size=2):
    """Documented default cost models for ``device_type`` ("cpu" or "cuda") at ``world_size``.

    CPU assumes gloo over 1 GbE, CUDA assumes NCCL over 10 GbE (see the table above this
    function for where each number comes from); the collective costs are scaled to
    ``world_size`` with the ring-algorithm step counts. Measure the real cluster with
    ``omgs-profile`` for anything beyond a first run.
    """
    if device_type not in _DEFAULT_NETWORKS:
        raise ValueError(
            f"device_type: must be one of {sorted(_DEFAULT_NETWORKS)}, got {device_type!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
    backend, step_alpha, bytes_per_s, network = _DEFAULT_NETWORKS[device_type]
    topk_backend, topk = _DEFAULT_TOPK[device_type]
    steps = world_size - 1
    comm = LinearCost(alpha_s=steps * step_alpha, beta_s_per_byte=steps / bytes_per_s)
    dense = LinearCost(
        alpha_s=2 * steps * step_alpha,
        beta_s_per_byte=2 * steps / world_size / bytes_per_s,
    )
    return Profile(
        comm=comm,
        dense=dense,
        topk=topk,
        topk_backend=topk_backend,
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        path=None,
        topk_all={topk_backend: topk},
        topk_density=_DEFAULT_TOPK_DENSITY,
        source=f"default profile: {network}, {world_size} ranks",
    )


# ---------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------


def _fail(path, key, problem):
    raise ProfileError(f"{path}: {key}: {problem}", field=key)


def _number(path, key, value):
    if value is None:
        _fail(path, key, "missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, key, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer beyond any float (10**400 written out)
        number = math.inf
    if not math.isfinite(number) or number < 0:
        _fail(path, key, f"must be a non-negative finite number, got {_shown(value)}")
    return number


def _shown(value):
    """``repr(value)``, but a huge integer by its size (no line of hundreds of digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _section(path, data, key):
    section = data.get(key)
    if section is None:
        _fail(path, key, "missing")
    if not isinstance(section, dict):
        _fail(path, key, f"must be an object, got {type(section).__name__}")
    return section


#: a profile's costs must price a message (bytes) or a top-k (elements) of this size
#: finitely: finite coefficients so large that the planner's sums overflow to inf (1e308
#: s/byte) would plan from inf and NaN
PRICED_UP_TO = 2.0**40


def _finite_up_to_limit(path, key, cost):
    price = cost.time(PRICED_UP_TO)  # (Python floats: an overflow is inf, not an error)
    if not math.isfinite(price):
        _fail(path, key, f"prices {PRICED_UP_TO:.3g} bytes or elements at {price!r}: "
                         "the coefficients are far beyond any physical range (seconds, "
                         "bytes)")
    return cost


def _linear(path, data, key):
    section = _section(path, data, key)
    values = {}
    for name in ("alpha_s", "beta_s_per_byte"):
        values[name] = _number(path, f"{key}.{name}", section.get(name))
    return _finite_up_to_limit(path, key, LinearCost(**values))


def _topk_cost(path, section, prefix):
    values = {}
    for name in ("c0", "c1", "c2"):
        values[name] = _number(path, f"{prefix}.{name}", section.get(name))
    return _finite_up_to_limit(path, prefix, TopkCost(**values))


def _text(path, key, value):
    if value is None:
        _fail(path, key, "missing")
    if not isinstance(value, str) or not value:
        _fail(path, key, f"must be a non-empty string, got {value!r}")
    return value


def profile_from_dict(data, path="<profile>"):
    """Validate a decoded profile document and build a :class:`Profile`.

    Raises :class:`ProfileError` naming the first bad key; ``path`` only labels messages.
    """
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: must contain a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version is None:
        _fail(path, "schema_version", "missing (not an omgs-profile file?)")
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        _fail(path, "schema_version",
              f"unsupported version {version!r}, this omgs-hook reads {SCHEMA_VERSION}")
    world_size = data.get("world_size")
    if world_size is None:
        _fail(path, "world_size", "missing")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        _fail(path, "world_size", f"must be a positive integer, got {world_size!r}")
    backend = _text(path, "backend", data.get("backend"))
    device_type = _text(path, "device", data.get("device"))
    comm = _linear(path, data, "comm")
    dense = _linear(path, data, "dense")
    topk_section = _section(path, data, "topk")
    topk_backend = _text(path, "topk.backend", topk_section.get("backend"))
    topk = _topk_cost(path, topk_section, "topk")

    topk_all = {}
    if data.get("topk_all") is not None:
        all_section = _section(path, data, "topk_all")
        for name, coefficients in all_section.items():
            if not isinstance(coefficients, dict):
                _fail(path, f"topk_all.{name}",
                      f"must be an object, got {type(coefficients).__name__}")
            topk_all[name] = _topk_cost(path, coefficients, f"topk_all.{name}")
    topk_all.setdefault(topk_backend, topk)

    density = None
    settings = data.get("settings")
    if isinstance(settings, dict) and settings.get("topk_density") is not None:
        density = settings["topk_density"]
        if (isinstance(density, bool) or not isinstance(density, (int, float))
                or not 0 < density <= 1):
            _fail(path, "settings.topk_density",
                  f"must be a number in (0, 1], got {_shown(density)}")
        density = float(density)

    ranks_per_node, intra, inter, inter_dense = _link_classes(path, data, world_size)

    return Profile(
        comm=comm,
        dense=dense,
        topk=topk,
        topk_backend=topk_backend,
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        ranks_per_node=ranks_per_node,
        intra=intra,
        inter=inter,
        inter_dense=inter_dense,
        path=None if path == "<profile>" else str(path),
        topk_all=topk_all,
        topk_density=density,
        source=f"measured profile {path} (created {data.get('created', 'unknown')})",
    )


_LINK_KEYS = ("ranks_per_node", "intra", "inter")


def _link_classes(path, data, world_size):
    """(ranks_per_node, intra, inter, inter_dense) of a two-level profile (inter_dense
    None when absent), or four Nones."""
    present = [key for key in _LINK_KEYS if data.get(key) is not None]
    if not present:
        if data.get("inter_dense") is not None:
            _fail(path, "inter_dense", f"needs the two link classes "
                                       f"({', '.join(_LINK_KEYS)}), which are missing")
        return None, None, None, None
    for key in _LINK_KEYS:
        if data.get(key) is None:
            _fail(path, key, f"missing (a two-level profile needs all of "
                             f"{', '.join(_LINK_KEYS)}; found {', '.join(present)})")
    ranks = data["ranks_per_node"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        _fail(path, "ranks_per_node", f"must be an integer >= 2, got {ranks!r}")
    if world_size % ranks:
        _fail(path, "ranks_per_node",
              f"world_size {world_size} is not divisible by ranks_per_node {ranks}")
    intra, inter = _linear(path, data, "intra"), _linear(path, data, "inter")
    inter_dense = None
    if data.get("inter_dense") is not None:
        inter_dense = _linear(path, data, "inter_dense")
    return ranks, intra, inter, inter_dense


def load_profile(path):
    """Read and validate a profile file written by ``omgs-profile``.

    Raises :class:`ProfileError` for a missing or unreadable file, a file that is not
    JSON, a ``schema_version`` other than :data:`SCHEMA_VERSION`, and for missing,
    mistyped or negative fields - the message names the file and the field.
    """
    # (a bytes path, which OMGSState(profile=...) accepts, as str() is "b'...'")
    path = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ProfileError(
            f"{path}: profile file not found (create one with omgs-profile)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"{path}: cannot read profile file: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"{path}: not valid JSON: {error}") from None
    except ValueError as error:  # an integer of more digits than Python converts (4300)
        raise ProfileError(f"{path}: not a usable profile: {error}") from None
    except RecursionError:
        raise ProfileError(f"{path}: not valid JSON: nested too deeply") from None
    return profile_from_dict(data, path)


# the collectives a profile prices per byte: field -> what it carries
PER_BYTE_FIELDS = {
    "comm": "packed all-gather (sparse groups)",
    "dense": "all-reduce (dense groups)",
    "intra": "intra-node collectives",
    "inter": "inter-node sparse all-gather",
    "inter_dense": "inter-node all-reduce",
}


def unmeasured_bandwidth(betas, where):
    """One line per collective whose fitted per-byte cost is 0 (empty when none is).

    ``betas`` maps a field of :data:`PER_BYTE_FIELDS` to its ``beta_s_per_byte``. No
    network moves bytes for free: a zero means the sweep's largest messages cost no more
    than the latency (on a fast link, sizes of a few tens of kB), so every larger
    message - a dense group, a large sparse one - is priced at latency only, and a plan
    may send far more than the link can carry.
    """
    lines = []
    for field, beta in betas.items():
        if beta is not None and beta <= 0.0:
            lines.append(
                f"{where}: the {PER_BYTE_FIELDS.get(field, field)} cost per byte "
                f"('{field}') was fitted as 0 - its sweep never left the latency-bound "
                f"sizes, so larger messages are priced at latency only; profile again with "
                f"larger messages (omgs-profile's default sweep, or --sizes up to the "
                f"gradient's bytes)")
    return lines


def profile_bandwidth_gaps(profile):
    """:func:`unmeasured_bandwidth` of a loaded :class:`Profile`."""
    betas = {}
    for field in PER_BYTE_FIELDS:
        cost = getattr(profile, field, None)
        if cost is not None:
            betas[field] = cost.beta_s_per_byte
    return unmeasured_bandwidth(betas, profile.path or "default profile")


#: a profile's top-k density may differ from the training density by this factor before
#: profile_mismatches says so: sampled top-k at D=4e6 took 6.6 ms at 0.001, 47.7 ms at 0.01
DENSITY_TOLERANCE = 2.0


def profile_mismatches(profile, world_size, backend, device_type, *, density=None):
    """Differences between what ``profile`` was measured with and the current run.

    Returns one human-readable line per difference (empty when everything matches); the
    hook turns them into warnings, since the costs, and hence the plan, may be off.
    ``density``: the run's top-k density; compared with the profile's ``topk_density``
    (more than :data:`DENSITY_TOLERANCE` times apart is a difference) unless either is
    unknown (None) or the run is dense (density 1 selects nothing).
    """
    where = profile.path or "default profile"
    problems = []
    if profile.world_size != world_size:
        problems.append(
            f"{where} was measured with world_size={profile.world_size}, this run has "
            f"world_size={world_size} (collective costs grow with the number of ranks)"
        )
    if str(profile.backend).lower() != str(backend).lower():
        problems.append(
            f"{where} was measured with backend {profile.backend!r}, this run uses {backend!r}"
        )
    if str(profile.device_type).lower() != str(device_type).lower():
        problems.append(
            f"{where} was measured on device type {profile.device_type!r}, this run uses "
            f"{device_type!r} (top-k and copy costs differ)"
        )
    measured = profile.topk_density
    if measured is not None and density is not None and 0 < density < 1:
        if max(measured / density, density / measured) > DENSITY_TOLERANCE:
            problems.append(
                f"{where} timed top-k at density {measured:g}, this run trains at density "
                f"{density:g} (top-k costs grow with k); run omgs-profile --density {density:g}"
            )
    return problems
