"""The vendor's own DeepSeek-OCR code (trust_remote_code, transformers 4.46.3) behind the harness's
adapter protocol: ``loader`` (load the snapshot, ``VendorOCR``: the adapter over its forward),
``hf_generate`` (its Hugging Face ``generate`` with ``infer()``'s arguments), ``infer`` (its
``infer()`` entry on the page file), ``loops`` (which of them drives a run) and ``compat`` (the
shims its code needs on this machine)."""
