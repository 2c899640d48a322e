"""The one typed config tree of the harness: ``HarnessConfig``, the schema of ``conf/``.

``register()`` stores ``HarnessConfig`` in Hydra's ConfigStore as ``harness_schema``;
``conf/config.yaml`` lists it first in its defaults, so every YAML file and every command-line
override is merged onto these dataclasses: an unknown key or a value of the wrong type is refused
by OmegaConf while the config is composed. ``validate`` adds the checks a type cannot express
(allowed choices, ranges). The CLI converts the composed config once (``to_config``) and hands the
typed object to every verb; no code below the CLI reads a raw dict.

Named executions are the config group ``conf/execution/`` (``vendor-style``, ``best``,
``best-fused``): each file sets ``execution_name`` and the ``execution.*`` knobs that differ from
the defaults, so ``execution=best`` on the command line composes onto ``ExecutionConfig`` like any
YAML file (``execution.pdl=false`` on top). An experiment loads the ones its cases name into
``executions`` (``- /execution@executions.best: best`` in its defaults) and a case names one with
``execution_name: best``; ``to_config`` resolves those names (``resolve_case_executions``).

Defaults equal the vendor's DeepSeek-OCR checkpoint (``shared/reference/deepseek-ocr/config.json``),
so a model built from an empty config has exactly the checkpoint's tensor names and shapes. The
YAML files under ``conf/`` hold only what differs from these defaults. Field metadata carries
``choices`` and ``min``; ``validate`` reads them (one place per rule).

(No ``from __future__ import annotations`` here: OmegaConf reads the field types at run time.)
"""
import dataclasses
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from .attn_support import check_flash_attn
from .bench.config import BenchConfig
from .errors import HarnessError
from .pdf_pages import VENDOR_PDF_DPI
from .anatomy.stages import STAGES

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "sdpa_flash", "flash_attention_2")
DEVICES_HELP = "device=auto, device=cpu, device=cuda or device=cuda:N"


def _f(default, *, choices=None, min=None, default_factory=None):
    """A dataclass field whose metadata ``validate`` checks: ``choices`` (allowed values), ``min``."""
    meta = {}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if min is not None:
        meta["min"] = min
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------ model

