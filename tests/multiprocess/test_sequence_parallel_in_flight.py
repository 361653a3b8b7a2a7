"""Under gloo (CPU tensors) the sequence-parallel linears keep one collective in flight at a time: gloo runs a
group's queued collectives on several threads at once, which corrupted the heap (issue #47: SIGABRT,
``malloc(): unaligned tcache chunk detected``). Each piece is still gathered or scattered piece by piece."""

from __future__ import annotations

import torch
import torch.distributed as dist

import distributed.sequence_parallel as sp
from distributed.mappings import compute_split_shapes
from tests.dist_utils import run_distributed


class _Counting:
    """``torch.ops._c10d_functional`` that counts the collectives started and not yet waited for."""

    def __init__(self, ops):
        self.ops, self.pending, self.most, self.started = ops, set(), 0, 0

    def _start(self, name, *args):
        out = getattr(self.ops, name)(*args)
        self.pending.add(id(out))
        self.started += 1
        self.most = max(self.most, len(self.pending))
        return out

    def all_gather_into_tensor(self, *args):
        return self._start("all_gather_into_tensor", *args)

    def reduce_scatter_tensor(self, *args):
        return self._start("reduce_scatter_tensor", *args)

    def wait_tensor(self, out):
        self.pending.discard(id(out))
        return self.ops.wait_tensor(out)


def _worker(rank, world):
    counting = _Counting(sp._c10d)
    sp._c10d = counting
    shapes = compute_split_shapes(15, world)  # uneven: 8 + 7 tokens, 4 pieces each
    x = torch.randn(shapes[rank], 2, 6, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    h = sp.sequence_parallel_column_linear(x, w1, None, shapes, dist.group.WORLD)
    sp.sequence_parallel_row_linear(h, w2, shapes, dist.group.WORLD).sum().backward()
    # 4 pieces x (column forward, row forward, row backward, column backward), all waited for, one at a time
    assert counting.started == 16 and not counting.pending, (counting.started, counting.pending)
    assert counting.most == 1, counting.most


def test_one_gloo_collective_in_flight_at_a_time():
    run_distributed(_worker, 2)
