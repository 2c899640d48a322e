"""Which module launched each kernel: module intervals on the host clock, for the profiled request.

``ModuleTracker(model)`` is a context manager for the profiled request only (never the timed
repeats): forward pre/post hooks on every module of ``model`` append (host ns, module index) /
(host ns, -1) to one event list, and the KV-cache ``update`` methods (``KV_CACHE_SITES``) are
wrapped for the duration to append a ``kv_cache`` interval. Host times are ``time.time_ns()``,
the profiler's clock domain (as ``StageRecorder``'s wall-clock bounds).

``attribute(launch_ns)`` replays the events with a stack and gives each launch time the label
(``ModuleLabel``) of the innermost interval open at that moment:

* a module that a family of ``harness.anatomy.registry`` describes (``family_of``): that family
  and its op group (``FamilyEntry.op_group``: rmsnorm -> ``norm``, rope -> ``rope``, ...);
* a KV-cache update (the growing cache's ``torch.cat``, a static cache's index copy): family
  ``llm_attention``, op group ``kv_cache``;
* an MoE container outside its gate, experts and shared expert (argsort, gather, scatter, the
  count copy, the weighted sum): op group ``routing/indexing``, no family (its GEMM kernels, grouped
  MoE's routed experts, are relabelled ``moe_routed`` / ``matmul`` by ``kernels.routed_expert_gemms``);
* a module without a family inside one that has one (the Linear of an attention): the parent's;
* any other container (decoder layer, SAM/CLIP block: residual adds, casts): ``elementwise``;
* no module at all (adapter glue: the projector layout, ``masked_scatter``, the argmax): ``other``.

Kernels replayed from a CUDA graph are attributed to the graph launch, i.e. to whatever module
was open then (usually none: ``other``). ``scope(module)`` opens a module's interval without its
forward: code that does a module's work in its own kernels (the fused decode step) uses it.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import NamedTuple, Optional

import numpy as np

from ..anatomy.registry import BY_FAMILY, CONTAINERS, family_of
from ..variants.base import reference_class

KV_GROUP = "kv_cache"
ROUTING_GROUP = "routing/indexing"
GLUE_GROUP = "elementwise"
OUTSIDE_GROUP = "other"
#: container classes (ours, the vendor's) whose own kernels are MoE routing and indexing
ROUTING_CONTAINERS = ("MoE", CONTAINERS["MoE"][0])
#: modules whose classes named ``*Cache`` with an own ``update`` method are KV-cache writers
KV_CACHE_SITES = ("harness.models.llm", "transformers.cache_utils")


class ModuleLabel(NamedTuple):
    """Where a kernel was launched from: innermost module ``path`` and ``cls``, its analytic
    ``family`` ('' when none) and roofline ``op_group``."""

    path: str
    cls: str
    family: str
    op_group: str


OUTSIDE = ModuleLabel("", "", "", OUTSIDE_GROUP)


def kv_cache_classes() -> list:
    """Cache classes with their own ``update`` in the already imported ``KV_CACHE_SITES``."""
    out = []
    for name in KV_CACHE_SITES:
        mod = sys.modules.get(name)
        for obj in vars(mod).values() if mod is not None else ():
            if isinstance(obj, type) and obj.__name__.endswith("Cache") and "update" in vars(obj) \
                    and obj.__module__ == name:
                out.append(obj)
    return out


class ModuleTracker:
    """Module and KV-cache-update intervals of one request (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.names: list = []                # (path, class name) per module index
        self.events: list = []               # (host ns, index) push, (host ns, -1) pop
        self._handles: list = []
        self._patched: list = []
        self._families: dict = {}

    def __enter__(self):
        ev = self.events
        now = time.time_ns
        self._index = {}
        for i, (name, mod) in enumerate(self.model.named_modules()):
            self.names.append((name, reference_class(mod).__name__))   # a variant's module: its reference class
            self._index[id(mod)] = i
            self._handles.append(mod.register_forward_pre_hook(lambda m, a, i=i: ev.append((now(), i))))
            self._handles.append(mod.register_forward_hook(lambda m, a, o: ev.append((now(), -1)), always_call=True))
        kv = self.kv_index = len(self.names)
        for cls in kv_cache_classes():
            orig = vars(cls)["update"]

            def update(obj, *args, _orig=orig, **kwargs):
                ev.append((now(), kv))
                try:
                    return _orig(obj, *args, **kwargs)
                finally:
                    ev.append((now(), -1))

            setattr(cls, "update", update)
            self._patched.append((cls, orig))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for cls, orig in self._patched:
            setattr(cls, "update", orig)
        self._handles, self._patched = [], []
        return False

    @contextlib.contextmanager
    def scope(self, module):
        """Kernels launched inside count as ``module``'s, as if its forward ran (a fused kernel doing
        that module's work without calling it: ``variants.fused_step``)."""
        self.events.append((time.time_ns(), self._index[id(module)]))
        try:
            yield
        finally:
            self.events.append((time.time_ns(), -1))

    # ------------------------------------------------------------------------ attribution
    def _family(self, i: int) -> str:
        if i not in self._families:
            path, cls = self.names[i]
            hit = family_of(path, cls)
            self._families[i] = hit[0] if hit else ""
        return self._families[i]

    def _label(self, i: int, parent: Optional[ModuleLabel]) -> ModuleLabel:
        if i == self.kv_index:
            return ModuleLabel((parent.path + "." if parent and parent.path else "") + "kv_cache", "kv_cache",
                               "llm_attention", KV_GROUP)
        path, cls = self.names[i]
        fam = self._family(i)
        if fam:
            return ModuleLabel(path, cls, fam, BY_FAMILY[fam].op_group)
        if cls in ROUTING_CONTAINERS:
            return ModuleLabel(path, cls, "", ROUTING_GROUP)
        if parent is not None and (parent.family or parent.op_group == ROUTING_GROUP):
            return ModuleLabel(path, cls, parent.family, parent.op_group)
        return ModuleLabel(path, cls, "", GLUE_GROUP)

    def attribute(self, launch_ns) -> list:
        """[ModuleLabel] for each host launch time (int ns; None: ``OUTSIDE``), innermost first."""
        known = [j for j, x in enumerate(launch_ns) if x is not None and x == x]
        t = np.asarray([int(launch_ns[j]) for j in known], dtype=np.int64)   # ns since 1970: keep int64
        out = [OUTSIDE] * len(launch_ns)
        stack: list = []
        events, k = self.events, 0
        for o in np.argsort(t, kind="stable"):
            j = known[o]
            while k < len(events) and events[k][0] <= t[o]:
                idx = events[k][1]
                if idx < 0:
                    if stack:
                        stack.pop()
                else:
                    stack.append(self._label(idx, stack[-1] if stack else None))
                k += 1
            out[j] = stack[-1] if stack else OUTSIDE
        return out


__all__ = ["ModuleTracker", "ModuleLabel", "OUTSIDE", "KV_GROUP", "ROUTING_GROUP", "GLUE_GROUP", "OUTSIDE_GROUP",
           "ROUTING_CONTAINERS", "KV_CACHE_SITES", "kv_cache_classes"]
