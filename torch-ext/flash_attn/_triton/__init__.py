"""The Triton backend: ``fwd`` (the forward), ``decode`` (the split-KV forward for few query
rows per kv head), ``bwd`` (the backward), ``kvcache`` (the KV-cache append and paged
attention of ``flash_attn_with_kvcache``), ``kvcache_checks`` (the one launch behind the
KV-cache calls' value checks), each a leaf that imports only ``common`` (shared jit helpers,
the forward's key loop, launch plumbing), ``launch`` (the cached launcher of compiled kernels),
``tuning`` (tile tables and the measured JSON entries beside them) and the package's
``_params`` / ``_heuristics``. The dispatcher (``_dispatch``) chooses among them; nothing is
imported here, so importing one leaf loads no other."""
