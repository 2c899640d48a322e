"""Exactness check: FlopCounterMode per stage on the reference model vs the analytic
``flops_counted``. ``python -m harness.analytic.check`` prints the comparison table and exits 1
on any difference.

How the count is taken
----------------------
The whole request runs through ``DeepseekOCR.generate`` (vision per view, layout, prefill, the
decode steps) under one ``FlopCounterMode``; a ``stage`` callback reads the running total when
each leaf stage (sam, clip, projector, prefill, decode_step) opens and closes, so every counted
FLOP is attributed to the stage that ran it (FLOPs outside any stage are reported; there are
none).

* ``device="meta"`` (default, full size): shapes only, no weights, seconds per case. The vendor
  MoE loop copies its per-expert token counts to the host (``.cpu().numpy()``), which meta
  tensors cannot do, so ``uniform_routing(model)`` sets each MoE layer's ``uniform_counts`` for the
  duration of the check: the same loop runs with a deterministic uniform split of the T*k routed
  rows over the experts (expert i gets floor(T*k/E) rows, +1 for i < T*k mod E). Every routed row
  still passes exactly one expert's three GEMMs, so the counted FLOPs are those of any routing
  (the analytic MoE row is routing-independent for FLOPs; only weight bytes depend on which
  experts are touched).
* ``device="cpu"``: real tensors with the vendor loop and its real (data-dependent) routing, for
  small configs. SDPA is pinned to its math backend: FlopCounterMode has no formula for the CPU
  fused kernel ``_scaled_dot_product_flash_attention_for_cpu`` and would count those calls as 0
  (the math backend's two ``bmm`` are exactly the SDPA formula).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections import defaultdict
from typing import Optional

import torch

from ..config import ModelConfig, cost_config
from ..errors import HarnessError
from ..markdown import LEFT, RIGHT, table
from ..anatomy.stages import LEAF_RANGES, VISION_STAGES
from . import compose

VISION = VISION_STAGES
LEAF = LEAF_RANGES


@contextlib.contextmanager
def uniform_routing(model):
    """Every MoE layer of ``model`` splits its routed rows uniformly over the experts (no host
    sync; see ``MoE.uniform_counts``) until exit."""
    from ..models.llm import MoE

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.uniform_counts = True
    try:
        yield
    finally:
        for m in moes:
            m.uniform_counts = False


class StageCounter:
    """A ``stage(name, **payload)`` factory attributing FlopCounterMode's running total to stages."""

    def __init__(self, mode):
        self.mode = mode
        self.by_stage = defaultdict(int)
        self.by_view = defaultdict(int)
        self._open = None

    @contextlib.contextmanager
    def stage(self, name, **payload):
        if name not in LEAF:
            yield
            return
        if self._open is not None:
            raise RuntimeError(f"stage {name!r} opened inside leaf stage {self._open!r}")
        self._open = name
        before = self.mode.get_total_flops()
        try:
            yield
        finally:
            delta = self.mode.get_total_flops() - before
            key = "decode" if name == "decode_step" else name
            self.by_stage[key] += delta
            if name in VISION:
                self.by_view[(key, "glue" if payload.get("glue") else payload.get("call"))] += delta
            self._open = None


def make_request(r: compose.Resolved, cfg: ModelConfig, device: str, dtype=torch.float32, seed: int = 0):
    """A ``workload.Request`` of random pixels / token ids with the case's exact layout."""
    from ..workload import Request

    B, S, I = r.batch, r.prefill_tokens, r.image_tokens
    dev = torch.device(device)
    if dev.type == "meta":
        ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
        pix = lambda n, s: torch.empty(n, 3, s, s, device=dev, dtype=dtype)  # noqa: E731
    else:
        gen = torch.Generator().manual_seed(seed)
        text = torch.randint(1000, min(100000, cfg.llm.vocab_size), (r.text_tokens,), generator=gen)
        row = torch.cat([torch.tensor([cfg.bos_token_id]), torch.full((I,), cfg.image_token_id), text])
        ids = row[None].expand(B, -1).contiguous().to(dev)
        m = torch.zeros(S, dtype=torch.bool)
        m[1:1 + I] = True
        mask = m[None].expand(B, -1).contiguous().to(dev)
        pix = lambda n, s: torch.rand(n, 3, s, s, generator=gen).mul(2).sub(1).to(dev, dtype)  # noqa: E731
    glob = next(v for v in r.views if v.label == "global")
    tiles = next((v for v in r.views if v.label == "tiles"), None)
    return Request(case=r.case, input_ids=ids, images_seq_mask=mask, global_views=pix(glob.n, glob.size),
                   tiles=pix(tiles.n, tiles.size) if tiles else None, pages=[f"check-{i}" for i in range(B)])


