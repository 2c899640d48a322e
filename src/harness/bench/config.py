"""The ``bench`` verb's targets and their options (``bench.<target>.*``), torch-free.

``python -m harness bench TARGET [overrides]`` composes ``conf/config.yaml`` with ``+bench=TARGET``
(``conf/bench/TARGET.yaml``: ``bench.target`` and an empty ``bench.<target>`` section, so the
section holds the defaults below) and runs ``harness.bench.<target>`` (``harness.bench.verb``).
``HarnessConfig.bench`` is typed with ``BenchConfig``: an option of another target, a wrong type or a
value below its minimum is refused while the config is composed (``harness.config.validate`` reads
the ``choices`` and ``min`` metadata). Units are in the names: ``*_len`` and ``pos`` are cache
positions, ``reps`` / ``rounds`` / ``warmup`` are timed or untimed calls.

Targets (``TARGETS``; which need a GPU: ``GPU_ONLY``):

* ``decode_step``: batch-1 decode step: the best execution's graph against the fused step (PDL,
  graph, eager), MBU, bf16 parity; ``sweep``: tiles of the fused step one field at a time;
  ``match``: configurations of the fused step under each factor of the run path (``PATH_FACTORS``).
* ``decode_step_diag``: one fused step's numerics against the vendor-style step, every intermediate
  (on a CPU with ``model=tiny`` and ``TRITON_INTERPRET=1``).
* ``decode_step_ablation``: the fused step taken apart: each kernel kind and boundary, each kind
  alone, streaming probes; ``handoff``: a kernel boundary against a grid barrier.
* ``decode_step_sm90``: the fused step's kernels compiled for sm90 without a GPU (registers, spills,
  PDL load order).
* ``attention``: decode attention, SDPA against the split-KV Triton kernel; ``sweep``: its tiles.
* ``moe``: routed experts, the vendor loop against each sync-free implementation; ``sweep``: the
  per-row (``rows``) or the sorted, blocked (``blocks``) kernels' tiles;
  ``shared``: the shared expert folded in; ``routing``: the gate's or balanced.
* ``sam_attention``: one SAM attention call, dense rel-pos mask against the augmented head dim
  (``smoke``: tiny cases on the CPU, plumbing only).
* ``linear``: decode-size linear layers, cuBLAS against the Triton GEMV kernels; ``sweep``: tiles;
  ``shapes``: some shapes only.
* ``overhead``: what the measurement adds to a request (NVTX + CUDA events, kernel capture, one range).
* ``host_noise``: how steady the host is (Python loop, launch-bound loops, host-sync paths).
* ``outside_tpot``: TPOT from outside the harness's timers (``generate()`` of 2 and of 130 tokens).
* ``vision``: SAM, CLIP and the projector on a batch of distinct pages, stage by stage against the
  compute roof, and their kernels by category (runs on the CPU too: host clock, CPU operators).
* ``preprocess``: where the vendor's host preprocessing of a page goes (decode, resize + pad,
  normalise, tiles, request build) beside ``execution.preprocess=device`` (host part, copy, device
  part) and how close its pixels are (runs on the CPU too: its "device" is then the CPU).
"""
import ast
import dataclasses
from dataclasses import dataclass, field, fields
from typing import List, Optional

from ..errors import HarnessError


def _opt(default=None, *, factory=None, **meta):
    """A field with ``harness.config.validate``'s metadata (``choices``, ``min``)."""
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class DecodeStepBench:
    cache_len: int = _opt(512, min=2)         # static cache positions
    pos: int = _opt(286, min=0)               # first position of each timed round (the base page's prompt)
    reps: int = _opt(200, min=1)              # steps per timed round
    rounds: int = _opt(5, min=1)              # timed rounds (the median is reported)
    prompt: int = _opt(286, min=1)            # prefill tokens before the parity check
    check_steps: int = _opt(64, min=1)        # greedy steps of the parity check
    best: bool = True                         # the best execution's graph (its torch.compile takes ~40 s)
    parity: bool = True                       # the bf16 parity check against the vendor-style step
    eager: bool = True                        # the eager (uncaptured) fused rows
    sweep: bool = False                       # also time alternative tiles of the fused step
    clock: bool = False                       # also the step timed from inside its kernels (decode_step_clock)
    only: Optional[List[str]] = None          # with sweep: only these DecodeStepConfig fields
    match: List[str] = _opt(factory=list)     # only the paths table: the direct step matched to the run path
    #                                           by each of these PATH_FACTORS alone, then all (harness.bench.decode_step_paths)
    configs: List[str] = _opt(factory=lambda: ["", "router=(2, 2)"])   # with match: the
    #                                           DecodeStepConfig changes compared ('': the defaults)


