"""The vendor's ``infer()`` as the entry of a request (``model.vendor_entry=infer``).

``InferEntry`` is a ``VendorOCR``'s ``generate_own``: it calls the vendor model's own
``infer(tokenizer, prompt, image_file, output_path, base_size, image_size, crop_mode)`` on the
request's page file, so the vendor's preprocessing (image load, padding, tiling, its tokenizer
and prompt template), its streamer and its bf16 autocast run as users of the vendor code get
them. Ranges come from ``harness.models.vendor.hf_generate.GenerateRanges``; the time from the
start of ``infer()`` to its call of ``generate`` is the ``preprocess`` range (inside
``request``, outside the five stages).

What ``infer()`` does that the harness bounds:

- ``generate`` is reached through an instance attribute for the call: its arguments are recorded
  (``info["loop"]["infer_generate_kwargs"]``) and ``max_new_tokens=8192`` is replaced by the case's
  budget, with ``min_new_tokens`` equal to it (EOS masked: fixed budget, as every harness loop);
- its output directory (it creates ``output_path/images``; nothing else with
  ``save_results=False``) is ``workdir/out``; what it prints (the vendor forward's shapes, the
  streamed text) is captured, the last request's in ``workdir/infer_stdout.txt``;
- it calls ``disable_torch_init()``, which replaces ``nn.Linear.reset_parameters`` and
  ``nn.LayerNorm.reset_parameters`` process-wide: both are restored afterwards;
- it hard-codes ``.cuda()``: on a CPU device ``Tensor.cuda`` is a no-op while it runs.

``infer()`` takes one image file: a request must hold one page (batch 1, ``one_page``). A page from
a file is passed as that file; a synthetic page is saved as a PNG under ``workdir/pages`` first
(outside the request's ranges).

``call_infer`` (infer() with a stand-in ``generate``, in the sandbox above) is also what the ``graph``
verb uses to get the inputs infer() builds (``harness.callgraph.vendor.infer_request``).
"""
from __future__ import annotations

import contextlib
import io
import re
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ...errors import HarnessError
from ..adapter import GenerationResult, StageFn
from .loader import _transformers_quiet
from .compat import cuda_noop_on_cpu
from .hf_generate import BUDGET, GenerateRanges, _budget

INFER_MAX_NEW_TOKENS = 8192        # what infer() asks generate for
STDOUT_FILE = "infer_stdout.txt"


