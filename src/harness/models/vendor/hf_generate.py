"""The vendor model through its own Hugging Face ``generate`` (``model.vendor_loop=hf_generate``),
and the stage ranges of a ``generate`` call, cut from forward hooks.

``HFGenerate`` is a ``VendorOCR``'s ``generate_own``: it calls ``hf.generate`` with the arguments
the vendor's ``infer()`` passes (``INFER_GENERATE_KWARGS``: ``temperature=0.0`` without sampling,
i.e. greedy; ``no_repeat_ngram_size=20``; ``use_cache``), the config's EOS id, and two of ours:
``max_new_tokens = min_new_tokens =`` the case's budget (HF's min-new-tokens processor masks EOS
until then, so the budget stays fixed as in the harness loop; ``infer()`` itself asks for 8192
and stops at EOS) and an all-ones ``attention_mask`` (what ``generate`` builds itself when the
prompt holds no pad token). No streamer: ``infer()``'s decodes text, which needs the tokenizer
(``model.vendor_entry=infer`` runs it). Forwards run under bf16 autocast on CUDA as in ``infer()``;
``generate`` runs under its own ``no_grad``. What ran goes to ``info["loop"]`` (``describe``).

``GenerateRanges`` turns one ``generate`` call into the harness's ranges, counting the vendor
model's forwards with a pre- and a post-hook on its top module::

    request                          opened by the driver
      [preprocess]                   infer() only: its own page preprocessing, until generate is entered
      prefill(pre_vision=True)       generate entered: HF's set-up, the embedding, the vendor's pixel sums
      sam | clip | projector(call=i) the VendorOCR vision hooks, first forward only
      prefill                        first decoder layer .. logits, then HF's processing of them, up to
                                     the second forward
      decode
        decode_step(step=k-1)        from forward k's start to forward k+1's (k >= 1): the forward and
                                     HF's work on its logits; the last one ends when generate returns

A ``decode_step`` therefore holds what the harness loop's holds (a forward and the token choice)
plus HF's logits processors (the n-gram guard scans the whole sequence every step) and stopping
criteria, so their cost shows per step, against the KV length.
"""
from __future__ import annotations

import contextlib
import io
import time

import torch

from ...errors import HarnessError
from ..adapter import GenerationResult, StageFn
from ..routing import RoutingCounter
from .loader import VendorCache, _Segments, _transformers_quiet
from .compat import cuda_noop_on_cpu

#: what the vendor's infer() passes to generate besides tensors, EOS id, streamer and max_new_tokens
INFER_GENERATE_KWARGS = {"temperature": 0.0, "no_repeat_ngram_size": 20, "use_cache": True}
BUDGET = "workload.decode_tokens"


