"""Decode steps replayed from CUDA graphs (as vLLM does): the GPU runs a step's ~15 kernels a layer back to
back instead of waiting for Python to launch each one.

One graph per padded batch size, captured the first time a decode step of that size runs: its metadata
(token ids, positions, slots, block tables, lengths, the window's) lives in one device buffer that each
step's single host-to-device copy refills, rows past the real batch are padding (a slot of -1, so nothing
is written, and a one-token context whose output is dropped), and attention runs for max_model_len so that
every length fits the captured grid. Prefill and mixed steps run eagerly.

In the overlapped loop a decode's input id may be a token the previous step sampled, still on the device: its
row and source ride in the same copy, after the captured arrays (so their offsets do not move), and two small
ops outside the graph copy the tokens into the graph's input ids before it replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from fp8cache.model import step_metadata
from fp8cache.model.batch import StepBatch
from fp8cache.model.forward_context import ForwardContext

# Padded batch sizes: small ones one by one (a single chat), then steps of 8.
_SMALL_SIZES = (1, 2, 4)


def padded_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in _SMALL_SIZES if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the metadata's device buffer
    logits: torch.Tensor  # [size, vocab] float32, written by each replay


class DecodeGraphs:
    """forward(batch) -> logits for the decode steps it can replay; None for the others (run them eagerly)."""

    def __init__(self, device: torch.device, max_num_seqs: int, table_width: int, max_model_len: int,
                 build_context: Callable[..., ForwardContext],
                 forward: Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor],
                 log: Callable[[str], None]) -> None:
        self.device, self.table_width, self.max_model_len = device, table_width, max_model_len
        self.sizes = padded_sizes(max_num_seqs)
        self.build_context, self.forward, self.log = build_context, forward, log
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # one memory pool shared by the graphs (largest first is not needed: steps reuse)
        self.disabled: str | None = None
        self.template: StepBatch | None = None  # the last decode batch run: capture_all pads it to each size

    def invalidate(self) -> None:
        """Forget the graphs (the tensors they read were replaced, e.g. new KV scales)."""
        self.graphs.clear()

    def run(self, batch: StepBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of a decode step it can replay (queued, not waited for), else None. prev_tokens: the
        previous step's sampled tokens, when batch.future_rows feed on them."""
        n = len(batch.seqs)
        if self.disabled or not batch.is_decode_only or n > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= n)
        self.template = batch
        graph = self.graphs.get(size)
        if graph is None:
            try:
                graph = self.graphs[size] = self._capture(size, batch)
            except Exception as exc:  # noqa: BLE001 - a model we cannot capture still runs, eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"
                self.log(f"warning: decode steps run without CUDA graphs (capture failed: {self.disabled})")
                return None
        arrays = self._arrays(self._padded(batch, size)) | step_metadata.future_arrays(batch)
        views = step_metadata.to_device(arrays, self.device, into=graph.buffer)
        step_metadata.feed_tokens(views["input_ids"], views, prev_tokens)
        graph.graph.replay()
        return graph.logits[:n]

    def capture_all(self) -> int:
        """Capture every padded size not captured yet, from the last decode batch run (its first sequence pads
        the others, as in _padded); the number of graphs held afterwards. Capture failures disable graphs, as
        in run()."""
        template = self.template
        if self.disabled or template is None:
            return len(self.graphs)
        for size in self.sizes:
            if size not in self.graphs:
                try:
                    self.graphs[size] = self._capture(size, replace(template, future_rows=[], future_src=[]))
                except Exception as exc:  # noqa: BLE001 - a model we cannot capture still runs, eagerly
                    self.disabled = f"{type(exc).__name__}: {exc}"
                    self.log(f"warning: decode steps run without CUDA graphs (capture failed: {self.disabled})")
                    break
        return len(self.graphs)

    # ---- capture -----------------------------------------------------------------------------------------

    def _padded(self, batch: StepBatch, size: int) -> StepBatch:
        """The batch with size - n padding rows: one-token contexts in block 0 whose K/V are not written."""
        pad = size - len(batch.seqs)
        if pad == 0:
            return batch
        template = batch.seqs[0]
        filler = replace(template, query_len=1, context_len=1, block_table=[0],
                         window_block_table=[0] * len(template.window_block_table), window_floor=0)
        return StepBatch(token_ids=batch.token_ids + [0] * pad, positions=batch.positions + [0] * pad,
                         slot_mapping=batch.slot_mapping + [-1] * pad, seqs=batch.seqs + [filler] * pad,
                         window_slot_mapping=batch.window_slot_mapping + [-1] * pad if batch.window_slot_mapping
                         else [])

    def _extra(self, batch: StepBatch) -> dict[str, np.ndarray]:
        return {"input_ids": np.asarray(batch.token_ids, dtype=np.int64)[None],
                "positions": np.asarray(batch.positions, dtype=np.int64)[None]}

    def _arrays(self, batch: StepBatch) -> dict[str, np.ndarray]:
        return self.build_context(batch, extra=self._extra(batch), table_width=self.table_width,
                                  arrays_only=True)

    def _capture(self, size: int, batch: StepBatch) -> _Graph:
        padded = self._padded(batch, size)
        room = step_metadata.packed_size(self._arrays(padded)) + _future_room(size)
        buffer = torch.empty(room, dtype=torch.uint8, device=self.device)
        ctx = self.build_context(padded, extra=self._extra(padded), table_width=self.table_width,
                                 metadata_buffer=buffer, max_decode_len=self.max_model_len)
        # The warm-up runs below may see placeholder input ids (tokens still to come from the previous step):
        # they write the K/V of this step's own slots, which its replay then writes again.
        graph, logits = self._record(ctx)
        return _Graph(graph, buffer, logits)

    def _record(self, ctx: ForwardContext) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A CUDA graph of one forward pass over ctx's buffers, and the logits tensor its replays write."""
        ids, positions = ctx.extra["input_ids"], ctx.extra["positions"]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
            for _ in range(2):
                self.forward(ids, positions, ctx)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(ids, positions, ctx).to(torch.float32)
        self.pool = graph.pool()
        return graph, logits


def _future_room(size: int) -> int:
    """Bytes for the rows fed from the previous step's tokens (at most one a sequence), after the arrays."""
    rows = np.zeros(size, dtype=np.int64)
    return step_metadata.packed_size({"future_rows": rows, "future_src": rows})