class InferEntry:
    """``generate_own`` of ``vendor_entry=infer``: one request through the vendor's ``infer()``."""

    def __init__(self, ocr, tokenizer, tokenizer_source: str = "", workdir=None):
        self.ocr = ocr
        self.tokenizer = tokenizer
        self.tokenizer_source = tokenizer_source
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="harness-infer-"))
        self.stdout = ""

    def describe(self) -> dict:
        """What runs, for the manifest (``info["loop"]``); the arguments infer() gave generate are
        added after the first request (``infer_generate_kwargs``)."""
        return {"loop": "hf_generate (the vendor's generate, called by its infer())", "entry": "infer",
                "tokenizer": self.tokenizer_source, "workdir": str(self.workdir),
                "infer_args": {"base_size / image_size / crop_mode": "from workload.mode", "save_results": False,
                               "test_compress": False, "eval_mode": False},
                "overrides": {"max_new_tokens": f"{INFER_MAX_NEW_TOKENS} -> {BUDGET}",
                              "min_new_tokens": f"{BUDGET} (EOS masked until then: fixed budget)"},
                "preprocess": "infer()'s own (range `preprocess`, before generate is entered)"}

    def page_file(self, page) -> Path:
        """The page's image file: its source when that is a file, else a PNG saved under ``workdir/pages``."""
        src = Path(str(page.source))
        if src.is_file():
            return src
        pages = self.workdir / "pages"
        pages.mkdir(parents=True, exist_ok=True)
        out = pages / (re.sub(r"[^A-Za-z0-9_.-]", "_", f"{page.name}-{page.source}") + ".png")
        page.image.save(out)
        return out

    def call_infer(self, image_file: Path, request, generate) -> None:
        """The vendor's ``infer()``, unmodified, on ``image_file`` with ``request``'s prompt and crop mode
        and infer()'s other arguments as ``describe`` lists them; ``generate`` stands in for the vendor
        model's own for this call (an instance attribute, removed afterwards), inside ``_sandbox``. What
        infer() printed is kept in ``stdout`` (``save_stdout`` writes it)."""
        ocr, mode = self.ocr, request.mode
        buf = io.StringIO()
        object.__setattr__(ocr.hf, "generate", generate)
        try:
            with _sandbox(ocr.device, buf, ocr.quiet):
                ocr.hf.infer(self.tokenizer, prompt=request.prompt, image_file=str(image_file),
                             output_path=str(self.workdir / "out"), base_size=mode.base_size,
                             image_size=mode.image_size, crop_mode=mode.crop, test_compress=False,
                             save_results=False, eval_mode=False)
        finally:
            del ocr.hf.generate
            self.stdout = buf.getvalue()

    def save_stdout(self) -> Path:
        """``workdir/infer_stdout.txt``: what the last infer() printed."""
        out = self.workdir / STDOUT_FILE
        out.write_text(self.stdout)
        return out

    def __call__(self, request, stage: StageFn, max_new_tokens: int) -> GenerationResult:
        ocr = self.ocr
        n_new = _budget(max_new_tokens)
        image_file = self.page_file(one_page(request))
        counter = ocr.routing_counter()
        seen: dict = {}
        with ocr.routing_hooks(counter), GenerateRanges(ocr, stage, counter) as ranges, stage("request"):
            t0 = time.perf_counter()
            ranges.seg.switch("preprocess")
            try:
                self.call_infer(image_file, request, _bounded(ocr.hf.generate, ranges, n_new, seen))
            except BaseException as exc:
                ranges.seg.close(exc)  # preprocess, when infer() failed before generate
                raise
            host_ms = (time.perf_counter() - t0) * 1e3
        self.save_stdout()
        if "output" not in seen:
            raise not_called()
        loop = ocr.info["loop"]
        loop.setdefault("infer_generate_kwargs", seen["kwargs"])
        loop["infer_prompt_tokens"] = seen["prompt_tokens"]
        return ranges.result(seen["output"][:, seen["prompt_tokens"]:], n_new, {"request": host_ms},
                             prompt_tokens=seen["prompt_tokens"])


def one_page(request):
    """The request's one source page (the vendor's infer() takes one image file), or the one-line
    HarnessError of a request of several."""
    if request.batch != 1 or len(request.source_pages) != 1:
        raise HarnessError(f"model.vendor_entry=infer runs one page per request (the vendor's infer() takes one "
                           f"image file); this request has batch {request.batch} and "
                           f"{len(request.source_pages)} source page(s)", "use workload.batch=1")
    return request.source_pages[0]


def not_called() -> HarnessError:
    """What is said when infer() returned without calling generate."""
    return HarnessError("the vendor's infer() returned without calling generate",
                        "check the prompt holds <image> and the snapshot's code is unmodified")


def _bounded(generate, ranges: GenerateRanges, n_new: int, seen: dict):
    """``generate`` as infer() will call it: arguments recorded, the budget fixed, ranges begun and ended."""
    def call(input_ids, **kwargs):
        seen["prompt_tokens"] = int(input_ids.shape[1])
        seen["kwargs"] = {k: describe_value(v) for k, v in kwargs.items()}
        kwargs.update(max_new_tokens=n_new, min_new_tokens=n_new)
        ranges.begin()
        try:
            out = generate(input_ids, **kwargs)
        except BaseException as exc:
            ranges.end(exc)
            raise
        ranges.end()
        seen["output"] = out
        return out
    return call


def describe_value(value):
    """An argument as the manifest shows it (tensors by shape and dtype, objects by class)."""
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (list, tuple)):
        return [describe_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


@contextlib.contextmanager
def _sandbox(device: torch.device, buf: io.StringIO, quiet: bool):
    """Around infer(): stdout into ``buf``, ``.cuda()`` a no-op on a CPU device, transformers' per-call
    warnings hidden (``quiet``), and the ``reset_parameters`` its ``disable_torch_init`` replaces restored."""
    saved = {cls: cls.__dict__["reset_parameters"] for cls in (nn.Linear, nn.LayerNorm)}
    try:
        with cuda_noop_on_cpu(device), contextlib.redirect_stdout(buf), _transformers_quiet(quiet):
            yield
    finally:
        for cls, fn in saved.items():
            setattr(cls, "reset_parameters", fn)


__all__ = ["InferEntry", "INFER_MAX_NEW_TOKENS", "STDOUT_FILE", "one_page", "not_called", "describe_value"]
