"""``execution.preprocess=device``: pages resized, padded, normalised and tiled on the device
(``harness.preprocess_device``). It changes how a request is built, not the model: the converter
only checks and names what runs; ``setup.CaseInputs.timed_request`` and the throughput pipeline's
stager build the request that way. It runs wherever torch runs (the model=vendor refusal is the
config's, as for every knob)."""
from __future__ import annotations

from .. import knobs
from .base import Converter


class DevicePreprocess(Converter):
    """The request's pixels made on the device (no module of the model changes)."""

    spec = knobs.DEVICE_PREPROCESS

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "host: the vendor's PIL resize / pad / normalisation / tiles, float32 copied"}
        return {self.manifest_key: "device: 8-bit pixels copied, then PIL's bicubic resize (antialiased, 8-bit "
                "rounding between passes), pad, normalisation and tiles as torch ops on the device "
                "(harness.preprocess_device)"}


DEVICE_PREPROCESS = DevicePreprocess()
