"""Module tree + torchlens call graph of one prefill forward and one decode step (``harness graph``).

``graph_from_config(cfg, out_dir)`` (the ``python -m harness graph`` verb) builds the model named
by ``cfg["model"]`` (reference or vendor) on ``cfg["device"]`` / ``cfg["dtype"]`` with seed
``cfg["seed"]``, builds one request from ``cfg["workload"]``, and writes into ``out_dir``:

module_tree.json / .txt        every named_modules() entry: class (ours and the vendor's), stage,
                               leaf flag, parameters own / total (``tree.py``)
callgraph_prefill.json/.md/.dot  grouped view of the vision stages + the prefill forward
callgraph_decode.json/.md/.dot   grouped view of one decode step after that prefill (KV cache
                               populated), with the experts each MoE layer actually ran
  (.svg next to each .dot when graphviz' ``dot`` is on PATH)
callgraph_join.csv / .md       per module family: torchlens ops and FLOPs, FlopCounterMode FLOPs,
                               and the analytic cost-model share (``join.py``)
manifest.json                  config, versions, device, timings, status

Steps live in ``tree.py`` (module tree), ``capture.py`` (torchlens + FlopCounterMode + routing
capture), ``grouped.py`` (families, for/parfor, experts, DOT), ``join.py`` (analytic join) and
``verb.py`` (the verb that writes them).
"""
from .capture import Capture, capture_reference
from .grouped import grouped_view, render_dot, render_markdown
from .join import COLUMNS as JOIN_COLUMNS, join_rows
from .tree import module_tree, write_tree
from .verb import graph, graph_from_config

__all__ = ["graph_from_config", "graph", "module_tree", "write_tree", "capture_reference", "grouped_view",
           "render_markdown", "render_dot", "join_rows", "Capture", "JOIN_COLUMNS"]
