"""``decode_step=fused`` (+ ``pdl``): the batch-1 decode step as the fused Triton kernels of ``kernels.decode_step``.

The static decoder (``static_decoder.StaticDecoder``) runs, captures and replays a ``FusedCore``
instead of ``Engine.decode_core``: one ``FusedDecodeStep`` over the model's weights (as the other
variants hold them: the fused q/k/v and gate/up weights of ``fused_linears``, the stacked experts
of ``grouped_moe``; views, the state_dict unchanged), the decoder's static cache and device
position, its token buffer and its decode routing (``models.routing.DeviceRouting``). 72 launches
per step (5 for the dense layer, 6 per MoE layer, 1 for the final norm + lm_head + greedy token),
no torch op in between; on CUDA inside the decode CUDA graph. The prefill keeps its path
(modules, captured with ``prefill_graphs``).

``weights_from_model(model)`` collects the tensors a fused step reads (fusing and stacking them
where no converter has yet). Routing: the lm_head kernel counts each MoE layer's chosen experts
into the decoder's per-step buffer [steps + 1, layers, experts] at row min(step_index, steps) and
moves the device step index (so ``DeviceRouting.advance`` is not called: the step
has no torch-path counts). Forced routing (``workload.routing=balanced``): a second step reads the
decoder's kept forced table at the device position; the decoder captures one graph per routing.

``FUSED_STEP`` (``decode_step``) and ``PDL`` (``pdl``: programmatic dependent launch of the same
kernels, sm90+) are the converters; batch 1 only (``check_batch``, and the decoder refuses a
larger batch when it is built).
"""
from __future__ import annotations

import collections
import functools
from typing import Optional

import torch

from .. import knobs
from ..kernels.availability import triton_available
from ..kernels.decode_step import DecodeStepConfig, DecodeWeights, FusedDecodeStep, LayerWeights, default_config
from ..models.adapter import greedy, greedy_chunked
from ..models.llm import MoE
from .base import Converter, need
from .engine import attach
from .fast_moe import stacked
from .fused_linears import fused_weight

#: the number the next clocked request of this process gets (``FusedCore.after_request``; ``request_number``)
_NEXT_REQUEST = [0]
#: requests whose stamps a clocked core keeps until they are taken (``take_stamps``): beyond it the oldest
#: go (about 9,000 stamps, some 1 MB, per request of the reference model)
STAMPS_KEPT = 64
#: the knobs the fused step runs on (it reads their weights and cache; its attention reads positions
#: 0..pos as decode_attention=triton's, which the analytic cost counts)
PREREQUISITES = (("kv_cache", "static"), ("moe_impl", "grouped"), ("linear_impl", "fused"),
                 ("decode_attention", "triton"))


def weights_from_model(model) -> DecodeWeights:
    """The tensors of ``model`` (a ``DeepseekOCR``) a fused step reads: q/k/v and the dense / shared
    gate+up weights fused (``fused_linears``' ``qkv_weight`` / ``gate_up_weight``), the routed
    experts stacked (``grouped_moe``'s ``experts_stacked``), each made once and reused."""
    L = model.cfg.llm
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fused_weight(attn, "qkv_weight", [attn.q_proj, attn.k_proj, attn.v_proj])
        moe = isinstance(mlp, MoE)
        swiglu = mlp.shared_experts if moe else mlp
        gate_up = fused_weight(swiglu, "gate_up_weight", [swiglu.gate_proj, swiglu.up_proj])
        lw = LayerWeights(ln_in=layer.input_layernorm.weight, qkv=qkv, o=attn.o_proj.weight,
                          ln_post=layer.post_attention_layernorm.weight, gate_up=gate_up,
                          down=swiglu.down_proj.weight)
        if moe:
            experts = stacked(mlp)
            lw.router = mlp.gate.weight
            lw.experts_gate_up, lw.experts_down = experts.gate_up, experts.down
        layers.append(lw)
    return DecodeWeights(embed=model.model.embed_tokens.weight, layers=layers, norm=model.model.norm.weight,
                         lm_head=model.lm_head.weight, rotary=model.model.layers[0].self_attn.rotary_emb,
                         num_heads=L.num_heads, eps=L.rms_norm_eps, top_k=L.num_experts_per_tok,
                         norm_topk=L.norm_topk_prob, scale=L.routed_scaling_factor)