#: what the run path (``harness run``'s decode, the ladder) times differently from the bench's
#: directly built fused step, one ``bench.decode_step.match`` factor each (``harness.bench.decode_step_paths``)
PATH_FACTORS = ("cache_len", "positions", "prompt", "history", "buffers", "events")


@dataclass
class DecodeStepDiagBench:
    prompt: int = _opt(286, min=1)            # prefill tokens (the step runs at this position)
    cache_len: int = _opt(512, min=2)         # static cache positions
    greedy: int = _opt(64, min=0)             # greedy steps compared afterwards (0: none)


@dataclass
class DecodeStepAblationBench:
    cache_len: int = _opt(512, min=2)
    pos: int = _opt(286, min=0)
    reps: int = _opt(200, min=1)
    rounds: int = _opt(3, min=1)
    layer: int = _opt(5, min=0)               # the layer whose launches are timed alone
    copies: int = _opt(40, min=1)             # launches of one kind per graph (lm_head: 10)
    configs: List[str] = _opt(factory=list)   # also the whole step with these DecodeStepConfig changes
    only_configs: bool = False                # skip the ablations and the probes
    handoff: bool = False                     # only the kernel boundary against a grid barrier
    regs: bool = False                        # registers, spills and resident programs per SM of each config
    eager_steps: int = _opt(0, min=0)         # only run the step this many times without a graph (ncu's target)


@dataclass
class DecodeStepSm90Bench:
    cache_len: int = _opt(512, min=2)
    pdl: bool = True                          # compile with programmatic dependent launch
    config: str = ""                          # DecodeStepConfig changes, e.g. 'down=(4, 8)'
    dump: Optional[str] = None                # a directory for each specialisation's PTX and cubin


@dataclass
class AttentionBench:
    batch: List[int] = _opt(factory=lambda: [1, 8, 32, 64])
    heads: int = _opt(10, min=1)
    head_dim: int = _opt(128, min=16)
    cache_len: int = _opt(448, min=1)         # static cache positions L
    pos: int = _opt(413, min=0)               # the step's position (keys 0..pos are filled)
    layers: int = _opt(12, min=1)             # calls per graph, each on its own K/V buffers
    reps: int = _opt(300, min=1)
    warmup: int = _opt(20, min=0)
    sweep: bool = False                       # also every config of decode_attention_triton.bench_configs()
    configs: List[str] = _opt(factory=list)   # also these DecodeAttentionConfig changes, e.g. 'num_splits=4;wide_warps=1'


@dataclass
class MoEBench:
    tokens: List[int] = _opt(factory=lambda: [1, 8, 32, 64, 300])
    reps: int = _opt(50, min=1)
    warmup: int = _opt(10, min=0)
    seed: int = 0
    fp32: bool = True                         # the fp32 parity section
    sweep: Optional[str] = _opt(None, choices=("rows", "blocks"))   # only those kernels' tile candidates
    shared: bool = False                      # with a sweep: the shared expert folded into the kernels
    routing: str = _opt("gate", choices=("gate", "balanced"))   # balanced: k distinct experts per token, uniform


SAM_CASES = ("base_global", "large_global", "tiles_global", "base_window", "large_window", "b8_global", "b32_window")


@dataclass
class SamAttentionBench:
    cases: List[str] = _opt(factory=lambda: list(SAM_CASES))
    warmup: int = _opt(10, min=0)
    reps: int = _opt(50, min=2)
    flex: bool = False                        # flex_attention rows (compiles: slow start)
    triton: bool = False                      # the Triton in-kernel-bias rows
    cuda_graph: bool = False                  # time CUDA-graph replays (no host launch gaps)
    compiled: bool = False                    # rows of the cuDNN-augmented and Triton paths torch.compile'd whole (CUDA)
    smoke: bool = False                       # tiny cases on the CPU (fp32, host clock): plumbing only


@dataclass
class LinearBench:
    rows: List[int] = _opt(factory=lambda: [1, 8])
    replays: int = _opt(50, min=1)
    sweep: bool = False                       # GEMV tiles at the first rows value
    inductor: bool = False                    # also torch.compile of (x * w).sum(-1)
    shapes: List[str] = _opt(factory=list)    # these shapes of bench.linear.SHAPES only (empty: all)


