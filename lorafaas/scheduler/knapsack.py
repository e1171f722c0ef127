"""The pre-load knapsack's greedy solver (the model is stated in `preload.py`).

A candidate is one artifact of one function together with its missing prerequisites (its closure), e.g. "adapter on a
device" = libraries (if missing) + binding the backbone (placing beta(f) on a device if no device with room holds it)
+ the adapter. Density = marginal value / weight, where the weight counts
    device bytes / mean idle device capacity (a backbone already on the device costs nothing to bind to),
    taking an open worker slot: max(host bytes / mean idle slot capacity, 1) -- the slot is the function's alone
        afterwards, so it costs at least one whole slot; taking a slot bound to the function costs nothing,
    host bytes in the function's own slot: nothing (no other function could use them),
so within one tier the order is the paper's value / bytes. Candidates wait in a max-heap by density, are
re-evaluated lazily when popped (a lower density puts one back in line) and pushed again when their function's
state or their backbone's placement changes; the best is applied while it fits.

Placement choices: a function's slot is the one it is in now, else the tightest fitting slot bound to it, else the
tightest fitting open slot; its device is where it is bound now, else a device holding its backbone with the most
room, else (placing a copy) the device it is on now, else the device with the most room. Staying where things are
makes re-planning an unchanged view produce no actions.
"""

from __future__ import annotations

import bisect
import heapq
import math

from lorafaas.scheduler.messages import ArtifactKind, ClusterView, DeviceId, FunctionName, Residency, SlotId

NONE, HOST, DEV = 0, 1, 2
# functions without a slot of their own considered per open slot (`_shortlist_open_slot_candidates`)
OPEN_SLOT_CANDIDATES_PER_SLOT = 4
LIB, BBH, ADH, BBD, ADD, WARM = range(6)


