"""The KV cache: what its bytes mean and where they live.

    dtype_names     the kv-cache-dtype strings users pass and the backends, without torch (for --help)
    formats         FP8 encodings, the kv-cache-dtype resolution and the integer format codes the compiled
                    ops take (CacheFormat, mirrored by csrc/common/cache_format.h)
    scales          per-layer (per-head) K/V scale values, sharded over tensor-parallel ranks
    scale_files     scales files and checkpoint scale names, and the precedence between them
    dynamic_scales  per-token, per-head scales computed as tokens are written (--kv-scales dynamic)
    rotation        the Hadamard rotation of the head dimension
    layout          the paged layouts, their allocation and reads of the recent-token window ring
    sizing          how many blocks (and window seats) a memory budget holds
    spec            KVCacheSpec: all of the above resolved once for an engine

The recent-token window's seats, handed to running sequences, are fp8cache.engine.window_pool's.

Submodules are imported by name (`from fp8cache.kvcache import formats`); this package imports none of them,
so that `fp8cache.ops` and `fp8cache.kvcache` can import each other's leaves without a cycle.
"""
