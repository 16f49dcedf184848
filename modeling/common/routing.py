"""Routing models: how many token-slots each routed expert receives.

Meta tensors have no values, so a router's top-k cannot say where tokens go. A routing model
turns (tokens, top-k, experts, layer) into per-expert counts that sum to tokens * top_k (every
token goes to top_k distinct experts, so no expert can receive more than ``tokens``). The
router's logits, scores and top-k tensors are still computed, with their true shapes, for their
memory.

Specs (``parse_routing``):
- ``balanced``: total = T * k split as evenly as integers allow: every expert gets
  floor(total / E), the first total mod E experts one more.
- ``zipf:ALPHA``: expert of rank r (1-based, in an order shuffled per layer by the seed) gets a
  share proportional to r^-ALPHA.
- ``hot:K:FRACTION``: K experts (chosen per layer by the seed) share FRACTION of the
  assignments equally; the others share the rest equally.
- ``counts:FILE``: a JSON list of per-expert counts (all integers; must sum to T * k) or
  fractions (any non-integer; must sum to 1), applied to every MoE layer; or an object mapping
  layer number (as a string) to such a list.

Shares become integer counts by largest-remainder apportionment (Hamilton's method), then any
count above T is capped at T and the excess handed to the experts with most room, in order.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from modeling.common.config import parse_json
from tracemem.errors import TracememError

__all__ = ["RoutingModel", "Balanced", "Zipf", "Hot", "Counts", "Observed", "parse_routing",
           "apportion"]

ROUTING_HELP = "balanced, zipf:ALPHA, hot:K:FRACTION or counts:FILE"


def apportion(shares: Sequence[float], total: int, cap: int) -> list[int]:
    """Integer counts proportional to ``shares`` that sum to ``total``, none above ``cap``.

    Largest-remainder apportionment; ties go to the lower index. Slots above ``cap`` are
    handed out again in rounds: each round gives one slot to every expert below ``cap``, in
    order of share (largest first, then lower index), until none is left. The rounds are
    counted in closed form (the number R of full rounds is the largest with
    sum(min(room, R)) <= excess, then one partial round), so the work does not grow with
    ``total``.

    Raises:
        TracememError: all shares zero, or ``cap * len(shares) < total``.
    """
    weight = sum(shares)
    if not weight > 0 or cap * len(shares) < total:
        raise TracememError(f"no apportionment of {total} token-slots over {len(shares)} "
                            f"experts of at most {cap} each with shares summing to {weight}")
    exact = [total * s / weight for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    excess = sum(max(0, c - cap) for c in counts)
    counts = [min(c, cap) for c in counts]
    if excess:
        room = [cap - c for c in counts]
        low, high = 0, max(room)  # full rounds R: sum(min(room, R)) <= excess
        while low < high:
            mid = (low + high + 1) // 2
            if sum(min(r, mid) for r in room) <= excess:
                low = mid
            else:
                high = mid - 1
        counts = [c + min(r, low) for c, r in zip(counts, room)]
        excess -= sum(min(r, low) for r in room)
        for i in sorted(range(len(shares)), key=lambda i: (-shares[i], i)):
            if excess and room[i] > low:  # the partial round
                counts[i] += 1
                excess -= 1
    return counts


class RoutingModel:
    """Per-expert token-slot counts for one MoE layer."""

    spec: str

    def counts(self, num_tokens: int, top_k: int, num_experts: int, layer: int,
               expert_ids: Tensor | None = None) -> list[int]:
        """Counts for ``num_experts`` experts of layer ``layer``, summing to num_tokens * top_k,
        each at most ``num_tokens``. ``expert_ids`` ``(tokens, top_k)`` is the router's choice;
        only ``Observed`` reads it."""
        raise NotImplementedError


@dataclass(frozen=True)
class Balanced(RoutingModel):
    spec: str = "balanced"

    def counts(self, num_tokens, top_k, num_experts, layer, expert_ids=None):
        total = num_tokens * top_k
        base, extra = divmod(total, num_experts)
        return [base + (1 if e < extra else 0) for e in range(num_experts)]


@dataclass(frozen=True)
class Zipf(RoutingModel):
    alpha: float
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"zipf:{self.alpha}"

    def counts(self, num_tokens, top_k, num_experts, layer, expert_ids=None):
        rank = list(range(num_experts))
        random.Random(f"{self.seed}:{layer}").shuffle(rank)  # rank[e] = 0-based rank of e
        shares = [(rank[e] + 1) ** -self.alpha for e in range(num_experts)]
        return apportion(shares, num_tokens * top_k, num_tokens)


@dataclass(frozen=True)
class Hot(RoutingModel):
    num_hot: int
    fraction: float
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"hot:{self.num_hot}:{self.fraction}"

    def counts(self, num_tokens, top_k, num_experts, layer, expert_ids=None):
        if self.num_hot > num_experts:
            raise TracememError(f"--routing {self.spec}: K={self.num_hot} hot experts exceeds "
                                f"the {num_experts} routed experts")
        cold = num_experts - self.num_hot
        if not cold and self.fraction < 1:
            raise TracememError(f"--routing {self.spec}: K={self.num_hot} makes all "
                                f"{num_experts} routed experts hot, so they take every slot; "
                                f"FRACTION must be 1 (or use balanced)")
        hot = set(random.Random(f"{self.seed}:{layer}").sample(range(num_experts), self.num_hot))
        shares = [self.fraction / self.num_hot if e in hot else
                  (1 - self.fraction) / cold if cold else 0.0 for e in range(num_experts)]
        return apportion(shares, num_tokens * top_k, num_tokens)


@dataclass(frozen=True)
class Counts(RoutingModel):
    """Given counts (or fractions): one list for every layer, or one per layer number."""

    per_layer: dict[int, tuple[float, ...]] | None = None
    default: tuple[float, ...] | None = None
    source: str = "counts"

    @property
    def spec(self) -> str:
        return f"counts:{self.source}"

    def counts(self, num_tokens, top_k, num_experts, layer, expert_ids=None):
        values = (self.per_layer or {}).get(layer, self.default)
        if values is None:
            raise TracememError(f"--routing {self.spec}: no counts for MoE layer {layer}")
        if len(values) != num_experts:
            raise TracememError(f"--routing {self.spec}: layer {layer} has {len(values)} "
                                f"counts; the model has {num_experts} routed experts")
        total = num_tokens * top_k
        if all(isinstance(v, int) for v in values):  # counts; any float makes them fractions
            if sum(values) != total:
                raise TracememError(
                    f"--routing {self.spec}: layer {layer} counts sum to {int(sum(values))}; "
                    f"tokens * top_k = {num_tokens} * {top_k} = {total}")
            if max(values) > num_tokens:
                raise TracememError(
                    f"--routing {self.spec}: layer {layer} gives an expert {int(max(values))} "
                    f"token-slots, more than the {num_tokens} tokens")
            return [int(v) for v in values]
        if abs(sum(values) - 1) > 1e-6:
            raise TracememError(f"--routing {self.spec}: layer {layer} fractions sum to "
                                f"{sum(values):.6g}, not 1 (integers are read as counts)")
        return apportion(list(values), total, num_tokens)


class Observed(RoutingModel):
    """The router's real choice, for runs on real tensors: counts are the histogram of
    ``expert_ids`` (a ``bincount`` and a ``.tolist()``, which cannot run on meta). The counts
    of every layer are kept in ``recorded``, so ``as_counts()`` replays them on meta."""

    spec = "observed"

    def __init__(self) -> None:
        self.recorded: dict[int, list[int]] = {}

    def counts(self, num_tokens, top_k, num_experts, layer, expert_ids=None):
        if expert_ids is None or expert_ids.device.type == "meta":
            raise TracememError("routing 'observed' needs the router's real output; on the "
                                f"meta device use {ROUTING_HELP}")
        counts = torch.bincount(expert_ids.flatten(), minlength=num_experts).tolist()
        self.recorded[layer] = counts
        return counts

    def as_counts(self) -> Counts:
        """The recorded counts as a ``Counts`` model (one list per layer)."""
        return Counts(per_layer={layer: tuple(c) for layer, c in self.recorded.items()},
                      source="observed")


MAX_COUNTS_FILE_BYTES = 64 * 2**20  # a counts file for 1,000 layers of 1,000 experts is ~10 MB
MAX_COUNT = 2**63  # the largest count (token-slots of one expert) a counts file may hold


def _load_counts(path: str) -> Counts:
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_COUNTS_FILE_BYTES + 1)
    except OSError as error:
        raise TracememError(f"--routing counts:{path}: cannot read: {error}") from None
    if len(raw) > MAX_COUNTS_FILE_BYTES:
        raise TracememError(f"--routing counts:{path}: larger than "
                            f"{MAX_COUNTS_FILE_BYTES // 2**20} MiB; a counts file is a small "
                            f"JSON list or object of per-expert counts")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TracememError(f"--routing counts:{path}: not UTF-8 JSON text ({error})") from None
    data = parse_json(text, f"--routing counts:{path}")

    def as_list(values, where: str) -> tuple[float, ...]:
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                for v in values):
            raise TracememError(f"--routing counts:{path}: {where} must be a non-empty list "
                                f"of non-negative numbers")
        # a count above 2^63 is no layer's (tokens per microbatch are at most 2^32, tracemem.
        # job.MAX_TOKENS), and a float of such an integer overflows (math.isfinite, sum)
        if any(isinstance(v, int) and v > MAX_COUNT for v in values):
            raise TracememError(f"--routing counts:{path}: {where} holds a count above 2^63; "
                                f"counts are token-slots per expert")
        if not all(math.isfinite(v) for v in values) or not math.isfinite(sum(values)):
            raise TracememError(f"--routing counts:{path}: {where} must be a non-empty list "
                                f"of non-negative numbers")
        return tuple(values)

    if isinstance(data, dict):
        per_layer = {}
        for key, values in data.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                shown = json.dumps(key if len(key) <= 40 else key[:37] + "...")
                raise TracememError(f"--routing counts:{path}: key {shown} is not a layer "
                                    f"number (0, 1, 2, ...)")
            per_layer[int(key)] = as_list(values, f"layer {key}")
        return Counts(per_layer=per_layer, source=path)
    return Counts(default=as_list(data, "the file"), source=path)


def parse_routing(spec: str, seed: int = 0) -> RoutingModel:
    """The routing model named by ``spec`` (see the module docstring).

    Raises:
        TracememError: unknown model or bad parameters; the message lists the valid forms.
    """
    if not isinstance(spec, str):
        raise TracememError(f"--routing {spec!r} is invalid; give a string: {ROUTING_HELP}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TracememError(f"--seed {seed!r} must be an integer")
    kind, _, rest = spec.partition(":")
    try:
        if kind == "balanced" and not rest:
            return Balanced()
        if kind == "zipf":
            alpha = float(rest)
            if not 0 <= alpha < math.inf:
                raise ValueError
            return Zipf(alpha, seed)
        if kind == "hot":
            k, fraction = rest.split(":")
            num_hot, fraction = int(k), float(fraction)
            if num_hot <= 0 or not 0 <= fraction <= 1:
                raise ValueError
            return Hot(num_hot, fraction, seed)
        if kind == "counts" and rest:
            return _load_counts(rest)
    except TracememError:
        raise
    except ValueError:  # float("x"), int("x"), a missing ":" part, a value out of range
        pass
    raise TracememError(f"--routing {spec!r} is invalid; use {ROUTING_HELP} (ALPHA >= 0, "
                        f"K a positive integer, 0 <= FRACTION <= 1)")