class FusedCore:
    """The decode step of a ``StaticDecoder`` (``dec``) as ``FusedDecodeStep`` kernels: called as
    ``Engine.decode_core`` is, ``(token [1, 1], cache, select, routing)``. The step reads the
    decoder's token buffer in place (another token tensor is copied in first), writes the next token
    there and advances the device position; ``greedy`` returns that token, any other ``select`` gets
    the step's logits as fp32 [1, 1, V] (as the decoder returns them). Two steps share the weights,
    cache and token buffer: the weights' routing, and (built on first use) the forced routing of the
    decoder's table, picked by ``routing.active`` on the host (an uncompiled step is captured per
    routing). Outside a CUDA-graph capture the result is a fresh tensor. Each step also writes its
    token into ``history`` (int64 [cache length]) at its position: after a replay the decoder returns
    that slot as the token (``StaticDecoder.step``), where another graph's output is cloned, so a
    greedy step costs no copy kernel between replays."""

    def __init__(self, dec, pdl: bool = False, config: Optional[DecodeStepConfig] = None, clock: bool = False):
        batch = dec.token_in.shape[0]
        need(batch == 1, "decode_step", "fused", f"runs at batch 1 only; this request has {batch} rows",
             "use execution.decode_step=modules at batch > 1")
        need(dec.routing is not None, "decode_step", "fused", "needs the device routing of moe_impl=grouped",
             "add execution.moe_impl=grouped")
        self.dec, self.pdl, self.clock = dec, pdl, clock
        #: with ``clock``: (request number, stamps) of each request: the stamps of the step that ran
        #: (``FusedDecodeStep.clock_stamps``), taken after the request (``after_request``), the last
        #: ``STAMPS_KEPT``; the reader empties it (``take_stamps``). The numbers order the requests of every
        #: decoder of a process (``request_number``).
        self.stamps = collections.deque(maxlen=STAMPS_KEPT)
        self.config = config or default_config(dec.cache.position.device)
        self.weights = weights_from_model(dec.model)
        self.history = torch.zeros(dec.cache.max_len, dtype=torch.int64, device=dec.cache.position.device)
        self.steps: dict = {}
        self.module_scope = None   # set by kernel attribution (``measure.alignment``): module -> context

    def module_of(self, label: str, layer: int):
        """The model's module whose work a step launch (``FusedDecodeStep.calls``' label, layer) does:
        the layer's attention for q/k/v, attention and o_proj, its MoE gate for the router, its MLP
        (MoE container or dense MLP) for gate/up and down, ``lm_head`` for the step end."""
        model = self.dec.model
        if label == "lm_head":
            return model.lm_head
        block = model.model.layers[layer]
        if label in ("qkv", "attention", "o_proj"):
            return block.self_attn
        return block.mlp.gate if label == "router" else block.mlp

    def _step(self, forced: bool) -> FusedDecodeStep:
        if forced not in self.steps:
            dec, r = self.dec, self.dec.routing
            self.steps[forced] = FusedDecodeStep(self.weights, dec.cache, dec.cache.position,
                                                 token=dec.token_in.view(1), config=self.config, pdl=self.pdl,
                                                 counts=(r.decode, r.step_index), forced=r.table if forced else None,
                                                 history=self.history,
                                                 clock_rows=dec.cache.max_len if self.clock else 0)
        return self.steps[forced]

    def after_request(self) -> None:
        """After a request (``StaticDecoder.after_request``): with ``clock``, the stamps of the request's
        step (its routing's) are kept in ``stamps`` (one device read)."""
        active = bool(self.dec.routing.active) if self.dec.routing is not None else False
        if self.clock and active in self.steps:
            number = _NEXT_REQUEST[0]
            _NEXT_REQUEST[0] += 1
            self.stamps.append((number, self.steps[active].clock_stamps()))

    def begin(self) -> None:
        """A request begins (``StaticDecoder.begin``, after any capture): every step's clock emptied, so
        its stamps are the request's alone (the decoder's warm-ups and captures, an eager step of kernel
        attribution wrote rows too)."""
        if self.clock:
            for step in self.steps.values():
                step.reset_clock()

    def take_stamps(self) -> list:
        """The (request number, stamps) kept since the last call, and forget them."""
        out = list(self.stamps)
        self.stamps.clear()
        return out

    @property
    def step(self) -> FusedDecodeStep:
        """The step of the weights' routing (diagnostics, benchmarks)."""
        return self._step(False)

    def __call__(self, token: torch.Tensor, cache, select, routing=None) -> torch.Tensor:
        r = routing if routing is not None else self.dec.routing
        step = self._step(r.active)   # begin() loads a table whenever a request is forced
        if token.data_ptr() != step.token.data_ptr():
            step.token.copy_(token.reshape(-1))
        scope = self.module_scope            # an eager, hooked reference step: each launch under its module
        step.run(None if scope is None else lambda label, layer: scope(self.module_of(label, layer)))
        out = step.token.view(1, 1) if select in (greedy, greedy_chunked) else select(step.logits.view(1, 1, -1).float())
        capturing = out.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return out if capturing else out.clone()