@dataclass
class LLMConfig:
    """DeepSeek-V2-style decoder (``use_mla: false``: plain MHA)."""

    vocab_size: int = _f(129280, min=1)
    hidden_size: int = _f(1280, min=1)
    num_layers: int = _f(12, min=1)
    num_heads: int = _f(10, min=1)
    num_kv_heads: int = _f(10, min=1)
    intermediate_size: int = _f(6848, min=1)        # dense SwiGLU of layers < first_k_dense_replace
    moe_intermediate_size: int = _f(896, min=1)     # per routed expert
    n_routed_experts: int = _f(64, min=1)
    n_shared_experts: int = _f(2, min=0)            # shared expert width = 2 x 896 = 1792
    num_experts_per_tok: int = _f(6, min=1)
    first_k_dense_replace: int = _f(1, min=0)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = _f(8192, min=1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class SAMConfig:
    """SAM ViT-B image encoder with neck and the two stride-2 convs (net_2, net_3)."""

    img_size: int = _f(1024, min=1)                 # pretraining size: pos_embed is [1, 64, 64, 768]
    patch_size: int = _f(16, min=1)
    embed_dim: int = _f(768, min=1)
    depth: int = _f(12, min=1)
    num_heads: int = _f(12, min=1)
    mlp_ratio: float = 4.0
    out_chans: int = _f(256, min=1)
    window_size: int = _f(14, min=1)
    global_attn_indexes: List[int] = field(default_factory=lambda: [2, 5, 8, 11])
    downsample_channels: List[int] = field(default_factory=lambda: [512, 1024])
    ln_eps: float = 1e-6


@dataclass
class CLIPConfig:
    """CLIP-L over SAM features (its own patch conv exists in the checkpoint but is unused)."""

    hidden_size: int = _f(1024, min=1)
    num_layers: int = _f(24, min=1)
    num_heads: int = _f(16, min=1)
    ffn_hidden_size: int = _f(4096, min=1)
    image_size: int = _f(224, min=1)
    patch_size: int = _f(14, min=1)
    ln_eps: float = 1e-5
    pre_ln_eps: float = 1e-5


@dataclass
class ProjectorConfig:
    input_dim: int = _f(2048, min=1)                # CLIP hidden + SAM net_3 channels
    n_embed: int = _f(1280, min=1)                  # LLM hidden


@dataclass
class ExecutionConfig:
    """How the reference model executes (``execution.*``: same weights, same function; each knob
    recorded in the manifest). The defaults are the vendor's execution: host-bound, what users of
    its code get. Each knob is one converter of ``harness.variants`` (its ``check`` says where and
    with what it runs; a combination that cannot run is refused before any model is built).

    * ``kv_cache``: ``growing`` (torch.cat per step, as HF DynamicCache) | ``static`` (per-layer K/V
      preallocated for ``static_cache_len`` positions, written in place at device-side positions;
      decode attends over the whole buffer with a mask; ``variants.static_cache``).
    * ``moe_impl``: ``vendor_loop`` (per-expert Python loop after a device-to-host copy of the counts:
      one host sync per MoE layer) | ``grouped`` (routing, token sort, offsets and expert GEMMs on the
      device, no sync; ``moe_kernel`` picks how).
    * ``moe_kernel``: ``auto`` (triton on CUDA, else torch) | ``triton`` | ``grouped_mm``
      (``torch._grouped_mm``: sync-free on sm90 bf16 only) | ``torch`` (gather + bmm).
    * ``cuda_graphs``: ``none`` | ``decode`` (the decode step captured once per batch size and
      cache length and replayed; needs ``kv_cache=static`` and ``moe_impl=grouped``).
    * ``compile``: torch.compile the static-cache decode step (compile time reported apart from
      run time); needs ``kv_cache=static`` and ``moe_impl=grouped`` (only that step is compiled).
    * ``static_cache_len``: positions of the static cache; None: prefill + decode tokens rounded up
      to a multiple of 64.
    * ``vision_impl``: ``vendor`` | ``fused``: SAM's global blocks attend without the dense rel-pos
      mask (q and k augmented with the decomposed terms, ``variants.sam_attention``; exact), and on
      CUDA each of sam / clip / projector is captured in a CUDA graph per input shape and replayed.
    * ``sam_attention``: with ``vision_impl=fused``, how SAM's attention adds its decomposed rel-pos
      bias. ``sdpa``: torch SDPA (the windowed blocks with the vendor's dense mask, the global blocks
      on the augmented head dim) | ``triton-windows``: the windowed blocks by the Triton kernel that
      adds the bias inside (``kernels.sam_attention_triton``: no mask, no wider head dim), the global
      blocks as with sdpa | ``triton``: every block by it
      (``variants.sam_triton``); needs a device where Triton runs.
    * ``prefill_graphs``: capture the prefill forward (static cache, grouped MoE) per request shape.
    * ``prefill_compile``: with ``prefill_graphs``, the prefill forward torch.compile'd (inductor: norms,
      RoPE, residuals and activations fused around the GEMMs) per request shape before its graph is
      captured; compile time reported apart (``variants.prefill_compile``).
    * ``vision_compile``: with ``vision_impl=fused`` on CUDA, each SAM and CLIP block is
      torch.compile'd (window partition/padding, norms, GELU and residuals fused around the GEMMs and
      attention) before its stage's CUDA graph is captured; compile time reported apart.
    * ``linear_impl``: ``vendor`` (each nn.Linear its own GEMM) | ``fused``: q/k/v and each SwiGLU's
      gate/up held as one weight (views: the state_dict is unchanged) and run as one GEMM; at one
      token (batch-1 decode) the LLM's linears with K <= 2048 run as Triton GEMV kernels
      (``variants.fused_linears``; the SwiGLU's gate/up/silu/product in one kernel), the router's
      softmax, top-k, scale and routing count one Triton kernel after its fp32 GEMV
      (``kernels.router_triton``); with the static cache, q/k/v, RoPE and the KV write one kernel
      (``gemv_triton.gemv_qkv_rope``); with moe_kernel=triton, the shared expert extra rows of the
      routed-expert kernels (``fast_moe_triton.routed_experts_rows``).
    * ``decode_attention``: the static cache's decode attention. ``sdpa``: torch SDPA over the whole
      static buffer with a mask | ``triton``: a split-KV Triton kernel
      (``kernels.decode_attention_triton``) that reads only positions 0..pos, the position read on the
      device; needs ``kv_cache=static`` and a device where Triton runs.
    * ``decode_step``: ``modules`` (the decode step runs the model's modules as the knobs above
      convert them) | ``fused``: at batch 1 the whole decode step as the fused Triton kernels of
      ``kernels.decode_step`` (72 launches, inside the decode CUDA graph on CUDA; the prefill keeps
      its path; ``variants.fused_step``); needs kv_cache=static, moe_impl=grouped, linear_impl=fused,
      decode_attention=triton and, on CUDA, cuda_graphs=decode (not compile).
    * ``pdl``: launch the fused step's kernels with programmatic dependent launch (each kernel's
      first weight loads overlap the previous kernel's tail); needs decode_step=fused and sm90+.
    * ``step_clock``: the fused step's kernels also time themselves (``FusedDecodeStep(clock_rows=...)``:
      each launch's first program stores %globaltimer on entry and after its wait); the run writes the
      median request's stamps to step_clock.csv and the report's per-module table of the step from
      them. Instrumentation, not a speed-up: it adds two timer reads and two stores per launch
      (``docs/kernels/decode_step.md``); needs decode_step=fused.
    * ``preprocess``: where a page becomes the model's pixels. ``host``: the vendor's PIL resize,
      pad, normalisation and tiles on the host, float32 copied to the device | ``device``: the page's
      8-bit pixels copied, then resized, padded, normalised and tiled on the device with PIL's
      arithmetic (``harness.preprocess_device``: the same bytes as PIL).
    * ``prefill_logits``: which prompt positions the prefill's lm_head runs on. ``all``: every one, as
      the vendor does (``model.lm_head_all_positions``) | ``last``: the last position of each sequence
      only, the one greedy decoding reads (``variants.prefill_logits``: the same first token; at a
      batch of 128 base pages the vendor's way computes and casts 4.7 G logits that nothing reads).
    """

    kv_cache: str = _f("growing", choices=("growing", "static"))
    moe_impl: str = _f("vendor_loop", choices=("vendor_loop", "grouped"))
    moe_kernel: str = _f("auto", choices=("auto", "triton", "grouped_mm", "torch"))
    cuda_graphs: str = _f("none", choices=("none", "decode"))
    compile: bool = False
    static_cache_len: Optional[int] = _f(None, min=1)
    vision_impl: str = _f("vendor", choices=("vendor", "fused"))
    sam_attention: str = _f("sdpa", choices=("sdpa", "triton-windows", "triton"))
    prefill_graphs: bool = False
    linear_impl: str = _f("vendor", choices=("vendor", "fused"))
    vision_compile: bool = False
    decode_attention: str = _f("sdpa", choices=("sdpa", "triton"))
    decode_step: str = _f("modules", choices=("modules", "fused"))
    pdl: bool = False
    step_clock: bool = False
    preprocess: str = _f("host", choices=("host", "device"))
    prefill_logits: str = _f("all", choices=("all", "last"))
    prefill_compile: bool = False

    @staticmethod
    def positions(prefill_tokens: int, decode_tokens: int) -> int:
        """Positions a request needs in a static cache [tokens]: prompt + decode tokens (at least 1)."""
        return prefill_tokens + max(decode_tokens, 1)

    def cache_len(self, prefill_tokens: int, decode_tokens: int) -> int:
        """Positions a static cache holds for a request [tokens] (``positions`` rounded up to 64 by default)."""
        need = self.positions(prefill_tokens, decode_tokens)
        return self.static_cache_len if self.static_cache_len else -(-need // 64) * 64

    def execution(self) -> dict:
        """The execution knobs as a plain dict (manifest, report)."""
        return {f.name: getattr(self, f.name) for f in fields(ExecutionConfig)}


@dataclass
class ModelConfig:
    """Which model and how it is built: what it *is* (how it runs is ``ExecutionConfig``,
    ``HarnessConfig.execution``)."""

    name: str = _f("reference", choices=("reference", "vendor"))
    path: Optional[str] = None             # model directory (safetensors, tokenizer, vendor code)
    weights: str = _f("random", choices=("random", "path"))   # path: load safetensors from `path`
    attn_implementation: str = _f("sdpa", choices=ATTN_IMPLEMENTATIONS)
    lm_head_all_positions: bool = True     # vendor applies lm_head to every prefill position
    image_token_id: int = 128815
    bos_token_id: int = 0
    eos_token_id: int = 1
    init_std: float = 0.02                 # std of the seeded random initialisation
    # model=vendor only: who drives the decode loop (ours: the harness's greedy loop; hf_generate: the
    # vendor's own HF generate with infer()'s arguments) and the entry point (infer: its infer() on the page file)
    vendor_loop: str = _f("ours", choices=("ours", "hf_generate"))
    vendor_entry: str = _f("generate", choices=("generate", "infer"))
    # model=vendor only: the model directory's own Python code may run (transformers' trust_remote_code).
    # false: model=vendor is refused, naming the files; the reference and tiny models never run such code
    trust_remote_code: bool = False
    llm: LLMConfig = field(default_factory=LLMConfig)
    sam: SAMConfig = field(default_factory=SAMConfig)
    clip: CLIPConfig = field(default_factory=CLIPConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)


@dataclass
class CostModelConfig(ModelConfig, ExecutionConfig):
    """What the analytic cost model reads (``harness.analytic``): the model (``ModelConfig``) and
    the knobs of the execution that change its work (``harness.knobs.cost_knobs``: the KV cache,
    the routed-expert kernel, the decode attention, the SAM attention), in one object. Not part of
    the Hydra config: built by ``cost_config`` (or read back from a manifest's ``model`` and
    ``execution``)."""


def cost_config(model: Optional[ModelConfig] = None, knobs: Optional[dict] = None) -> CostModelConfig:
    """``model`` (None: the vendor checkpoint's) with the execution knobs ``knobs`` as one
    ``CostModelConfig``; knobs not given keep ``model``'s (a ``CostModelConfig``) or the vendor's
    execution. A ``CostModelConfig`` without ``knobs`` is returned as is."""
    if isinstance(model, CostModelConfig) and not knobs:
        return model
    model = model or ModelConfig()
    kept = {f.name: getattr(model, f.name) for f in fields(CostModelConfig) if hasattr(model, f.name)}
    return CostModelConfig(**{**kept, **(knobs or {})})


def logits_every_position(all_positions: bool, prefill_logits: str) -> bool:
    """Whether the prefill's lm_head runs on every prompt position: the model's ``lm_head_all_positions``
    (the vendor's way), unless the execution's ``prefill_logits=last`` keeps each sequence's last
    (``variants.prefill_logits``; the model's ``logits_all_positions`` and the cost model both ask here)."""
    return all_positions and prefill_logits == "all"


def prefill_logit_rows(cfg, batch: int, tokens: int) -> int:
    """Rows the prefill's lm_head runs on (``cfg``: a ``CostModelConfig``) for ``batch`` sequences of
    ``tokens`` prompt positions in all."""
    return tokens if logits_every_position(cfg.lm_head_all_positions, cfg.prefill_logits) else batch


#: the execution knobs (``execution.<knob>``; an old ``model.<knob>`` override is refused with this name)
EXECUTION_KNOBS = tuple(f.name for f in fields(ExecutionConfig))


# --------------------------------------------------------------------------------- workload

@dataclass
class WorkloadConfig:
    """What one request contains. Token counts are exact; sizes are pixels.

    Pages of a batch (``harness.setup.synthetic_pages``, ``harness.workload.batch_pages``): a batch of
    ``batch`` rows holds ``batch`` distinct pages. Synthetic pages (``images`` None) all have one size
    (``page_size``, default A4 portrait at 150 dpi), so a batch shares one tile grid. ``pages`` None:
    every request draws new pages; ``pages`` = P: a set of P distinct pages that the requests cycle
    through in batches (P >= ``batch``). Fewer distinct pages than ``batch`` (P < batch, a folder
    layout or an image file with fewer pages) is refused unless ``repeat_pages``: the batch is then
    made of copies (``pages`` unset: copies of one page) and the run says so.
    """

    mode: Any = "base"                     # tiny | small | base | large | gundam | {name, base_size, image_size, crop}
    images: Optional[str] = None           # image or PDF file (FILE.pdf#page=N: one page) or directory; None: synthetic
    pages: Optional[int] = _f(None, min=1)  # distinct synthetic pages requests cycle through; None: new per request
    page_size: Optional[List[int]] = None  # [width, height] of synthetic pages (pixels)
    batch: int = _f(1, min=1)              # pages decoded together in one request (same layout)
    repeat_pages: bool = False             # allow a batch of copies when fewer distinct pages than `batch` exist
    decode_tokens: int = _f(128, min=0)    # fixed greedy decode budget (EOS ignored)
    prompt: str = "<image>\n<|grounding|>Convert the document to markdown. "
    text_tokens: int = _f(12, min=0)       # prompt text tokens (BOS excluded) when there is no tokenizer
    seed: int = 0
    max_pixels: int = _f(60_000_000, min=1)  # larger pages are refused with a clear error
    # dots per inch PDF pages are rasterised at (harness.pdf_pages: ceil(points x dpi / 72) pixels a side, on
    # white): 144, what DeepSeek-OCR's own PDF script (run_dpsk_ocr_pdf.py) uses; an A4 page is then 1191 x 1684
    pdf_dpi: float = _f(float(VENDOR_PDF_DPI), min=1)
    # MoE routing: weights (the checkpoint's own; parity depends on it) | balanced (each token's top-k drawn
    # uniformly without repeats per layer from routing_seed, its page and position; harness.models.routing)
    routing: str = _f("weights", choices=("weights", "balanced"))
    routing_seed: int = 0


def check_page_size(w: WorkloadConfig, where: str = "") -> None:
    """Refuse a ``page_size`` that is not [width, height] in pixels (``where``: a prefix naming the case)."""
    ps = w.page_size
    if ps is not None and (len(ps) != 2 or min(ps) < 1):
        raise HarnessError(f"{where}workload.page_size={list(ps)} is not [width, height] in pixels",
                           "write it as [1240, 1754]")


def _optional_fields(cls) -> list:
    """``cls``'s fields as Optional with default None (an override: None = inherited), metadata kept."""
    return [(f.name, Optional[f.type] if f.type is not Any else Any, field(default=None, metadata=f.metadata))
            for f in fields(cls)]


#: the execution knobs one case overrides (None: as in ``execution``)
ExecutionOverrides = dataclasses.make_dataclass("ExecutionOverrides", _optional_fields(ExecutionConfig))
ExecutionOverrides.__doc__ = "Execution knobs of one case (None = as in ``execution``)."

#: one entry of ``cases``: a name, the workload fields that differ from ``workload`` and the
#: execution knobs that differ from ``execution`` (the model is built once; its execution varies per case)
CaseConfig = dataclasses.make_dataclass(
    "CaseConfig", [("name", Optional[str], field(default=None))] + _optional_fields(WorkloadConfig)
    + [("execution_name", Optional[str], field(default=None)),
       ("execution", Optional[ExecutionOverrides], field(default=None))])
CaseConfig.__doc__ = ("One case of an experiment: ``name``, workload overrides, a named execution "
                      "(``execution_name``: its knobs, ``resolve_case_executions``) and ``execution`` overrides "
                      "on top (None = as in ``workload`` / ``execution``).")


@dataclass
class NamedExecution:
    """One file of the ``conf/execution/`` group as an experiment loads it into ``executions``
    (``- /execution@executions.<name>: <name>``): its name and the knobs that differ from the
    defaults (None = not set by it)."""

    execution_name: Optional[str] = None
    execution: ExecutionOverrides = field(default_factory=ExecutionOverrides)


# ---------------------------------------------------------------------------------- measure

@dataclass
class MeasureConfig:
    """How each case is timed (see ``harness.measure.runner``)."""

    warmup: Optional[int] = _f(None, min=0)     # None: 2 on CUDA, 0 on the CPU (the minimum; see steady_pct)
    steady_pct: float = _f(0.0, min=0)          # > 0: warm up past ``warmup`` until the last 3 are within it (%)
    max_warmup: int = _f(8, min=0)              # cap on warm-ups when steady_pct > 0
    repeats: Optional[int] = _f(None, min=1)    # None: 5 on CUDA, 1 on the CPU
    nvtx: bool = True
    events: bool = True
    kernels: bool = False
    trace: bool = True              # with kernels: save the profiled request as traces/<case>/trace.json.gz (Perfetto)
    module_hooks: bool = True       # with kernels: forward hooks in the profiled request attribute kernels to modules
    layer_ranges: bool = False      # per-layer NVTX ranges (``layer``, payload = index)
    fresh_inputs: bool = True       # new synthetic pages per repeat (same layout); false: repeat 0's every time
    settle_ms: float = _f(0.0, min=0)   # GPU kept busy this long (matmuls) right before each timed request
    warmup_tokens: Optional[int] = _f(None, min=1)   # tokens of each warm-up request; None: the case's budget
    profile_steps: Optional[int] = _f(None, min=1)   # decode steps of the profiled request; None: all of them

    def resolved(self, cuda: bool) -> "MeasureConfig":
        """A copy with the device defaults filled in (warm-up 2 / repeats 5 on CUDA, 0 / 1 on the CPU)."""
        return dataclasses.replace(
            self, warmup=(2 if cuda else 0) if self.warmup is None else self.warmup,
            repeats=(5 if cuda else 1) if self.repeats is None else self.repeats)


@dataclass
class HardwareConfig:
    """Device ceilings for the roofline (``harness.roofline.specs``) and ``calibrate`` settings."""

    name: str = "auto"                     # auto | a spec key (h100-sxm, h200, ...) | a device name
    peak_tflops: Optional[float] = _f(None, min=0)   # dense TFLOP/s override for the run's dtype
    mem_bw_gbs: Optional[float] = _f(None, min=0)    # memory bandwidth override, GB/s (1e9 B/s)
    calibration: str = "auto"              # auto: cached record of this device | none | PATH.json
    calibrate: bool = True                 # run: measure (and cache) the ceilings when `auto` finds no record
    cache_dir: Optional[str] = None        # calibration cache; None -> $HARNESS_CACHE_DIR or ~/.cache/dsocr-harness
    gemm_size: Optional[int] = _f(None, min=1)
    gemm_dtype: Optional[str] = _f(None, choices=("bf16", "fp16", "fp32"))
    copy_mib: Optional[int] = _f(None, min=1)
    read_mib: Optional[int] = _f(None, min=1)      # read stream buffer; None: 8 x L2 (>= 256 MiB) on a GPU, 256 on the CPU
    warmup: Optional[int] = _f(None, min=0)
    iters: Optional[int] = _f(None, min=1)


@dataclass
class ProfileConfig:
    """The ``profile`` verb (ncu / nsys over one stage's NVTX range)."""

    decode_tokens: int = _f(4, min=1)      # the profiled request's budget unless workload.decode_tokens is given
    launch_count: int = _f(4000, min=1)    # ncu --launch-count bound (kernels profiled in the stage)
    metrics: str = _f("all", choices=("all", "memory"))   # all: time, DRAM, tensor and SASS FLOPs; memory: time, DRAM
    nsys_range: str = _f("request", choices=("request", "stage"))   # nsys capture: every stage in one, or only `stage`
    nsys_warmup: int = _f(1, min=0)        # nsys: untimed requests before the captured one
    cuda_graph_trace: Optional[str] = _f(None, choices=("graph", "node"))   # None: node when execution.cuda_graphs is set


@dataclass
class RunConfig:
    name: str = "${experiment_name}"                     # run directory suffix: one folder name (check_run_name)
    root: str = "runs"                                   # where run directories are created
    only: Optional[List[str]] = None   # run only these of the experiment's cases, by name (run.only=[best,best-b32])
    memory_check: bool = True          # refuse, before building the model, a run that cannot fit in free memory


@dataclass
class TokensConfig:
    """A seeded decode budget per page: uniform integers in [mean - spread, mean + spread] tokens,
    drawn once per distinct page (``harness.throughput.plan.page_budgets``); ``mean`` 0 (the default):
    none, every page decodes ``workload.decode_tokens``. (A set node, not None: an override such as
    ``'throughput.tokens={mean: 620, spread: 150}'`` cannot merge into a None node.)"""

    mean: int = _f(0, min=0)
    spread: int = _f(0, min=0)
    seed: int = 0


@dataclass
class ThroughputConfig:
    """``+experiment=throughput``: sustained pages/s of the OCR pipeline (``harness.throughput``).
    None = the device's default (CUDA / CPU); the run's manifest records what was used.

    * ``batches``: batch sizes swept in one run, model built once (None: [1, 8, 32, 64] / [1, 2]).
    * ``workers``: preprocessing processes (None: the CPU count - 2, between 1 and 8).
    * ``pages``: distinct synthetic pages N (sizes cycled as ``workload.synthetic_page``), ignored with
      ``workload.images=DIR`` (the folder's pages) (None: 256 / 10).
    * ``window_s`` / ``window_pages``: the steady window closes at the first batch end where both are
      reached [s, pages] (None: 30 s and 0 pages / 0 s and 4 pages).
    * ``warmup_batches``: batches run before the window (compile, capture, pool warm-up) (None: 2 / 1).
    * ``tokens``: mean 0 (the default) = ``workload.decode_tokens`` for every page; else a seeded
      per-page distribution (``TokensConfig``).
    * ``best``: run the named execution ``best`` (``conf/execution/best.yaml``, loaded into
      ``executions.best`` by ``conf/experiment/throughput.yaml``) with the ``execution.*`` knobs that
      differ from the defaults on top (None: on CUDA; the CPU runs ``execution.*``).
    * ``execution``: execution knobs over all of that (each None = as above), e.g. ``vision_compile: false``.
    * ``prefetch``: batches prepared ahead of the one running (at least 2 x workers pages).
    * ``timeline_batches``: batches of each configuration drawn in ``throughput_timeline.png``.
    * ``gpus``: GPUs of this host measured at once, one process each (``harness.throughput.gpus``):
      ``1`` (the default), a count, or ``all`` (every visible GPU); with more than one, ``workers`` is
      per GPU (None: from the host's cores // gpus).
    * ``overlap_vision``: the next batch's vision (sam, clip, projector) runs on a stream of its own,
      launched when this batch's decode starts, so the compute-bound vision overlaps the memory-bound
      decode (``harness.throughput.ahead``); GPU busy is then the union of the stage spans. Off by
      default: the stages run one after another on one stream.
    """

    batches: Optional[List[int]] = None
    workers: Optional[int] = _f(None, min=1)
    pages: Optional[int] = _f(None, min=2)
    window_s: Optional[float] = _f(None, min=0)
    window_pages: Optional[int] = _f(None, min=0)
    warmup_batches: Optional[int] = _f(None, min=0)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    best: Optional[bool] = None
    execution: ExecutionOverrides = field(default_factory=ExecutionOverrides)
    prefetch: int = _f(2, min=1)
    timeline_batches: int = _f(3, min=1)
    gpus: str = "1"
    overlap_vision: bool = False


@dataclass
class HarnessConfig:
    """The whole configuration of one verb invocation."""

    model: ModelConfig = field(default_factory=ModelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    execution_name: Optional[str] = None   # the named execution chosen (execution=best); None: none named
    executions: Dict[str, NamedExecution] = field(default_factory=dict)   # named executions an experiment's cases use
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run: RunConfig = field(default_factory=RunConfig)
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    dtype: str = _f("auto", choices=("auto", "bf16", "fp16", "fp32"))   # auto: bf16 on CUDA, fp32 on the CPU
    seed: int = 0
    cases: Optional[List[CaseConfig]] = None   # workload overrides, one case each (experiments set this)
    tool: str = _f("ncu", choices=("ncu", "nsys"))                  # profile verb: which profiler
    stage: str = _f("decode", choices=STAGES)   # profile verb: the stage whose NVTX range is profiled
    experiment_name: str = "default"       # experiments set their own name; it names the run directory
    experiment_module: str = "harness.run"   # the run verb's experiment: its module's EXPERIMENT (harness.lifecycle)
    throughput: Optional[ThroughputConfig] = None   # set: the run verb measures the pipeline (harness.throughput)
    bench: Optional[BenchConfig] = None   # the bench verb: its target and options (harness.bench.config)


SCHEMA_NAME = "harness_schema"


def register() -> None:
    """Store ``HarnessConfig`` in Hydra's ConfigStore as ``harness_schema`` (conf/config.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=HarnessConfig)


# ------------------------------------------------------------------------------- conversion

def config_error(exc: Exception) -> HarnessError:
    """A one-line HarnessError for an OmegaConf/Hydra composition error (unknown key, wrong type)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc
    while getattr(cause, "__cause__", None) is not None and not isinstance(cause, (ConfigKeyError,
                                                                                    ConfigAttributeError,
                                                                                    ValidationError)):
        cause = cause.__cause__
    key = getattr(cause, "full_key", None) or ""
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        bad = key or text
        moved = moved_knob(bad)
        if moved is not None:
            return moved
        parent, _, leaf = bad.rpartition(".")
        known = _known_keys(parent)
        fix = (f"use one of {parent or 'the top-level'} keys: {', '.join(known)}" if known
               else "check the key's spelling against conf/ and harness.config")
        return HarnessError(f"unknown config key {bad!r} ({text})", fix)
    if isinstance(cause, ValidationError):
        if getattr(cause, "object_type", None) is CaseConfig:
            key = f"cases[].{key}"
        want = re.search(r"converted to (\w+)", text)
        example = _default_of(key)
        fix = (f"give {key} {'an' if want and want.group(1)[0] in 'AEIOU' else 'a'} "
               f"{want.group(1).lower() if want else 'value of its declared type'}"
               + (f", e.g. {key}={example}" if example is not None else ""))
        return HarnessError(f"bad value for {key or 'a config key'}: {text}", fix)
    whole = str(cause)
    if "Could not find '" in whole:
        what = whole.split("Could not find '", 1)[1].split("'", 1)[0]
        options = []
        if "Available options" in whole:
            for ln in whole.split("Available options", 1)[1].splitlines()[1:]:
                if not ln.startswith(("\t", " ")) or not ln.strip():
                    break
                options.append(ln.strip())
        return HarnessError(f"no config option {what!r}",
                            f"use one of {', '.join(options)}" if options else "check conf/ for the options")
    return HarnessError(f"the configuration could not be composed: {text}",
                        "check the override syntax (key=value, +key=value for new keys, group=option)")


def moved_knob(key: str, value: Optional[str] = None) -> Optional[HarnessError]:
    """The error for an execution knob under its old name ``model.<knob>`` (None for any other key)."""
    prefix, _, knob = key.lstrip("+~").rpartition(".")
    if prefix != "model" or knob not in EXECUTION_KNOBS:
        return None
    return HarnessError(f"model.{knob} moved to execution.{knob}",
                        f"use execution.{knob}={value if value is not None else '...'}")


def _default_of(dotted: str):
    """The schema default of a dotted key (None when unknown or unset)."""
    obj = HarnessConfig()
    for part in [p for p in dotted.split(".") if p and not p.startswith("cases[")]:
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj if not is_dataclass(obj) else None


def _known_keys(dotted: str) -> list:
    cls = HarnessConfig
    for part in [p for p in dotted.split(".") if p]:
        if part.isdigit():
            continue
        hit = next((f for f in fields(cls) if f.name == part), None)
        if hit is None:
            return []
        tp = hit.type
        if is_dataclass(tp):
            cls = tp
        elif getattr(tp, "__args__", None) and any(is_dataclass(a) for a in tp.__args__):
            cls = next(a for a in tp.__args__ if is_dataclass(a))
            while getattr(cls, "__args__", None):
                cls = next(a for a in cls.__args__ if is_dataclass(a))
        else:
            return []
    return [f.name for f in fields(cls)]


def _structured(cls, data):
    from omegaconf import OmegaConf

    base = OmegaConf.structured(cls)
    return OmegaConf.merge(base, data) if data is not None else base


def from_dict(cls, data: Any = None, strict: bool = True):
    """Build dataclass ``cls`` from a mapping, OmegaConf node or instance, with the schema's type
    checks. ``strict=False`` drops keys the schema does not know (reading an older run's
    manifest) instead of refusing them. Errors are one-line HarnessErrors."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(data, cls):
        return data
    if data is not None and OmegaConf.is_config(data):
        data = OmegaConf.to_container(data, resolve=True)
    if not strict and data is not None:
        data = _prune(cls, data)
    try:
        return OmegaConf.to_object(_structured(cls, data))
    except OmegaConfBaseException as exc:
        raise config_error(exc) from None


def _prune(cls, data):
    if not isinstance(data, dict):
        return data
    known = {f.name: f for f in fields(cls)}
    out = {}
    for k, v in data.items():
        if k not in known:
            continue
        tp = known[k].type
        if is_dataclass(tp):
            v = _prune(tp, v)
        elif k == "cases" and isinstance(v, list):
            v = [_prune(CaseConfig, c) for c in v]
        out[k] = v
    return out


def to_config(cfg) -> HarnessConfig:
    """The composed config (DictConfig) -> a validated ``HarnessConfig``, its cases' named
    executions resolved. The one conversion."""
    hc = resolve_case_executions(from_dict(HarnessConfig, cfg))
    validate(hc)
    return hc


def resolve_case_executions(cfg: HarnessConfig) -> HarnessConfig:
    """``cfg`` with each case's ``execution_name`` resolved: its ``execution`` = the named
    execution's knobs (``cfg.executions``) with the case's own knobs on top. A name the config did
    not load is refused in one line naming those it did."""
    if not any(c.execution_name for c in cfg.cases or []):
        return cfg
    cases = []
    for i, case in enumerate(cfg.cases):
        if case.execution_name is not None:
            named = cfg.executions.get(case.execution_name)
            if named is None:
                raise HarnessError(f"cases[{i}].execution_name={case.execution_name!r} names no execution this config "
                                   f"loads ({', '.join(sorted(cfg.executions)) or 'none'})",
                                   f"name one of them, or load conf/execution/{case.execution_name}.yaml in the "
                                   f"experiment's defaults (- /execution@executions.{case.execution_name}: "
                                   f"{case.execution_name})")
            own = case.execution or ExecutionOverrides()
            case = dataclasses.replace(case, execution=ExecutionOverrides(**{
                f.name: getattr(named.execution, f.name) if getattr(own, f.name) is None else getattr(own, f.name)
                for f in fields(ExecutionOverrides)}))
        cases.append(case)
    return dataclasses.replace(cfg, cases=cases)


def to_dict(obj) -> dict:
    """A config dataclass as a plain dict (the manifest's ``config``)."""
    return dataclasses.asdict(obj)


# ------------------------------------------------------------------------------- validation

def _check_field(path: str, f, value) -> None:
    choices, lo = f.metadata.get("choices"), f.metadata.get("min")
    if value is None:
        return
    if choices is not None and value not in choices:
        raise HarnessError(f"{path}={value!r} is not one of {', '.join(map(str, choices))}",
                           f"set {path} to one of {', '.join(map(str, choices))}")
    if lo is not None and value < lo:
        raise HarnessError(f"{path}={value!r} is below its minimum {lo}", f"set {path} to {lo} or more")


def _walk(obj, prefix: str) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if is_dataclass(value):
            _walk(value, path + ".")
        else:
            _check_field(path, f, value)


def case_execution(execution: ExecutionConfig, case) -> ExecutionConfig:
    """``execution`` with the case's execution overrides applied (what the case runs)."""
    ov = getattr(case, "execution", None)
    if ov is None:
        return execution
    return dataclasses.replace(execution, **{f.name: getattr(ov, f.name) for f in fields(ov)
                                             if getattr(ov, f.name) is not None})


def check_vendor_execution(cfg: "HarnessConfig") -> None:
    """The vendor code runs as shipped: with ``model=vendor`` any execution knob off its default
    (in ``execution`` or a case's) is refused once, naming it."""
    if cfg.model.name != "vendor":
        return
    default = ExecutionConfig()
    where = [("execution", cfg.execution)] + [(f"cases[{i}].execution", case_execution(cfg.execution, c))
                                             for i, c in enumerate(cfg.cases or [])]
    for prefix, ex in where:
        for knob in EXECUTION_KNOBS:
            if getattr(ex, knob) != getattr(default, knob):
                raise HarnessError(f"{prefix}.{knob}={getattr(ex, knob)} applies to the reference model only; the "
                                   "vendor code runs as shipped", f"drop execution.{knob} with model=vendor, or use "
                                   "model=reference")


def check_routing(cfg: "HarnessConfig") -> None:
    """``workload.routing=balanced`` (in ``workload`` or a case's) runs in the reference model's gate:
    refused with ``model=vendor`` (its code runs as shipped)."""
    where = [("workload", cfg.workload.routing)] + [(f"cases[{i}]", c.routing) for i, c in enumerate(cfg.cases or [])]
    for prefix, routing in where:
        if routing in (None, "weights"):
            continue
        if cfg.model.name == "vendor":
            raise HarnessError(f"{prefix}.routing={routing} forces the reference model's gate; the vendor code runs "
                               "as shipped", "drop workload.routing with model=vendor, or use model=reference")


def validate(cfg: HarnessConfig) -> HarnessConfig:
    """Refuse values the types allow but the harness does not (choices, ranges, the device
    string), with one-line HarnessErrors. Returns ``cfg``."""
    _walk(cfg, "")
    for i, case in enumerate(cfg.cases or []):
        _walk(case, f"cases[{i}].")
    check_vendor_execution(cfg)
    check_routing(cfg)
    dev = str(cfg.device)
    if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise HarnessError(f"device={dev!r} is not a device the harness runs on", f"use {DEVICES_HELP}")
    check_page_size(cfg.workload)
    check_run_name(cfg.run.name)
    check_vendor_knobs(cfg.model)
    if dev == "cpu":    # device=auto is checked once resolved, before the model is built (harness.setup)
        check_flash_attn(cfg.model.attn_implementation, "cpu")
    if cfg.throughput is not None:
        check_throughput(cfg.throughput)
    if cfg.run.only is not None and not cfg.run.only:   # names are checked against the run's cases (harness.setup)
        raise HarnessError("run.only=[] selects no case", "name cases as the run prints them, or drop run.only")
    return cfg


def check_throughput(t: ThroughputConfig) -> None:
    """Throughput settings a type cannot check: batch sizes, a batch larger than the synthetic pages,
    a decode distribution reaching below one token (one-line HarnessErrors)."""
    batches = list(t.batches or [])
    if t.batches is not None and (not batches or min(batches) < 1 or len(set(batches)) != len(batches)):
        raise HarnessError(f"throughput.batches={batches} is not a list of distinct batch sizes >= 1",
                           "write it like throughput.batches=[1,8,32,64]")
    if t.pages is not None and batches and max(batches) > t.pages:
        raise HarnessError(f"throughput.batches={batches}: a batch of {max(batches)} pages is larger than the "
                           f"{t.pages} distinct pages (throughput.pages)",
                           f"set throughput.pages={max(batches)} or more, or lower the batch")
    if t.tokens.mean == 0 and (t.tokens.spread or t.tokens.seed):
        raise HarnessError(f"throughput.tokens: spread {t.tokens.spread} / seed {t.tokens.seed} without a mean "
                           "(mean 0: every page decodes workload.decode_tokens)", "set throughput.tokens.mean too")
    if t.tokens.mean and t.tokens.spread >= t.tokens.mean:
        raise HarnessError(f"throughput.tokens: spread {t.tokens.spread} reaches below 1 token around mean "
                           f"{t.tokens.mean}", f"set throughput.tokens.spread to {t.tokens.mean - 1} or less")


def check_run_name(name: str) -> None:
    """``run.name`` ends the run directory's name (``run.root/<time>-<name>``): one folder name, so
    no path separator, and neither empty nor starting with a dot (``..``, hidden names)."""
    why = ("is empty" if not name else "holds a path separator" if "/" in name or "\\" in name
           else "starts with a dot" if name.startswith(".") else "holds a NUL byte" if "\0" in name else None)
    if why:
        raise HarnessError(f"run.name={name!r} {why}: it names one folder under run.root (<time>-<name>)",
                           "give run.name one folder name without '/' or '\\' that does not start with '.', e.g. "
                           "run.name=my-run (run.root chooses the parent folder)")


def check_vendor_knobs(m: ModelConfig) -> None:
    """``vendor_loop`` / ``vendor_entry`` choose how the vendor code runs, ``trust_remote_code``
    whether it may: refused for another model (which runs no code from a directory)."""
    if m.name != "vendor" and (m.vendor_loop != "ours" or m.vendor_entry != "generate"):
        raise HarnessError(f"model.vendor_loop={m.vendor_loop} / model.vendor_entry={m.vendor_entry} apply to "
                           f"model=vendor only (model.name={m.name})",
                           "drop them, or run model=vendor model.path=DIR")
    if m.name != "vendor" and m.trust_remote_code:
        raise HarnessError(f"model.trust_remote_code=true applies to model=vendor only (model.name={m.name} runs "
                           "no code from a directory)", "drop model.trust_remote_code")


register()   # at import, so any Hydra composition of conf/ (the CLI, tests, user code) finds the schema

__all__ = ["LLMConfig", "SAMConfig", "CLIPConfig", "ProjectorConfig", "ExecutionConfig", "ExecutionOverrides",
           "ModelConfig", "CostModelConfig", "cost_config", "EXECUTION_KNOBS", "WorkloadConfig", "check_page_size",
           "CaseConfig", "NamedExecution", "resolve_case_executions", "case_execution", "check_vendor_execution",
           "check_routing", "check_run_name", "moved_knob",
           "TokensConfig",
           "ThroughputConfig",
           "check_throughput",
           "MeasureConfig", "HardwareConfig", "ProfileConfig", "RunConfig", "HarnessConfig", "ATTN_IMPLEMENTATIONS",
           "register", "from_dict", "to_config", "to_dict", "validate", "config_error", "SCHEMA_NAME"]