@dataclass
class OverheadBench:
    rounds: int = _opt(30, min=0)             # bare against NVTX + events rounds
    capture_rounds: int = _opt(10, min=0)     # bare against kernel-capture rounds (0: none)
    alt_rounds: int = _opt(10, min=0)         # requests with alternating instrumented steps
    range_iters: int = _opt(20000, min=0)     # empty ranges timed for the per-range cost (0: none)


@dataclass
class HostNoiseBench:
    repeats: int = _opt(200, min=2)           # timings per workload
    blocks: int = _opt(600, min=2)            # back-to-back launch blocks for the burst count
    sync_repeats: int = _opt(150, min=2)      # timings per host-sync path (0 paths on a CPU)


@dataclass
class OutsideTpotBench:
    executions: List[str] = _opt(factory=lambda: ["best", "best-fused"])   # named executions (conf/execution/)
    repeats: int = _opt(7, min=1)             # timed (2, 130) pairs per case
    warmup: int = _opt(2, min=0)              # untimed pairs first (set-up, capture)
    ladder: Optional[str] = None              # an optimize run directory (its headline.csv)
    as_ladder: bool = False                   # keep the case's vision_compile


@dataclass
class PreprocessBench:
    pages: int = _opt(16, min=1)              # distinct synthetic pages per mode (each timed once per step)
    modes: List[str] = _opt(factory=lambda: ["base", "gundam"])   # crop modes (harness.layout)
    warmup: int = _opt(2, min=0)              # untimed pages first (allocator, cuDNN / kernel caches)


@dataclass
class VisionBench:
    batch: List[int] = _opt(factory=lambda: [32, 128])          # pages (distinct random global views) per call
    executions: List[str] = _opt(factory=lambda: ["vendor-style", "best"])   # named executions (their vision knobs)
    sam_attention: List[str] = _opt(factory=list)   # execution.sam_attention values to run each fused execution with ([]: its own)
    mode: str = "base"                        # a mode without tiles (harness.layout)
    warmup: int = _opt(2, min=0)              # untimed passes per stage (compile, capture)
    reps: int = _opt(5, min=1)                # timed passes per stage
    top: int = _opt(12, min=0)                # longest kernels listed per stage


#: target -> its options
TARGETS = {"decode_step": DecodeStepBench, "decode_step_diag": DecodeStepDiagBench,
           "decode_step_ablation": DecodeStepAblationBench, "decode_step_sm90": DecodeStepSm90Bench,
           "attention": AttentionBench, "moe": MoEBench, "sam_attention": SamAttentionBench,
           "linear": LinearBench, "overhead": OverheadBench, "host_noise": HostNoiseBench,
           "outside_tpot": OutsideTpotBench, "preprocess": PreprocessBench, "vision": VisionBench}
#: targets that time GPU kernels and have no CPU mode (refused on a CPU)
GPU_ONLY = ("decode_step", "decode_step_ablation", "attention", "moe", "linear", "host_noise", "outside_tpot")


@dataclass
class BenchConfig:
    """``bench.target`` and its options (the other sections stay None)."""

    target: str = _opt("decode_step", choices=tuple(TARGETS))
    decode_step: Optional[DecodeStepBench] = None
    decode_step_diag: Optional[DecodeStepDiagBench] = None
    decode_step_ablation: Optional[DecodeStepAblationBench] = None
    decode_step_sm90: Optional[DecodeStepSm90Bench] = None
    attention: Optional[AttentionBench] = None
    moe: Optional[MoEBench] = None
    sam_attention: Optional[SamAttentionBench] = None
    linear: Optional[LinearBench] = None
    overhead: Optional[OverheadBench] = None
    host_noise: Optional[HostNoiseBench] = None
    outside_tpot: Optional[OutsideTpotBench] = None
    preprocess: Optional[PreprocessBench] = None
    vision: Optional[VisionBench] = None


assert {f.name for f in fields(BenchConfig)} == {"target", *TARGETS}, "one BenchConfig section per target"


