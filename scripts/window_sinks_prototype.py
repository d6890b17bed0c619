"""Prototype, kept as the measurement that chose the product's attention sinks (`--kv-recent-window-sinks`,
docs/design.md section 10): what keeping each sequence's first tokens in full precision beside the recent window
does to `fp8kv eval`'s KL with dynamic scales (issue 54's window-32 targets).

It was written before the cache and the ops had sinks, so it replaces the model's attention with one dense pure-torch softmax per layer over the step's own K/V, as the
tests' oracle does (tests/model/test_recent_window.py): row i reads positions [0, sinks) and [i - window + 1, i] in
float32 and the others as dynamic-scale FP8 after the Hadamard rotation (fp8cache.ops.reference.quantize_dynamic,
the compiled cache write's bits). With --sinks 0 it is `fp8kv eval --kv-scales dynamic` up to float rounding
(6 windows, e4m3, window 32: 0.000588 here against eval's 0.000596). --quantize k or v keeps the other in full
precision everywhere, to split the error between K and V.

    python scripts/window_sinks_prototype.py --kv-cache-dtype fp8_e4m3 --window 32 --sinks 1 --windows 6
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, rotation
from fp8cache.model import attention
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference
from fp8cache.quality.eval import locate_eval_text, read_text, runner_batch, window_config


def dense_attention(fmt: formats.Fp8Format, window: int, sinks: int, quantized: str):
    """attention.attend's signature: dense windowed mixed-precision attention, no cache."""
    def as_cached(x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind not in quantized:
            return x.float()
        h = rotation.hadamard_matrix(x.shape[-1])
        codes, scales = reference.quantize_dynamic(rotation.rotate(x.float(), h), fmt)
        return rotation.rotate(codes.view(fmt.torch_dtype).float() * scales.float()[..., None], h)

    def attend(ctx, layer, q, k, v, scaling, features=attention.PLAIN):
        rows, cols = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
        causal = cols <= rows
        full = causal & ((cols > rows - window) | (cols < sinks))
        keys, values = torch.cat([as_cached(k, "k"), k.float()]), torch.cat([as_cached(v, "v"), v.float()])
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=torch.cat([causal & ~full, full], 1), scale=scaling, enable_gqa=True)
        return out.transpose(0, 1).to(q.dtype).contiguous()

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=1)
    parser.add_argument("--quantize", default="kv", choices=("kv", "k", "v"))
    parser.add_argument("--windows", type=int, default=6)
    args = parser.parse_args()
    config = EngineConfig(dtype="float32")
    loaded = load_model(config, progress=False)
    tokens = loaded.tokenizer(read_text(locate_eval_text()))["input_ids"]
    runner = ModelRunner(window_config(config, loaded.hf_config, 1024, "auto", torch.float32), lambda _: None, loaded)
    fmt = formats.get_format(args.kv_cache_dtype, "cpu")
    kl = nll = agree = n = 0.0
    for w in range(args.windows):
        ids = tokens[w * 1024:(w + 1) * 1024]
        base = torch.log_softmax(runner.execute(runner_batch(ids, runner), all_logits=True)[:-1], -1)
        with _patched(dense_attention(fmt, args.window, args.sinks, args.quantize)):
            test = torch.log_softmax(runner.execute(runner_batch(ids, runner), all_logits=True)[:-1], -1)
        targets = torch.tensor(ids[1:])[:, None]
        kl += float((base.exp() * (base - test)).sum())
        nll += float(-test.gather(1, targets).sum())
        agree += int((base.argmax(-1) == test.argmax(-1)).sum())
        n += len(ids) - 1
    print(json.dumps({**vars(args), "kl": kl / n, "ppl": math.exp(nll / n), "top1_agreement": agree / n}))


@contextmanager
def _patched(attend) -> Iterator[None]:
    saved, attention.attend = attention.attend, attend
    try:
        yield
    finally:
        attention.attend = saved


if __name__ == "__main__":
    main()
