"""The cp.async ring of the post backward under the kernel choice post_pipe (kernels_cu/stream.cu,
mix_distribute_bwd with STAGES > 0), emulated per thread without a GPU: the chunk (token, column) each
iteration reads from its stage is the one the loops of the direct loads read there, the stage it refills
was read before, and the commit groups complete in order (cp.async.wait_group STAGES - 2 before each read)."""

from __future__ import annotations

import pytest

from mhc_cupy.ops import stream
from mhc_cupy.ops._launch import MAX_GRID, grid_for, threads_for


def _thread(tokens, C, E, stages, grid, block, bx, tx):
    """(chunks read in the direct loads' order, chunks the ring hands over): one thread of the kernel."""
    direct = [(t, c) for t in range(bx, tokens, grid) for c in range(tx * E, C, block * E)]
    slots = [None] * stages  # what each stage holds once its group completes
    groups = []  # commit groups in order: (stage, chunk or None)
    pt, pc = bx, tx * E

    def fetch(st):
        nonlocal pt, pc
        chunk = None
        if pt < tokens and pc < C:
            chunk = (pt, pc)
            pc += block * E
            if pc >= C:
                pt, pc = pt + grid, tx * E
        groups.append((st, chunk))

    for st in range(stages - 1):
        fetch(st)
    done, got, stage = 0, [], 0
    for _ in direct:
        # cp.async.wait_group STAGES - 2: all but the newest STAGES - 2 groups are complete
        while done < len(groups) - (stages - 2):
            st, chunk = groups[done]
            slots[st] = chunk
            done += 1
        got.append(slots[stage])
        slots[stage] = "read"  # (its registers hold it now: the stage is free)
        refill = stage - 1 if stage else stages - 1
        assert slots[refill] in (None, "read") or done <= len(groups) - 1, "refilled a stage not yet read"
        fetch(refill)
        stage = stage + 1 if stage < stages - 1 else 0
    return direct, got


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("tokens,C", [(1, 8), (3, 2048), (127, 7168), (5, 2056), (300, 512), (2, 16)])
def test_the_ring_hands_each_thread_its_direct_chunks(tokens, C, stages):
    E = 8
    block = threads_for(C, E)
    grid = min(grid_for(tokens)[0], 7)  # a grid smaller than the tokens too: several tokens a block
    for g in {grid_for(tokens)[0], grid}:
        assert g <= MAX_GRID
        for bx in range(g):
            for tx in range(block):
                direct, got = _thread(tokens, C, E, stages, g, block, bx, tx)
                assert got == direct, (tokens, C, stages, g, bx, tx)


def test_the_library_ring_depth_is_emulated():
    assert stream.POST_BWD_PIPE_STAGES in (2, 3)
