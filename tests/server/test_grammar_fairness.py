"""Structured-output compiles are fair (issue 39 item 5): costly grammars never hold up cheap ones, costly ones
past the line's budget get a 429 saying so, and the hopeless are refused before any work.

The compiles here are stand-ins that finish when the test says so, and the costs are given by the test: what
is checked is the order of events, never a race against a clock. (Seen before: six costly schemas held both
compile workers and a plain `json_object` request waited 94.9 s.)
"""

from __future__ import annotations

import asyncio

import pytest

from fp8cache.engine.structured_output import StructuredOutputsParams as SOP
from fp8cache.server import grammar as G

JSON_OBJECT = SOP(json_object=True)


def costly_schema(i: int) -> SOP:
    return SOP(json={"type": "object", "properties": {f"f{j}": {"type": "string", "minLength": 9999}
                                                      for j in range(30)}, "title": f"costly {i}"})


def small_schema(i: int) -> SOP:
    return SOP(json={"type": "object", "properties": {"name": {"type": "string"}}, "title": f"small {i}"})


def given_costs(structure: SOP) -> int:
    """The test's costs: the 30-field minLength schemas are costly, everything else cheap."""
    return 100_000 if structure.json is not None and "costly" in str(structure.json) else 10


class StandInWorkers:
    """A compile runner whose compiles end when the test releases them."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Future] = {}

    async def __call__(self, structure: SOP, timeout_s: float):
        key = G.cache_key(structure)
        self.started.append(key)
        gate = self.gates[key] = asyncio.get_running_loop().create_future()  # a compile again: a new gate
        await gate
        return f"index of {key}", 1

    def release(self, structure: SOP) -> None:
        self.gates[G.cache_key(structure)].set_result(None)

    def running(self, structure: SOP) -> bool:
        key = G.cache_key(structure)
        return key in self.started and not self.gates[key].done()


async def settle() -> None:
    """Let every task run until it waits on something the test controls (event-loop turns, not time)."""
    for _ in range(20):
        await asyncio.sleep(0)


def compiler(workers: StandInWorkers, **kwargs) -> G.GrammarCompiler:
    return G.GrammarCompiler(tokenizer=None, workers=2, runner=workers, cost=given_costs, **kwargs)


def test_json_object_and_small_schemas_never_wait_behind_costly_ones():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = compiler(workers)
        costly = [asyncio.ensure_future(grammars.compile(costly_schema(i))) for i in range(5)]
        await settle()
        assert sum(workers.running(costly_schema(i)) for i in range(5)) == 1  # costly ones leave a worker free
        cheap = asyncio.ensure_future(grammars.compile(JSON_OBJECT))
        await settle()
        assert workers.running(JSON_OBJECT), "json_object waited behind the costly compiles"
        workers.release(JSON_OBJECT)
        assert (await cheap).compiled == f"index of {G.cache_key(JSON_OBJECT)}"
        for i in range(3):  # small schemas one after another, each on the free worker at once
            small = asyncio.ensure_future(grammars.compile(small_schema(i)))
            await settle()
            assert workers.running(small_schema(i))
            workers.release(small_schema(i))
            await small
        assert not any(task.done() for task in costly)
        for i in range(5):  # the costly ones go on, one at a time, in arrival order
            running = [j for j in range(5) if workers.running(costly_schema(j))]
            assert running == [i]
            workers.release(costly_schema(i))
            await costly[i]
            await settle()
        assert grammars.counts["compiled"] == 9

    asyncio.run(scenario())


def test_a_worker_freed_goes_to_a_waiting_cheap_grammar_before_a_costly_one():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = compiler(workers)
        first_cheap = asyncio.ensure_future(grammars.compile(small_schema(0)))
        costly = [asyncio.ensure_future(grammars.compile(costly_schema(i))) for i in range(2)]
        await settle()
        second_cheap = asyncio.ensure_future(grammars.compile(small_schema(1)))
        await settle()  # both workers busy (a cheap one and a costly one): both wait
        assert workers.running(costly_schema(0)) and not workers.running(costly_schema(1))
        assert not workers.running(small_schema(1))
        workers.release(costly_schema(0))
        await settle()
        assert workers.running(small_schema(1)) and not workers.running(costly_schema(1))
        for done in (small_schema(0), small_schema(1), costly_schema(1)):
            workers.release(done)
            await settle()
        await asyncio.gather(first_cheap, second_cheap, *costly)

    asyncio.run(scenario())


def test_costly_grammars_past_the_line_budget_get_a_429_saying_so():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = compiler(workers, max_costly_waiting=2)
        line = [asyncio.ensure_future(grammars.compile(costly_schema(i))) for i in range(3)]  # 1 runs, 2 wait
        await settle()
        with pytest.raises(G.GrammarError, match="costly grammars are waiting") as refused:
            await grammars.compile(costly_schema(3))
        assert refused.value.status == 429 and "retry later" in str(refused.value)
        assert grammars.counts["busy"] == 1
        cheap = asyncio.ensure_future(grammars.compile(small_schema(0)))  # cheap ones are not refused
        await settle()
        workers.release(small_schema(0))
        await cheap
        for i in range(3):
            workers.release(costly_schema(i))
            await settle()
        await asyncio.gather(*line)
        again = asyncio.ensure_future(grammars.compile(costly_schema(3)))  # load, not the grammar: not remembered
        await settle()
        workers.release(costly_schema(3))
        await again

    asyncio.run(scenario())


def test_a_hopeless_grammar_is_refused_before_any_compile_and_remembered():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = G.GrammarCompiler(tokenizer=None, workers=2, runner=workers, cost=lambda s: G.MAX_COST + 1)
        for _ in range(2):
            with pytest.raises(G.GrammarError, match="too costly to compile.*minLength") as refused:
                await grammars.compile(costly_schema(0))
            assert refused.value.status == 400
        assert workers.started == []

    asyncio.run(scenario())


def test_compiled_grammars_are_cached_and_json_object_is_kept():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = G.GrammarCompiler(tokenizer=None, workers=2, runner=workers, cost=given_costs, cache_bytes=1)
        for structure in (JSON_OBJECT, small_schema(0), small_schema(1)):
            task = asyncio.ensure_future(grammars.compile(structure))
            await settle()
            workers.release(structure)
            await task
        started = len(workers.started)
        await grammars.compile(JSON_OBJECT)  # kept, whatever the byte budget
        await grammars.compile(small_schema(1))  # the newest one fits the (one byte) budget
        assert len(workers.started) == started and grammars.counts["cached"] == 2
        task = asyncio.ensure_future(grammars.compile(small_schema(0)))  # evicted: compiled again
        await settle()
        assert len(workers.started) == started + 1
        workers.release(small_schema(0))
        await task

    asyncio.run(scenario())


def test_a_client_gone_while_waiting_for_a_worker_frees_its_place():
    async def scenario() -> None:
        workers = StandInWorkers()
        grammars = compiler(workers)
        running = asyncio.ensure_future(grammars.compile(costly_schema(0)))
        waiting = asyncio.ensure_future(grammars.compile(costly_schema(1)))
        await settle()
        waiting.cancel()
        await settle()
        assert grammars.counts["cancelled"] == 1 and not workers.running(costly_schema(1))
        workers.release(costly_schema(0))
        await running
        assert G.cache_key(costly_schema(1)) not in workers.started
        later = asyncio.ensure_future(grammars.compile(costly_schema(2)))  # the costly lane is free again
        await settle()
        assert workers.running(costly_schema(2))
        workers.release(costly_schema(2))
        await later

    asyncio.run(scenario())


@pytest.mark.parametrize(("structure", "low", "high"), [
    (SOP(regex=r"\d{3}-\d{4}"), 1, 50),
    (SOP(regex="((a{1,50}){1,50}){1,50}"), 125_000, 125_000),
    (SOP(choice=["yes", "no"]), 2, 20),
    (costly_schema(0), G.MAX_COST + 1, 10**9),  # the schemas: refused before any compile
    (SOP(json={"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}), 5,
     G.CHEAP_COST),
])
def test_grammar_cost_multiplies_out_repeat_counts(structure, low, high):
    assert low <= G.grammar_cost(structure) <= high
