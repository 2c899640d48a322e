"""Checkpoint headers against a model's tensors: one check for the reference and the vendor model.

``read_headers(files)`` reads every tensor's name and shape from safetensors headers (no data);
``check_tensors`` compares them with what a model needs and raises one HarnessError listing the
missing, unexpected and mismatched tensors (at most three of each) before anything is loaded.
"""
from __future__ import annotations

from pathlib import Path


def read_headers(files) -> dict:
    """{tensor name: (file, shape)} over ``files`` (safetensors); a bad header is a HarnessError."""
    from safetensors import safe_open

    from ..errors import HarnessError

    where: dict = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    where[k] = (Path(f), tuple(fh.get_slice(k).get_shape()))
        except Exception as exc:  # corrupt or truncated header
            raise HarnessError(f"cannot read {f}: {exc}", "re-download that checkpoint file") from None
    return where


def check_tensors(where: dict, params: dict, source, what: str = "the model", optional=()) -> int:
    """Compare ``where`` (``read_headers``) with ``params`` {name: shape the model needs}.

    ``optional``: names the model holds but a checkpoint may omit (buffers it computes itself).
    Returns the checkpoint's tensor count; raises a HarnessError naming what differs.
    """
    from ..errors import HarnessError

    optional = set(optional)
    missing = sorted(set(params) - set(where))
    unexpected = sorted(set(where) - set(params) - optional)
    mismatched = sorted(k for k in set(params) & set(where) if tuple(params[k]) != tuple(where[k][1]))
    if missing or unexpected or mismatched:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)):
            if keys:
                shown = ", ".join(f"{k} {tuple(where[k][1])} vs model {tuple(params[k])}" if label == "mismatched"
                                  else k for k in keys[:3])
                parts.append(f"{len(keys)} {label} ({shown}{', ...' if len(keys) > 3 else ''})")
        raise HarnessError(f"checkpoint in {source} does not match {what}: " + "; ".join(parts),
                           f"point model.path at a checkpoint of this model ({len(params):,} tensors)")
    return len(where)
