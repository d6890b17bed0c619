"""The KV cache: what its bytes mean and where they live.

    formats      FP8 encodings, the kv-cache-dtype strings users pass (the one alias table) and the integer
                 format codes the compiled ops take (CacheFormat, mirrored by csrc/common/cache_format.h)
    scales       per-layer (per-head) K/V scales and their file / checkpoint readers
    rotation     the Hadamard rotation of the head dimension
    layout       the paged layouts, their allocation and reads of the recent-token window ring
    sizing       how many blocks (and window seats) a memory budget holds
    window_pool  the recent-token window's seats, handed to running sequences
    spec         KVCacheSpec: all of the above resolved once for an engine

Submodules are imported by name (`from fp8cache.kvcache import formats`); this package imports none of them,
so that `fp8cache.ops` and `fp8cache.kvcache` can import each other's leaves without a cycle.
"""