class GenerateRanges:
    """Stage ranges and routing phases of one vendor ``generate`` call, from forward hooks.

    Use as a context (installs the hooks on ``ocr.hf``, removes them on exit); call ``begin()``
    where ``generate`` is entered and ``end()`` where it returns (``end(exc)`` when it raised).
    ``forwards`` counts the vendor forwards; ``past`` is the last forward's cache.
    """

    def __init__(self, ocr, stage: StageFn, counter: RoutingCounter):
        self.ocr, self.stage, self.counter = ocr, stage, counter
        self.seg = _Segments(stage)
        self.forwards = 0
        self.past = None
        self._decode = None
        self._hooks: list = []
        self._vision: list = []

    def __enter__(self) -> "GenerateRanges":
        hf = self.ocr.hf
        self._hooks = [hf.register_forward_pre_hook(self._pre), hf.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks + self._vision:
            h.remove()
        self._hooks, self._vision = [], []

    def begin(self) -> None:
        """``generate`` is entered: ``prefill(pre_vision=True)`` opens (closing an open
        ``preprocess``), the vision hooks are armed for the first forward."""
        self.counter.phase("prefill")
        self._vision = self.ocr._vision_hooks(self.seg, None)
        self.seg.switch("prefill", pre_vision=True)

    def _pre(self, module, args) -> None:
        k = self.forwards
        if k == 0:
            return
        if k == 1:  # the first token is chosen: prefill ends, decoding starts
            self.seg.close()
            self.counter.phase("decode")
            self._decode = self.stage("decode")
            self._decode.__enter__()
        self.seg.switch("decode_step", step=k - 1)

    def _post(self, module, args, output) -> None:
        k = self.forwards
        self.forwards += 1
        self.past = getattr(output, "past_key_values", None)
        if k == 0:
            for h in self._vision:
                h.remove()
            self._vision = []
            if self.ocr.stage_calls.get("sam", 0) == 0:
                raise HarnessError("the vendor forward skipped its vision encoders (it does so when the first "
                                   "global view's pixels sum to exactly 0)", "use a page with content")
            self.ocr._note_llm("llm_prefill")
        elif k == 1:
            self.ocr._note_llm("llm_decode")

    def end(self, exc: BaseException | None = None) -> None:
        """``generate`` returned (or raised ``exc``): close the last range and ``decode`` (an empty
        one for a single token, as the harness loop has); stop counting routing."""
        self.seg.close(exc)
        if self._decode is None and exc is None:
            self._decode = self.stage("decode")
            self._decode.__enter__()
        if self._decode is not None:
            dec, self._decode = self._decode, None
            dec.__exit__(*((type(exc), exc, exc.__traceback__) if exc is not None else (None, None, None)))
        self.counter.phase(None)

    def result(self, tokens: torch.Tensor, n_new: int, host_ms: dict, prompt_tokens=None) -> GenerationResult:
        """The request's ``GenerationResult`` from the new tokens [B, n] generate returned."""
        if tokens.shape[1] != n_new or self.forwards != n_new:
            raise HarnessError(f"the vendor's generate returned {tokens.shape[1]} new tokens in {self.forwards} "
                               f"forwards for a budget of {n_new}",
                               "report this as a bug: min_new_tokens should keep the budget fixed")
        kv = VendorCache(self.past).nbytes() if self.past is not None else 0
        return GenerationResult(tokens=tokens, routing=self.counter.result(), kv_cache_bytes=kv, host_ms=host_ms,
                                prompt_tokens=prompt_tokens)


class HFGenerate:
    """``generate_own`` of ``vendor_loop=hf_generate``: one request through ``hf.generate``.

    ``no_repeat_ngram_size``: the vendor's 20 (tests lower it to make the guard fire)."""

    def __init__(self, ocr, no_repeat_ngram_size: int = INFER_GENERATE_KWARGS["no_repeat_ngram_size"]):
        self.ocr = ocr
        self.kwargs = {**INFER_GENERATE_KWARGS, "no_repeat_ngram_size": no_repeat_ngram_size,
                       "eos_token_id": ocr.cfg.eos_token_id}

    def describe(self) -> dict:
        """What runs, for the manifest (``info["loop"]``)."""
        return {"loop": "hf_generate", "entry": "generate",
                "driver": "the vendor model's own HF generate (transformers GenerationMixin), greedy",
                "generate_kwargs": {**self.kwargs, "max_new_tokens": BUDGET,
                                    "min_new_tokens": f"{BUDGET} (EOS masked until then: fixed budget)",
                                    "attention_mask": "all ones (what generate builds when no pad is in the prompt)"},
                "as_infer": "the arguments of the vendor's infer() except max_new_tokens=8192 and its streamer",
                "streamer": "none (infer()'s decodes text: model.vendor_entry=infer)",
                "autocast": "cuda bf16 (as infer())" if self.ocr.autocast else "off", "grad": "generate's no_grad"}

    def __call__(self, request, stage: StageFn, max_new_tokens: int) -> GenerationResult:
        ocr = self.ocr
        n_new = _budget(max_new_tokens)
        ids = request.input_ids.to(ocr.device)
        mask = request.images_seq_mask.to(ocr.device)
        images, crop = ocr._images(request)
        counter = ocr.routing_counter()
        quiet = contextlib.redirect_stdout(io.StringIO()) if ocr.quiet else contextlib.nullcontext()
        with ocr.routing_hooks(counter), GenerateRanges(ocr, stage, counter) as ranges, stage("request"):
            t0 = time.perf_counter()
            ranges.begin()
            try:
                with ocr._autocast(), cuda_noop_on_cpu(ocr.device), quiet, _transformers_quiet(ocr.quiet):
                    out = ocr.hf.generate(ids, attention_mask=torch.ones_like(ids), images=images,
                                          images_seq_mask=mask, images_spatial_crop=crop,
                                          max_new_tokens=n_new, min_new_tokens=n_new, **self.kwargs)
            except BaseException as exc:
                ranges.end(exc)
                raise
            ranges.end()
            host_ms = (time.perf_counter() - t0) * 1e3
        return ranges.result(out[:, ids.shape[1]:], n_new, {"request": host_ms})


def _budget(max_new_tokens: int) -> int:
    n_new = int(max_new_tokens)
    if n_new < 1:
        raise HarnessError(f"the vendor's generate needs at least 1 new token (got {n_new})",
                           "set workload.decode_tokens to 1 or more")
    return n_new


__all__ = ["INFER_GENERATE_KWARGS", "GenerateRanges", "HFGenerate"]
