"""How the CPU's bfloat16 linears scale with rows, one thread: the default model's projections (30 layers and
the lm_head) through fp8kv's panel kernel at 1-80 rows, beside torch's bfloat16 matmul at 2048^3 (about the
most this core sustains). A speculative verify step adds rows: it pays only while the rows are still cheap,
i.e. while the linears stream their weights rather than compute (issue 56).

    python scripts/linear_rows.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8cache import ops

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,8,16,32,48,80")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lib = ops.load("cpu")
    layer = [(lib.linear_bf16_pack(torch.randn(o, i, dtype=torch.bfloat16)), o, i) for o, i in SHAPES]
    head = (lib.linear_bf16_pack(torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)), VOCAB, HIDDEN)

    def model_linears(rows: int) -> float:
        xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in (HIDDEN, INTER)}
        start = time.perf_counter()
        for _ in range(LAYERS):
            for weight, out_features, in_features in layer:
                lib.linear_bf16(xs[in_features], weight, out_features, None, False)
        lib.linear_bf16(xs[HIDDEN], head[0], VOCAB, None, False)
        return time.perf_counter() - start

    a, b = (torch.randn(2048, 2048, dtype=torch.bfloat16) for _ in range(2))

    def square_matmul() -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - start

    rows = [int(r) for r in args.rows.split(",")]
    times: dict[int, list[float]] = {r: [] for r in rows}
    peak: list[float] = []
    for _ in range(args.repeats):  # interleaved: these VMs change speed minute to minute
        for r in rows:
            times[r].append(model_linears(r))
        peak.append(square_matmul())
    print(f"torch.mm bfloat16 2048^3, 1 thread: {2 * 2048 ** 3 / statistics.median(peak) / 1e9:.0f} GFLOP/s")
    flop_per_row = LAYERS * 2 * sum(o * i for o, i in SHAPES) + 2 * VOCAB * HIDDEN
    one_row = statistics.median(times[rows[0]])
    for r in rows:
        t = statistics.median(times[r])
        print(f"rows {r:3d}: {t * 1e3:7.1f} ms = {t / one_row:5.2f}x rows {rows[0]}, "
              f"{r * flop_per_row / t / 1e9:4.0f} GFLOP/s")


if __name__ == "__main__":
    main()