class GreedyKnapsack:
    """One solve of one view; state in parallel lists indexed by function (sorted by name: deterministic)."""

    def __init__(self, view: ClusterView, device_horizon_s: float = 0.0) -> None:
        """`device_horizon_s` > 0: a closure that takes new device memory is open only to functions whose backbone's
        functions (not being invoked) are together expected within it (summed rate x horizon >= 1); binding to a
        backbone copy already there takes none (SchedulerConfig)."""
        invoked = view.invoked
        self.pinned = tuple(r for r in view.resident if r.function in invoked)
        self.names = names = sorted(f for f in view.functions if f not in invoked)
        profiles = [view.functions[f] for f in names]
        dev_ids = [d.device_id for d in view.devices]
        self.dev_ids = dev_ids
        dev_index = {d: k for k, d in enumerate(dev_ids)}
        self.slot_ids = [s.slot_id for s in view.slots]
        slot_index = {s: k for k, s in enumerate(self.slot_ids)}
        fn_index = {f: i for i, f in enumerate(names)}

        # backbones: index, shared size on a device (the largest any function declares)
        bb_index: dict[str, int] = {}
        self.bb_of: list[int] = []
        bb_of = self.bb_of
        self.bb_bytes: list[int] = []
        for p in profiles:
            b = bb_index.setdefault(p.backbone, len(bb_index))
            if b == len(self.bb_bytes):
                self.bb_bytes.append(0)
            bb_of.append(b)
            cost = p.costs.backbone_device
            if cost is not None and cost.memory_bytes > self.bb_bytes[b]:
                self.bb_bytes[b] = cost.memory_bytes
        self.fns_of_bb: list[list[int]] = [[] for _ in bb_index]
        for i, b in enumerate(bb_of):
            self.fns_of_bb[b].append(i)

        # values (-1: not pre-loadable there) and weights
        rates = [p.arrival_rate_per_s for p in profiles]
        # a backbone's copy on a device serves every function bound to it, so the horizon counts their arrivals
        # together: four functions of one backbone, each expected every 20 minutes, keep it (and their small
        # adapters and warm-ups beside it) on the device (docs/scheduler.md, "Idle cost")
        backbone_rate = [sum(rates[i] for i in fns) for fns in self.fns_of_bb]
        self.device_ok = [device_horizon_s <= 0 or backbone_rate[b] * device_horizon_s >= 1 - 1e-9 for b in bb_of]

        def table(field: str) -> tuple[list[float], list[int]]:
            costs = [getattr(p.costs, field) for p in profiles]
            return ([r * c.load_s if c is not None else -1.0 for r, c in zip(rates, costs, strict=True)],
                    [c.memory_bytes if c is not None else 0 for c in costs])

        self.v_lib, self.w_lib = table("libraries")
        self.v_bbh, self.w_bbh = table("backbone_host")
        self.v_bbd, _ = table("backbone_device")
        self.v_adh, self.w_adh = table("adapter_host")
        self.v_add, self.w_add = table("adapter_device")
        self.v_warm, self.w_warm = table("warmup")

        n = len(names)
        self.const = list(zip(self.v_lib, self.w_lib, self.v_bbh, self.w_bbh, self.v_bbd, self.v_adh, self.w_adh,
                              self.v_add, self.w_add, self.v_warm, self.w_warm, strict=True))
        self.open_kinds: list[list[int]] = [  # the candidates a function may still take
            [] if self.v_lib[i] < 0 else
            [k for k, ok in ((LIB, True), (BBH, self.v_bbh[i] >= 0), (ADH, self.v_adh[i] >= 0),
                             (BBD, self.v_bbd[i] >= 0), (ADD, self.v_bbd[i] >= 0 and self.v_add[i] >= 0),
                             (WARM, self.v_bbd[i] >= 0 and self.v_add[i] >= 0 and self.v_warm[i] >= 0)) if ok]
            for i in range(n)]
        self.lib = [False] * n
        self.slot = [-1] * n
        self.bb = [NONE] * n
        self.ad = [NONE] * n
        self.warm = [False] * n
        self.dev = [-1] * n
        self.picks: list[tuple[int, int]] = []  # (function, kind) in the order applied
        self.value = 0.0

        # capacity left, after what is used and what invoked functions pin
        self.dev_free = [d.capacity_bytes - d.used_bytes for d in view.devices]
        self.slot_free = [s.capacity_bytes - s.used_bytes for s in view.slots]
        # -1 open, i taken by function i, -3 - i bound to function i (its idle instance), -2 not usable (held by an
        # invoked function, or bound to a function not being planned)
        self.slot_owner = [-1] * len(self.slot_ids)
        self.resident_bb: list[set[int]] = [set() for _ in dev_ids]
        self.devs_of_bb: list[list[int]] = [[] for _ in bb_index]
        pinned_bb: set[tuple[str, str]] = set()
        for r in self.pinned:
            if r.slot in slot_index:
                self.slot_owner[slot_index[r.slot]] = -2
            pinned_profile = view.functions.get(r.function)
            if pinned_profile is None:
                continue
            cost = pinned_profile.costs.get(r.kind, r.tier)
            size = cost.memory_bytes if cost is not None else 0
            if r.tier == "device" and r.device in dev_index:
                d = dev_index[r.device]
                if r.kind == "backbone":
                    if (pinned_profile.backbone, r.device) in pinned_bb:
                        continue
                    pinned_bb.add((pinned_profile.backbone, r.device))
                    pinned_b = bb_index.get(pinned_profile.backbone)
                    if pinned_b is not None:
                        self.resident_bb[d].add(pinned_b)
                        self.devs_of_bb[pinned_b].append(d)
                    size = max(size, self.bb_bytes[pinned_b] if pinned_b is not None else 0)
                self.dev_free[d] -= size
            elif r.tier == "host" and r.slot in slot_index:
                self.slot_free[slot_index[r.slot]] -= size
        # where each function is now (to stay there) and which slot it may use first
        self.cur_dev = [-1] * n
        self.pref_slot = [-1] * n
        for r in view.resident:
            resident_i = fn_index.get(r.function)
            if resident_i is None:
                continue
            if r.tier == "device" and r.device in dev_index:
                self.cur_dev[resident_i] = dev_index[r.device]
            if r.slot in slot_index and self.pref_slot[resident_i] < 0:
                self.pref_slot[resident_i] = slot_index[r.slot]
        self.own_slots: dict[int, list[int]] = {}  # slots bound to a function (its idle instances)
        for k, s in enumerate(view.slots):
            if s.function is not None:
                owner = fn_index.get(s.function)
                if self.slot_owner[k] == -2 or owner is None:
                    self.slot_owner[k] = -2
                else:
                    self.slot_owner[k] = -3 - owner  # reserved for function `owner`
                    self.own_slots.setdefault(owner, []).append(k)
        for i, k in enumerate(self.pref_slot):
            if k >= 0 and self.slot_owner[k] not in (-1, -3 - i):
                self.pref_slot[i] = -1
        self.open_slots = sorted((self.slot_free[k], k) for k in range(len(self.slot_ids)) if self.slot_owner[k] == -1)
        idle_slots = [max(c, 0) for c in self.slot_free] or [1]
        idle_devs = [max(c, 0) for c in self.dev_free] or [1]
        self.inv_host = 1.0 / max(1.0, sum(idle_slots) / len(idle_slots))
        self.inv_dev = 1.0 / max(1.0, sum(idle_devs) / len(idle_devs))
        self.best_dev = max(range(len(dev_ids)), key=self.dev_free.__getitem__) if dev_ids else -1
        self._shortlist_open_slot_candidates()

    def _shortlist_open_slot_candidates(self) -> None:
        """A function with no slot of its own pre-loads nothing unless it takes an open slot, and each open slot
        takes one function: of the many such functions of a large fleet only the `OPEN_SLOT_CANDIDATES_PER_SLOT` per
        open slot whose closures are worth the most (their whole chain's value, an upper bound of any closure's
        density since a closure taking a slot weighs at least one) are candidates. The others' candidates would be
        evaluated, pushed and re-pushed at every backbone placed for nothing: at 10,000 functions that was most of
        a plan's time."""
        limit = OPEN_SLOT_CANDIDATES_PER_SLOT * len(self.open_slots)
        needing = [i for i, kinds in enumerate(self.open_kinds)
                   if kinds and self.pref_slot[i] < 0 and i not in self.own_slots]
        if len(needing) <= limit:
            return

        def bound(i: int) -> float:
            return (self.v_lib[i] + max(self.v_bbh[i], self.v_bbd[i], 0.0) + max(self.v_adh[i], self.v_add[i], 0.0)
                    + max(self.v_warm[i], 0.0))

        needing.sort(key=lambda i: (-bound(i), i))
        for i in needing[limit:]:
            self.open_kinds[i] = []

    # -- candidates ---------------------------------------------------------------------------------------------

    def evaluate(self, i: int, kind: int) -> tuple[float, float, int, bool, int, int] | None:
        """(density, marginal value, device, places the backbone, host bytes, device bytes) or None. `kind` is one
        of the function's open kinds (so its costs exist)."""
        v_lib, w_lib, v_bbh, w_bbh, v_bbd, v_adh, w_adh, v_add, w_add, v_warm, w_warm = self.const[i]
        need_lib = not self.lib[i]
        if need_lib:
            if not self.open_slots and self.pref_slot[i] < 0 and i not in self.own_slots:
                return None  # no slot left for it
            dv, host = v_lib, w_lib
        elif kind == LIB:
            return None
        else:
            dv, host = 0.0, 0
        bb, ad = self.bb[i], self.ad[i]
        d, place_bb, dev_bytes = -1, False, 0
        if kind == BBH:
            if bb != NONE:
                return None
            dv += v_bbh
            host += w_bbh
        elif kind == ADH:
            if ad != NONE:
                return None
            dv += v_adh
            host += w_adh
        elif kind != LIB:
            if bb != DEV:
                dv += v_bbd
                if bb == HOST:
                    dv -= v_bbh
                    host -= w_bbh
            elif kind == BBD:
                return None
            if kind != BBD:
                if ad != DEV:
                    dv += v_add
                    dev_bytes = w_add
                    if ad == HOST:
                        dv -= v_adh
                        host -= w_adh
                elif kind == ADD:
                    return None
                if kind == WARM:
                    if self.warm[i]:
                        return None
                    dv += v_warm
                    dev_bytes += w_warm
            if bb == DEV:
                d = self.dev[i]
                if self.dev_free[d] < dev_bytes:
                    return None
            else:
                d, place_bb = self._pick_device(i, dev_bytes)
                if d < 0:
                    return None
                if place_bb:
                    dev_bytes += self.bb_bytes[self.bb_of[i]]
        if dv <= 0 or (dev_bytes > 0 and not self.device_ok[i]):
            return None
        if need_lib:  # the closure takes a whole slot (no other function can use what it leaves free) unless
            k = self._slot_for(i, host)  # the slot is bound to this function anyway
            if k < 0:
                return None
            weight = (max(host * self.inv_host, 1.0) if self.slot_owner[k] == -1 else 0.0) + dev_bytes * self.inv_dev
        elif host > self.slot_free[self.slot[i]]:
            return None
        else:  # more bytes in its own slot cost nobody else anything
            weight = dev_bytes * self.inv_dev
        return (dv / weight if weight > 0 else math.inf), dv, d, place_bb, host, dev_bytes

    def _pick_device(self, i: int, need: int) -> tuple[int, bool]:
        """Where f binds its backbone: where it is now, else the device holding beta(f) with the most room, else
        the device with the most room (placing beta(f) there)."""
        b, free = self.bb_of[i], self.dev_free
        cur = self.cur_dev[i]
        if cur >= 0 and b in self.resident_bb[cur] and free[cur] >= need:
            return cur, False
        best = -1
        for d in self.devs_of_bb[b]:
            if free[d] >= need and (best < 0 or free[d] > free[best]):
                best = d
        if best >= 0:
            return best, False
        if cur >= 0 and free[cur] >= need + self.bb_bytes[b]:
            return cur, True
        d = self.best_dev
        if d >= 0 and free[d] >= need + self.bb_bytes[b]:
            return d, True
        return -1, False

    # -- the loop -----------------------------------------------------------------------------------------------

    def most_valuable(self, count: int) -> list[tuple[int, int]]:
        """The `count` candidates (function, kind) of the largest marginal value from the empty plan."""
        found = [(c[1], i, kind) for i in range(len(self.names)) for kind in self.open_kinds[i]
                 if (c := self.evaluate(i, kind)) is not None]
        return [(i, kind) for _, i, kind in heapq.nlargest(count, found)]

    def solve(self, first: tuple[int, int] | None = None) -> tuple[Residency, ...]:
        """Greedy by density; `first`: a candidate applied before anything else (see `PreloadPlanner.plan`)."""
        self.heap: list[tuple[float, int, int, int]] = []
        heap = self.heap
        self.stamp = [0] * (6 * len(self.names))
        # candidates whose key paid for placing their backbone, or that did not fit: a new copy may help them
        self.waits_for_backbone = [True] * (6 * len(self.names))
        if first is not None:
            found = self.evaluate(*first)
            if found is not None:
                self._apply(first[0], first[1], found)
        for i in range(len(self.names)):
            self._push(i, self.open_kinds[i])
        while heap:
            neg_density, i, kind, stamp = heapq.heappop(heap)
            if stamp != self.stamp[6 * i + kind]:
                continue  # superseded by a later push
            found = self.evaluate(i, kind)
            if found is None:
                self.waits_for_backbone[6 * i + kind] = True
                continue  # it comes back when its function or its backbone changes
            if found[0] < -neg_density * (1 - 1e-12):  # worse than its key said: back in line
                heapq.heappush(heap, (-found[0], i, kind, stamp))
                continue
            self._apply(i, kind, found)
        return self._target()

    def _push(self, i: int, kinds: list[int] | tuple[int, ...]) -> None:
        for kind in kinds:
            found = self.evaluate(i, kind)
            key = 6 * i + kind
            self.stamp[key] += 1
            if found is None:
                self.waits_for_backbone[key] = True
            else:
                self.waits_for_backbone[key] = found[3]
                heapq.heappush(self.heap, (-found[0], i, kind, self.stamp[key]))

    def _apply(self, i: int, kind: int, found: tuple[float, float, int, bool, int, int]) -> None:
        _, dv, d, place_bb, host, dev_bytes = found
        self.value += dv
        if not self.lib[i]:
            self._take_slot(i, host)
            self.lib[i] = True
            self.picks.append((i, LIB))
        self.slot_free[self.slot[i]] -= host
        if kind == BBH:
            self.bb[i] = HOST
            self.picks.append((i, BBH))
        elif kind == ADH:
            self.ad[i] = HOST
            self.picks.append((i, ADH))
        elif kind >= BBD:
            b = self.bb_of[i]
            if place_bb:
                self.resident_bb[d].add(b)
                self.devs_of_bb[b].append(d)
            if self.bb[i] != DEV:
                self.bb[i], self.dev[i] = DEV, d
                self.picks.append((i, BBD))
            if kind >= ADD and self.ad[i] != DEV:
                self.ad[i] = DEV
                self.picks.append((i, ADD))
            if kind == WARM:
                self.warm[i] = True
                self.picks.append((i, WARM))
            self.dev_free[d] -= dev_bytes
            if dev_bytes:
                self.best_dev = max(range(len(self.dev_ids)), key=self.dev_free.__getitem__)
            if place_bb:  # binding to it is now free for the others of this backbone
                alive, waits = bool(self.open_slots), self.waits_for_backbone
                for j in self.fns_of_bb[b]:
                    if j != i and self.bb[j] != DEV and (alive or self.lib[j] or self.pref_slot[j] >= 0
                                                         or j in self.own_slots):
                        self._push(j, [k for k in self.open_kinds[j] if k >= BBD and waits[6 * j + k]])
        done = {LIB} if kind == LIB else {LIB, kind}
        if self.bb[i] == DEV:
            done |= {BBH, BBD}
        if self.ad[i] == DEV:
            done |= {ADH, ADD}
        self.open_kinds[i] = [k for k in self.open_kinds[i] if k not in done]
        stamp = self.stamp
        for key in range(6 * i, 6 * i + 6):  # whatever of it is still in the heap is stale now
            stamp[key] += 1
        self._push(i, self.open_kinds[i])

    def _slot_for(self, i: int, host: int) -> int:
        """The slot function i would take for `host` bytes: the one it is in now if they fit there, else the
        tightest fit among its own (bound) slots, else among the open ones; -1: none fits."""
        k = self.pref_slot[i]
        free = self.slot_free
        if k >= 0 and free[k] >= host and self.slot_owner[k] in (-1, -3 - i):
            return k
        own = self.own_slots.get(i)
        if own:
            fitting = [k for k in own if free[k] >= host]
            if fitting:
                return min(fitting, key=free.__getitem__)
        open_slots = self.open_slots
        if not open_slots or open_slots[-1][0] < host:
            return -1
        return open_slots[bisect.bisect_left(open_slots, (host, -1))][1]

    def _take_slot(self, i: int, host: int) -> None:
        k = self._slot_for(i, host)
        if self.slot_owner[k] == -1:
            self.open_slots.remove((self.slot_free[k], k))
        self.slot_owner[k] = i
        self.slot[i] = k

    def _target(self) -> tuple[Residency, ...]:
        out: list[Residency] = list(self.pinned)
        names, slots, devs = self.names, self.slot_ids, self.dev_ids
        for i, kind in self.picks:
            f: FunctionName = names[i]
            slot: SlotId = slots[self.slot[i]]
            if kind == LIB:
                out.append(Residency(f, "libraries", "host", None, slot))
            elif kind in (BBH, ADH):
                kind_name: ArtifactKind = "backbone" if kind == BBH else "adapter"
                if (self.bb[i] if kind == BBH else self.ad[i]) == HOST:  # not moved up later
                    out.append(Residency(f, kind_name, "host", None, slot))
            else:
                device: DeviceId = devs[self.dev[i]]
                kind_names: dict[int, ArtifactKind] = {BBD: "backbone", ADD: "adapter", WARM: "warmup"}
                kind_name = kind_names[kind]
                out.append(Residency(f, kind_name, "device", device, slot))
        return tuple(out)
