"""A token's columns over several blocks (mhc::first_col / col_step, kernels_cu/common.cuh), for a few tokens
under the kernel choice small or tail: the post op's forward and the pre piece's tail kernel.  Emulated without a GPU:
every E-column piece of a row is taken by exactly one (block, thread), with or without the split; the
grids the plans launch."""

from __future__ import annotations

import pytest

from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops._launch import SPLIT_BLOCKS, column_blocks, threads_for


def _owners(C: int, E: int, threads: int, blocks_y: int) -> dict:
    """column -> [(block y, thread)] of the loop ``for c = first_col(E); c < C; c += col_step(E)``."""
    out = {}
    for by in range(blocks_y):
        for tx in range(threads):
            c = (by * threads + tx) * E
            while c < C:
                out.setdefault(c, []).append((by, tx))
                c += blocks_y * threads * E
    return out


@pytest.mark.parametrize("C,E", [(7168, 8), (7, 1), (13, 1), (2048, 8), (4096, 4), (72, 8), (1, 1), (100, 2)])
@pytest.mark.parametrize("tokens", [1, 3, 64, 65, 1000])
def test_every_piece_of_a_row_has_one_owner(C, E, tokens):
    for threads in {threads_for(C, E), 256}:
        cb = column_blocks(tokens, C, E, threads)
        assert cb >= 1 and (cb == 1 or tokens * cb <= SPLIT_BLOCKS + tokens)
        owners = _owners(C, E, threads, cb)
        assert sorted(owners) == list(range(0, C, E))
        assert all(len(v) == 1 for v in owners.values())
        # no block of the split is idle: each owns a piece
        assert {by for v in owners.values() for by, _ in v} == set(range(cb))


def _grids(op: str, tokens: int, n: int, C: int) -> dict:
    """Kernel name -> grid of op's plan (test_kernel_choice.launched's dry run)."""
    from test_kernel_choice import launched

    return dict(launched(op, tokens, n, C, with_grids=True))


@pytest.mark.parametrize("tokens", [1, 8, 64, 65])
def test_the_split_runs_for_a_few_tokens_under_small(tokens):
    post, tail = "mhc_stream_mix_distribute_fwd_kernel", "mhc_layer_pre_tail_kernel"
    default = _grids("mhc_post_op_fwd", tokens, 4, 7168)
    assert default[post] == (tokens, 1, 1)
    with kernel_choice(small=True):
        small = _grids("mhc_post_op_fwd", tokens, 4, 7168)
        pre = _grids("mhc_layer_pre_fwd", tokens, 4, 7168)
    split = tokens <= 64
    assert (small[post][1] > 1) == split and small[post][0] == tokens
    if split:  # the tail kernel after the GEMV: its columns split too
        assert pre[tail][0] == tokens and pre[tail][1] == column_blocks(tokens, 7168, 8, 256) > 1
    with kernel_choice(tail=True):  # (the tail kernel splits wherever it runs; the post op's forward too)
        if split:
            assert _grids("mhc_layer_pre_fwd", tokens, 4, 7168)[tail][1] > 1
        assert _grids("mhc_post_op_fwd", tokens, 4, 7168)[post] == small[post]
        boundary = _grids("mhc_boundary_fwd", tokens, 4, 7168)
        assert boundary[post] == small[post], "the boundary op's post kernel (tensor-core GEMM after it)"