def count_case(case, cfg: Optional[ModelConfig] = None, device: str = "meta", model=None):
    """Counted FLOPs per stage of one case: ({stage: flops}, {(stage, view): flops}, outside, routing)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..models.build import build_model
    from ..models.generate import generate

    cfg = cost_config(cfg)
    r = compose.resolve(case, cfg)
    if model is None:
        model = build_model(cfg, device=device)
    request = make_request(r, cfg, device)
    mode = FlopCounterMode(display=False)
    counter = StageCounter(mode)
    if torch.device(device).type == "meta":
        ctx = uniform_routing(model)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(SDPBackend.MATH)
    with ctx, mode:
        result = generate(model, request, counter.stage)
    outside = mode.get_total_flops() - sum(counter.by_stage.values())
    return dict(counter.by_stage), dict(counter.by_view), outside, result.routing


def check_cases(cases, cfg: Optional[ModelConfig] = None, device: str = "meta", verbose: bool = False,
                model=None):
    """DataFrame [case, stage, calls, counted, analytic, diff, seconds]: FlopCounterMode vs analytic.

    ``model``: a reference model already built from ``cfg`` on ``device`` (built here otherwise).
    """
    import pandas as pd

    from ..models.build import build_model

    cfg = cost_config(cfg)
    if model is None:
        model = build_model(cfg, device=device)
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        counted, by_view, outside, routing = count_case(case, cfg, device, model)
        secs = time.perf_counter() - t0
        r = compose.resolve(case, cfg)
        analytic = compose.stage_totals(compose.workload_costs(case, cfg))
        for st in compose.STAGES:
            c, a = int(counted.get(st, 0)), int(analytic[st]["flops_counted"])
            rows.append({"case": r.name, "stage": st, "counted": c, "analytic": a, "diff": c - a,
                         "calls": _calls(r, st), "seconds": secs})
        rows.append({"case": r.name, "stage": "(outside stages)", "counted": int(outside), "analytic": 0,
                     "diff": int(outside), "calls": 0, "seconds": secs})
        if verbose:
            print(f"  {r.name}: {secs:.1f} s", file=sys.stderr, flush=True)
    return pd.DataFrame(rows)


def _calls(r: compose.Resolved, stage: str) -> int:
    if stage in VISION:
        return len(r.views)
    if stage == "prefill":
        return 1
    return r.decode_steps


def format_table(df) -> str:
    """Markdown table of a ``check_cases`` frame (FLOPs with thousands separators)."""
    lines = table(["case", "stage", "calls", "counted FLOPs", "analytic flops_counted", "diff"],
                  [[r["case"], r["stage"], r["calls"], f"{r['counted']:,}", f"{r['analytic']:,}", f"{r['diff']:,}"]
                   for _, r in df.iterrows()], [LEFT, LEFT, RIGHT, RIGHT, RIGHT, RIGHT])
    bad = int((df["diff"] != 0).sum())
    lines.append("")
    lines.append(f"{len(df)} rows, {bad} with a non-zero difference.")
    return "\n".join(lines)


DEFAULT_MODES = ("tiny", "small", "base", "large", "gundam")
DEFAULT_GRIDS = ("1x2", "2x3", "3x3")


def cases_from_args(modes, grids, decode_tokens: int, text_tokens: int = 12, batch: int = 1,
                    cfg: Optional[ModelConfig] = None) -> list:
    """The five modes (gundam: default-page grid) + gundam at each grid, de-duplicated by name."""
    out, seen = [], set()
    specs = [compose.as_case(m) for m in modes] + [compose.Case("gundam", compose.parse_grid(g)) for g in grids]
    for c in specs:
        c = dataclasses.replace(c, decode_tokens=decode_tokens, text_tokens=text_tokens, batch=batch, name="")
        compose.resolve(c, cfg or ModelConfig())
        if c.name in seen:
            continue
        seen.add(c.name)
        out.append(c)
    return out


def _split(text) -> list:
    return [t for t in (s.strip() for s in str(text).split(",")) if t]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.analytic.check",
                                description="FlopCounterMode per stage vs the analytic flops_counted.")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated crop modes")
    p.add_argument("--grids", default=",".join(DEFAULT_GRIDS), help="gundam tile grids COLSxROWS, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens per case (decode steps = this - 1)")
    p.add_argument("--text-tokens", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="meta", help="meta (full size, default) or cpu (small configs)")
    p.add_argument("--model-config", default=None, help="YAML model config (e.g. conf/model/tiny.yaml)")
    args = p.parse_args(argv)
    try:
        cfg = load_model_config(args.model_config)
        cases = cases_from_args(_split(args.modes), _split(args.grids), args.decode_tokens, args.text_tokens,
                                args.batch, cfg)
        t0 = time.perf_counter()
        df = check_cases(cases, cfg, args.device, verbose=True)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(df))
    print(f"\n{len(cases)} cases on {args.device} in {time.perf_counter() - t0:.1f} s "
          f"(decode_tokens={args.decode_tokens}; MoE: {'forced uniform routing' if args.device == 'meta' else 'real routing'})")
    return 0 if (df["diff"] == 0).all() else 1


def load_model_config(path: Optional[str]) -> ModelConfig:
    if not path:
        return ModelConfig()
    from omegaconf import OmegaConf

    from ..config import from_dict

    return from_dict(ModelConfig, OmegaConf.load(path))


if __name__ == "__main__":
    sys.exit(main())
