"""``manifest.json`` read once into a typed ``Manifest``: what the readers of a run directory (report,
compare, merge, summarize) take from it, with every key an older manifest may lack given its default
here (a missing or null section is an empty dict, a missing list an empty list, a missing value None),
so no reader chains ``.get(..) or {}``.

The run writes the manifest as a dict (``harness.rundir.RunDir.manifest``: status, config, versions,
device, model, cases, ...; ``docs/run-directory.md`` lists them); ``Manifest.of`` reads such a dict
(or passes a ``Manifest`` through). ``raw`` keeps the dict for what a reader copies whole (merge).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: the sections that are JSON objects (a missing or null one reads as {})
SECTIONS = ("config", "device", "versions", "git", "model", "attention", "calibration", "host_steadiness", "launch",
            "measure", "throughput", "timing", "stopped_at")
#: the sections that are JSON lists (a missing or null one reads as [])
LISTS = ("cases", "warnings", "argv", "merged_from", "skipped_cases")
#: the values (a missing one reads as None)
VALUES = ("status", "started", "finished", "error", "dtype", "cwd")


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class Manifest:
    """A run's manifest.json, typed (module docstring)."""

    raw: dict = field(repr=False)
    status: Optional[str] = None
    started: Optional[str] = None
    finished: Optional[str] = None
    error: Optional[str] = None
    dtype: Optional[str] = None
    cwd: Optional[str] = None
    config: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    git: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    attention: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    host_steadiness: dict = field(default_factory=dict)
    launch: dict = field(default_factory=dict)
    measure: dict = field(default_factory=dict)
    throughput: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    stopped_at: dict = field(default_factory=dict)
    cases: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    argv: list = field(default_factory=list)
    merged_from: list = field(default_factory=list)
    skipped_cases: list = field(default_factory=list)

    @classmethod
    def of(cls, manifest) -> "Manifest":
        """``manifest`` (a dict as read from manifest.json, None, or a ``Manifest``) as a ``Manifest``;
        the one place that gives a missing key its default."""
        if isinstance(manifest, Manifest):
            return manifest
        raw = manifest if isinstance(manifest, dict) else {}
        got = {k: _dict(raw.get(k)) for k in SECTIONS}
        got.update({k: raw.get(k) if isinstance(raw.get(k), list) else [] for k in LISTS})
        got.update({k: raw.get(k) for k in VALUES})
        return cls(raw=raw, **got)

    # ------------------------------------------------------------------ typed accessors
    @property
    def experiment(self) -> Optional[str]:
        """The experiment's name (``config.experiment_name``, else ``config.run.name``)."""
        return self.config.get("experiment_name") or _dict(self.config.get("run")).get("name")

    def section_of_config(self, group: str) -> dict:
        """A resolved config group by name (``hardware``, ``model``, ...; {} when not recorded)."""
        return _dict(self.config.get(group))

    @property
    def model_config(self) -> dict:
        """The resolved ``model`` config group ({} when not recorded)."""
        return self.section_of_config("model")

    @property
    def execution_config(self) -> dict:
        """The resolved ``execution`` config group ({} when not recorded)."""
        return self.section_of_config("execution")

    @property
    def top_k(self) -> Optional[int]:
        """Experts each token is routed to (``config.model.llm.num_experts_per_tok``; None: not recorded)."""
        return _dict(self.model_config.get("llm")).get("num_experts_per_tok")

    @property
    def device_name(self) -> Optional[str]:
        return self.device.get("name")

    @property
    def device_type(self) -> Optional[str]:
        """'cuda' or 'cpu' (None in a manifest written before it was recorded)."""
        return self.device.get("type")

    @property
    def kernels_captured(self) -> bool:
        """Whether the run captured kernels (``measure.kernels``)."""
        return bool(self.measure.get("kernels"))

    @property
    def warmup_default(self) -> Optional[int]:
        """The resolved ``measure.warmup`` (untimed requests per case; None: not recorded)."""
        return self.measure.get("warmup")

    @property
    def loop(self) -> dict:
        """The decode loop the model ran (``model.loop``)."""
        return _dict(self.model.get("loop"))

    @property
    def case_entries(self) -> dict:
        """{case name: its manifest entry}."""
        return {c.get("name"): c for c in self.cases if isinstance(c, dict)}

    @staticmethod
    def execution_of(entry: dict) -> dict:
        """A case entry's ``execution`` ({} when not recorded)."""
        return _dict((entry or {}).get("execution"))

    @staticmethod
    def trace_file(entry: dict) -> Optional[str]:
        """A case entry's trace file, relative to the run (None without a trace)."""
        return _dict((entry or {}).get("trace")).get("file")


__all__ = ["Manifest", "SECTIONS", "LISTS", "VALUES"]
