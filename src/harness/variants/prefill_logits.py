"""``prefill_logits=last``: the prefill's lm_head runs on each sequence's last prompt position only.

The vendor applies lm_head to every prompt position and casts the logits to fp32
(``model.lm_head_all_positions``); greedy decoding reads the last position's alone
(``models.adapter.greedy``), so the first token is the same function of the same hidden state.
The converter sets the request loop's ``Plan.prefill_logits``, which ``engine.Engine.logits_all_positions``
reads (``harness.config.logits_every_position``, the rule the cost model reads too); it runs on any device and cache. The analytic cost model counts the lm_head rows the same way
(``harness.config.prefill_logit_rows``).
"""
from __future__ import annotations

from .. import knobs
from .base import Converter
from .engine import attach


class PrefillLogits(Converter):
    """lm_head on the last prompt position only (see the module docstring)."""

    spec = knobs.PREFILL_LOGITS

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "every prompt position (the vendor's lm_head), fp32"}
        attach(model).prefill_logits = ex.prefill_logits
        return {self.manifest_key: "each sequence's last prompt position only (the one greedy decoding reads), fp32"}


PREFILL_LOGITS = PrefillLogits()