class FusedStep(Converter):
    """``decode_step=fused``: the static decoder's step becomes a ``FusedCore`` (``engine.Plan.decode_step``)."""

    spec = knobs.FUSED_STEP            # the step is fused kernels: no module runs in it

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            need(not ex.pdl, "pdl", True, "launches the fused decode step's kernels, which run only with "
                 "decode_step=fused", "add execution.decode_step=fused, or drop execution.pdl")
            return
        missing = [f"{k}={v}" for k, v in PREREQUISITES if getattr(ex, k) != v]
        self.refuse(not missing, f"needs {', '.join(missing)} (it runs on the static cache, the grouped MoE's "
                    "stacked experts and the fused q/k/v and gate/up weights; its attention reads positions 0..pos "
                    "as decode_attention=triton's)", "add " + " ".join(f"execution.{m}" for m in missing))
        self.refuse(not ex.compile, "replaces the decode step that compile would compile", "drop execution.compile")
        self.refuse(device.type != "cuda" or ex.cuda_graphs == "decode", "runs inside the decode CUDA graph on "
                    "CUDA (72 launches from the host per step would time the host)", "add execution.cuda_graphs=decode")
        ok, why = triton_available(device)
        self.refuse(ok, f"cannot run here: {why}", "use execution.decode_step=modules", here=True)

    def check_batch(self, ex, batch: int) -> None:
        if self.active(ex):
            self.refuse(batch == 1, f"runs at batch 1 only; the case has batch {batch}",
                        "use execution.decode_step=modules at batch > 1")

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "modules: the decode step runs the model's modules"}
        attach(model).decode_step = functools.partial(FusedCore, pdl=ex.pdl, clock=ex.step_clock)
        return {self.manifest_key: "fused: the batch-1 decode step as 72 Triton launches (kernels.decode_step: q/k/v "
                "+ RoPE + KV, split-KV attention, o_proj + residual, router + top-k + count, gate/up, down + "
                "residual per layer; lm_head + greedy token), no torch op between them" +
                (", programmatic dependent launch" if ex.pdl else "")}


class Pdl(Converter):
    """``pdl=true``: the fused step's kernels launched with programmatic dependent launch (Hopper):
    each issues its first weight loads before waiting for the previous kernel (``FusedStep`` binds it)."""

    spec = knobs.PDL

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            return
        ok, why = triton_available(device)
        if ok:
            from ..kernels.decode_step_triton import pdl_support

            ok, why = pdl_support(device)
        self.refuse(ok, f"cannot run here: {why}", "use execution.pdl=false", here=True)

    def convert(self, model, ex, device, dtype) -> dict:
        return {self.manifest_key: "programmatic dependent launch (griddepcontrol) between the fused step's kernels"
                if self.active(ex) else "off"}


class StepClock(Converter):
    """``step_clock=true``: the fused step's kernels time themselves (``FusedDecodeStep(clock_rows=...)``,
    the first program of each launch; ``FusedStep`` binds it); the run reads each request's stamps
    (``FusedCore.take_stamps``) and writes the median request's (step_clock.csv)."""

    spec = knobs.STEP_CLOCK

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if self.active(ex):
            self.refuse(ex.decode_step == "fused", "times the fused decode step's kernels, which run only with "
                        "decode_step=fused", "add execution.decode_step=fused, or drop execution.step_clock")

    def convert(self, model, ex, device, dtype) -> dict:
        return {self.manifest_key: "each fused-step launch's first program stores %globaltimer on entry and after "
                "its wait (step_clock.csv)" if self.active(ex) else "off"}


def request_number() -> int:
    """The number the next clocked request of this process will get (``numbered_stamps``)."""
    return _NEXT_REQUEST[0]


def numbered_stamps(model) -> list:
    """Every fused step's stamps kept since the last call as (request number, stamps), in request order
    over all the static decoders of ``model`` (``FusedCore.take_stamps`` of each clocked core), emptied."""
    out = []
    for dec in (getattr(model, "static_decoders", None) or {}).values():
        take = getattr(getattr(dec, "core", None), "take_stamps", None)
        if take is not None:
            out += take()
    return sorted(out, key=lambda x: x[0])


def clock_stamps(model) -> list:
    """``numbered_stamps`` without the numbers: one list of stamps per request, in request order."""
    return [stamps for _, stamps in numbered_stamps(model)]


FUSED_STEP = FusedStep()
PDL = Pdl()
STEP_CLOCK = StepClock()