def bench_args(args: list) -> list:
    """``TARGET overrides...`` (after ``python -m harness bench``) -> the Hydra arguments
    (``+bench=TARGET`` first). A missing or unknown target is a one-line HarnessError."""
    names = ", ".join(TARGETS)
    if not args or args[0].startswith("-") or "=" in args[0]:
        raise HarnessError("bench needs a target", f"python -m harness bench TARGET [overrides], TARGET one of {names}")
    if args[0] not in TARGETS:
        raise HarnessError(f"unknown bench target {args[0]!r}", f"use one of {names}")
    return [f"+bench={args[0]}"] + list(args[1:])


def options(bench: BenchConfig):
    """The selected target's options (its section, or its defaults when the section is unset)."""
    return getattr(bench, bench.target) or TARGETS[bench.target]()


def check_options(bench: BenchConfig) -> None:
    """Options a type cannot check (one-line HarnessErrors): positions inside the cache, a sweep's
    fields, a SAM case's name."""
    o, t = options(bench), bench.target
    if t == "decode_step":
        for what, need in (("pos + reps", o.pos + o.reps), ("prompt + check_steps", o.prompt + o.check_steps)):
            if need > o.cache_len:
                raise HarnessError(f"bench.decode_step.cache_len={o.cache_len} is shorter than {what} ({need})",
                                   f"raise bench.decode_step.cache_len to {need} or lower {what}")
    if t == "decode_step" and o.match:
        unknown = [f for f in o.match if f not in PATH_FACTORS]
        if unknown or len(set(o.match)) != len(o.match):
            raise HarnessError(f"bench.decode_step.match={list(o.match)}: {unknown or 'a factor twice'}",
                               f"list each of {', '.join(PATH_FACTORS)} at most once")
        if len(o.configs) < 2 or len(set(o.configs)) != len(o.configs):
            raise HarnessError(f"bench.decode_step.configs={list(o.configs)}: the paths table compares two or more "
                               "distinct configurations", "e.g. bench.decode_step.configs=\"['','router=(2, 2)']\"")
    if t in ("decode_step_ablation", "attention") and not o.pos < o.cache_len:
        raise HarnessError(f"bench.{t}.pos={o.pos} is outside the cache (0..{o.cache_len - 1})",
                           f"set bench.{t}.pos below bench.{t}.cache_len")
    if t == "decode_step_diag" and o.prompt + max(o.greedy, 1) > o.cache_len:
        raise HarnessError(f"bench.decode_step_diag.cache_len={o.cache_len} cannot hold prompt + greedy steps",
                           "raise bench.decode_step_diag.cache_len or lower prompt / greedy")
    if t == "moe" and o.shared and o.sweep is None:
        raise HarnessError("bench.moe.shared=true folds the shared expert into a sweep's kernels only",
                           "add bench.moe.sweep=rows or blocks, or drop bench.moe.shared")
    if t == "sam_attention":
        unknown = [c for c in o.cases if c not in SAM_CASES]
        if unknown or not o.cases:
            raise HarnessError(f"bench.sam_attention.cases={list(o.cases)}: {unknown or 'no case'}",
                               f"choose from {', '.join(SAM_CASES)}")
    for name in ("batch", "tokens", "rows"):
        values = getattr(o, name, None)
        if values is not None and (not values or min(values) < 1):
            raise HarnessError(f"bench.{t}.{name}={list(values)} is not a list of sizes >= 1",
                               f"write it like bench.{t}.{name}=[1,8]")


def config_changes(text: str, base=None):
    """``base`` (a frozen tile config with a ``check()``: default ``kernels.decode_step.DecodeStepConfig()``;
    ``bench attention`` passes a ``DecodeAttentionConfig``) with the changes of ``text``, the benches'
    ``FIELD=VALUE[;FIELD=VALUE]`` options (python literals, e.g. ``down=(2, 4);lm_head_stages=3``), checked."""
    if base is None:
        from ..kernels.decode_step import DecodeStepConfig

        base = DecodeStepConfig()
    changes, names = {}, {f.name for f in fields(base)}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in names:
            raise HarnessError(f"config change {item!r}: FIELD=VALUE with a {type(base).__name__} field expected")
        try:
            changes[name] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as exc:
            raise HarnessError(f"config change {item!r}: the value is not a python literal") from exc
    config = dataclasses.replace(base, **changes)
    config.check()
    return config


__all__ = ["BenchConfig", "TARGETS", "GPU_ONLY", "SAM_CASES", "PATH_FACTORS", "bench_args", "options", "check_options",
           "config_changes",
           *(c.__name__ for c in TARGETS.values())]
