"""Which attention kernel really ran, per call site (recorded once per site and backend).

For torch SDPA the dispatcher's choice is read with ``torch._fused_sdp_choice`` on the real
arguments (the same function SDPA itself consults); other paths name themselves.
The manifest reports ``SEEN``: {site: [backend, ...]}.
"""
from __future__ import annotations

import torch

SEEN: dict = {}
_ASKED: dict = {}          # "site/path" -> True: see ``first_time``
_SDPA_NAMES = {0: "sdpa:math", 1: "sdpa:flash_attention", 2: "sdpa:efficient_attention",
               3: "sdpa:cudnn_attention", 4: "sdpa:overrideable"}


def sdpa_choice(q, k, v, attn_mask=None, is_causal=False) -> str:
    try:
        idx = int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal))
    except Exception as exc:  # private API: report instead of guessing
        return f"sdpa:unknown ({exc.__class__.__name__})"
    name = _SDPA_NAMES.get(idx, f"sdpa:{idx}")
    return f"{name} (cpu)" if q.device.type == "cpu" else name


def note(site: str, backend: str) -> None:
    if torch.compiler.is_compiling():     # traced code (vision_compile): probes ran in the eager pass
        return
    lst = SEEN.setdefault(site, [])
    if backend not in lst:
        lst.append(backend)


def seen_once(site: str) -> bool:
    """True once ``site`` was noted, and inside torch.compile tracing (no probe in compiled code)."""
    return site in SEEN or torch.compiler.is_compiling()


def first_time(site: str, path: str) -> bool:
    """True the first time ``site`` is asked about for ``path`` (since ``reset``): a site whose kernel
    depends on an execution knob notes the backend of each path it takes, where ``seen_once`` would
    keep only the first. A dict lookup, like ``seen_once``, so a compiled caller guards on one key."""
    key = f"{site}/{path}"
    if key in _ASKED or torch.compiler.is_compiling():
        return False
    _ASKED[key] = True
    return True


def reset() -> None:
    SEEN.clear()
    _ASKED.clear()
