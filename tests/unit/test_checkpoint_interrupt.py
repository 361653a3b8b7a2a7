"""A second Ctrl-C during a checkpoint's write (#45 item 6): DCP wraps the ``KeyboardInterrupt`` in its
CheckpointException, with every rank's traceback; the save turns it back into a ``KeyboardInterrupt``, so the
run stops at once with one line and exit status 130, as anywhere else."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from distributed.checkpoint.sharded import ShardedCheckpoints


def test_a_ctrl_c_that_dcp_wrapped_is_a_keyboard_interrupt_again(tmp_path):
    wrapped = CheckpointException("write_data", {0: (KeyboardInterrupt(), "Traceback ..."),
                                                 1: (RuntimeError("peer stopped"), "Traceback ...")})
    with pytest.raises(KeyboardInterrupt):
        ShardedCheckpoints._save_failed(None, tmp_path / "step_00000010", wrapped)
