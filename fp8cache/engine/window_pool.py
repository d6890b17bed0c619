"""Seats in the recent-token window cache: each running sequence holds one while it runs.

With kv_recent_window N > 0 every sequence keeps its newest N tokens' K/V in the model dtype as well, and its first
S (kv_recent_window_sinks, attention sinks), in a ring of ceil((S + N) / block_size) window blocks (seat of position
p: p < S ? p : S + p % N; fp8cache.model.batch.window_slot). The ring
never grows, so a seat is a fixed set of window blocks handed out at admission and returned when the
sequence finishes, is aborted or is preempted. Prefix caching shares only FP8 blocks; the window is per
sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine package imports the runner; a cache module must not pull that in
    from fp8cache.engine.sequence import Sequence


class WindowPool:
    def __init__(self, window_size: int, num_seats: int, blocks_per_seat: int, window_sinks: int = 0) -> None:
        if window_size < 1 or num_seats < 1 or blocks_per_seat < 1 or window_sinks < 0:
            raise ValueError(f"WindowPool needs window_size, num_seats and blocks_per_seat >= 1 and window_sinks >= 0, "
                             f"got {window_size}, {num_seats}, {blocks_per_seat}, {window_sinks}")
        self.window_size = window_size
        self.window_sinks = window_sinks
        self.num_seats = num_seats
        self.blocks_per_seat = blocks_per_seat
        self.free_seats = list(range(num_seats - 1, -1, -1))  # pop() hands out seat 0 first

    @property
    def num_free_seats(self) -> int:
        return len(self.free_seats)

    def take(self, seq: Sequence) -> None:
        if seq.window_block_table:
            return
        if not self.free_seats:
            raise RuntimeError(f"no free recent-window seat for {seq}; check num_free_seats first")
        seat = self.free_seats.pop()
        seq.window_block_table = list(range(seat * self.blocks_per_seat, (seat + 1) * self.blocks_per_seat))

    def release(self, seq: Sequence) -> None:
        if seq.window_block_table:
            seat = seq.window_block_table[0] // self.blocks_per_seat
            if seat in self.free_seats:
                raise RuntimeError(f"recent-window seat {seat} of {seq} is already free")
            self.free_seats.append(seat)
        seq.window_block_table = []

    def check_invariants(self, seqs_holding: list[Sequence]) -> None:
        held = [s.window_block_table[0] // self.blocks_per_seat for s in seqs_holding if s.window_block_table]
        assert len(set(held)) == len(held), "two sequences share a recent-window seat"
        assert not set(held) & set(self.free_seats), "a held recent-window seat is on the free list"
        assert len(held) + len(self.free_seats) == self.num_seats, "a recent-window seat leaked"
