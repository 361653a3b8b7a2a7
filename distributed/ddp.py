"""DistributedDataParallel with one gradient-bucket layout for the life of the process, so resume is exact.

DDP lays its buckets out twice: at construction, and again after the process's first backward, in the order the
gradients became ready. A ring all-reduce over 3 or more ranks sums an element's addends in an order that
depends on the element's place in its bucket (over 2 ranks ``a + b == b + a``), so the two layouts round
differently. An uninterrupted run reduces step 0 with the first layout and every later step with the second; a
run resumed at step s would reduce step s with the first one and drift from it (docs/checkpoints.md#resume).

Here the final layout is set at construction, from the parameters in reverse order of definition (DDP's own
estimate of the order their gradients become ready, which keeps the reduction of the first buckets overlapped
with the rest of the backward), and it is never rebuilt.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


class FixedBucketsDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose buckets are laid out once, at construction (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the reducer's parameter order (reversed below) as the "ready order" of its one rebuild, done now
        self.reducer._push_all_rebuilt_params()
        self.reducer._rebuild_buckets()

    def _build_params_for_reducer(self):
        parameters, expect_sparse_gradient = super()._build_params_for_reducer()
        return parameters[::-1], expect_sparse_gradient[::-1]
