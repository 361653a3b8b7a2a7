"""Async TP (``--async_tp``, ``distributed/async_tp.py``) on 2 CPU gloo ranks at tp 2 with sequence parallelism.

* The one-piece path (``seq_chunks = 1``) computes what the chunked path and one process compute, outputs and
  every gradient (float64, eager), with one collective per linear and direction.
* Compiled by inductor on the CPU, its forward and backward graphs hold exactly the all-gather + ``mm`` and
  ``mm`` + reduce-scatter pairs that inductor's micro-pipeline TP fuses, one per linear and direction: the test
  that fails when our graphs stop matching the pass (``find_all_gather_patterns`` /
  ``find_reduce_scatter_patterns`` and the checks of ``fuse_*``). The fusion itself needs NCCL and symmetric
  memory: on the CPU the pass finds the pairs and leaves them.
* The config errors of a bad combination, and the refusals of :func:`use_plain_collectives`.
* Our reduce-scatter kernel's sum of two partials (:func:`sum_two_partials`) is the reduce-scatter's result,
  bitwise, and :func:`enable_async_tp` registers the kernel. The kernel itself runs on 2 GPUs only
  (``tests/gpu/test_async_tp_fusion.py``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes import micro_pipeline_tp as mpt
from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import distributed.sequence_parallel as sp
from distributed.async_tp import enable_async_tp, sum_two_partials, use_plain_collectives
from distributed.tensor_parallel import apply_tensor_context_parallel, checkpoint_views
from networks.vit import VisionTransformer
from tests.dist_utils import run_distributed
from utils.config.loading import load_config
from utils.config.validate import Launch, validate
from utils.core.errors import UserError

F64 = dict(atol=1e-10, rtol=1e-10)
YAML = Path(__file__).resolve().parents[2] / "config" / "ViT.yaml"


def _vit(img=(8, 16), depth=2, dtype=torch.float64):
    """8 tokens (2 x 4 patches of 4): 4 per TP rank."""
    torch.manual_seed(0)
    return VisionTransformer(img_size=img, patch_size=4, in_chans=3, out_chans=2, embed_dim=16, depth=depth,
                             num_heads=2, mlp_ratio=2.0).to(dtype)


def _grads(model):
    """Dense gradients keyed by the plain model's names (DTensors gathered, head axes folded back)."""
    views = checkpoint_views(model)
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.reshape(views.get(name, g.shape))
    return out


class _Counting:
    """``torch.ops._c10d_functional`` that counts the collectives started."""

    def __init__(self, ops):
        self.ops, self.started = ops, 0

    def all_gather_into_tensor(self, *args):
        self.started += 1
        return self.ops.all_gather_into_tensor(*args)

    def reduce_scatter_tensor(self, *args):
        self.started += 1
        return self.ops.reduce_scatter_tensor(*args)

    def wait_tensor(self, out):
        return self.ops.wait_tensor(out)


def _step(model, x, y):
    """Output of one forward and the collectives of the sequence-parallel linears in it and its backward."""
    counting, ops = _Counting(sp._c10d), sp._c10d
    sp._c10d = counting
    try:
        out = model(x)
        F.mse_loss(out, y).backward()
    finally:
        sp._c10d = ops
    return out, counting.started


def _equal_worker(rank, world):
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    ref = _vit()
    chunked = apply_tensor_context_parallel(copy.deepcopy(ref), tp, None, sequence_parallel=True)
    plain = apply_tensor_context_parallel(copy.deepcopy(ref), tp, None, sequence_parallel=True)
    linears = use_plain_collectives(plain)
    assert len(linears) == 4 * 2 and all(m.seq_chunks == 1 for m in linears)  # qkv, proj, fc1, fc2 of 2 blocks
    x, y = torch.randn(2, 3, 8, 16, dtype=torch.float64), torch.randn(2, 2, 8, 16, dtype=torch.float64)
    F.mse_loss(ref(x), y).backward()
    out_chunked, n_chunked = _step(chunked, x, y)
    out_plain, n_plain = _step(plain, x, y)
    # 8 linears x (forward + backward): one collective each, 4 pieces each when chunked (4 tokens per rank)
    assert (n_plain, n_chunked) == (16, 4 * 16), (n_plain, n_chunked)
    torch.testing.assert_close(out_plain, ref(x), **F64)
    torch.testing.assert_close(out_plain, out_chunked, **F64)
    grads_plain, grads_chunked = _grads(plain), _grads(chunked)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads_plain[name], p.grad, **F64, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(grads_plain[name], grads_chunked[name], **F64, msg=lambda m: f"{name}: {m}")
    # refusals leave the model as it was
    uneven = apply_tensor_context_parallel(_vit(img=(4, 12)), tp, None, sequence_parallel=True)  # 3 tokens: 2 + 1
    with pytest.raises(ValueError, match=r"split evenly over TP, but they split as \[2, 1\]"):
        use_plain_collectives(uneven)
    assert {m.seq_chunks for m in uneven.modules() if hasattr(m, "seq_chunks")} == {sp.CHUNKS}
    with pytest.raises(ValueError, match="no sequence-parallel linear"):
        use_plain_collectives(apply_tensor_context_parallel(_vit(), tp, None, sequence_parallel=False))
    said = []  # the switches themselves (the pass and symmetric memory act only on CUDA), announced once
    handler = logging.Handler()
    handler.emit = said.append
    logger = logging.getLogger("distributed.async_tp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for _ in range(2):  # the batch tuner builds the model again: the pass is on already, nothing more to say
        enable_async_tp(plain, announce=True)
    assert inductor_config._micro_pipeline_tp and is_symm_mem_enabled_for_group(tp.get_group().group_name)
    assert [r.getMessage().split(":")[0] for r in said] == ["async TP"]
    cuda = [line for line in torch._C._dispatch_dump("symm_mem::fused_matmul_reduce_scatter").splitlines()
            if line.startswith("CUDA: ")]  # the active kernel ("CUDA (inactive): " for torch's own)
    assert len(cuda) == 1 and "/distributed/async_tp.py:" in cuda[0], cuda


def test_one_piece_path_equals_chunked_and_one_process():
    run_distributed(_equal_worker, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_sum_of_two_partials_is_the_reduce_scatter(scatter_dim, dtype):
    """Two ranks' partial products P_r of a (6, 4, 8, N) output, laid out as the peer exchange stacks them: the
    sum of each shard is the reduce-scatter's shard, to the bit (bf16 rounded once), contiguous."""
    torch.manual_seed(0)
    partials = [torch.randn(6, 4, 8, 5, dtype=dtype) for _ in range(2)]
    for shard in range(2):
        rows = [p.movedim(scatter_dim, 0).chunk(2)[shard] for p in partials]
        stacked = torch.cat([r.flatten(0, -2) for r in rows])
        got = sum_two_partials(stacked, tuple(rows[0].shape[:-1]), scatter_dim)
        want = (partials[0] + partials[1]).chunk(2, dim=scatter_dim)[shard]
        assert got.is_contiguous() and torch.equal(got, want), (shard, (got - want).abs().max())


class _FusiblePairs(CustomGraphPass):
    """Runs right after inductor's micro-pipeline TP pass (``post_grad_custom_post_pass``); on the CPU that pass
    fuses nothing, so this sees what it found. Per graph: the all-gathers along dim 0 with a consumer ``mm``
    and the reduce-scatters along dim 0 of a single-user ``mm``, as ``fuse_all_gather_matmul`` and
    ``fuse_matmul_reduce_scatter`` require."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        gathers = [g for g in mpt.find_all_gather_patterns(graph) if g.gather_dim == 0 and any(
            g.res_node not in mm.arg_ancestor_nodes for mm in mpt._find_consumer_matmuls(g.res_node))]
        scatters = [s for s in mpt.find_reduce_scatter_patterns(graph) if s.scatter_dim == 0
                    and mpt._find_producer_matmul(s.input_node) is not None and len(s.input_node.users) == 1]
        self.graphs.append((len(gathers), len(scatters)))

    def uuid(self):
        return None  # never cached: the pass must see every graph


def _pattern_worker(rank, world):
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    model = apply_tensor_context_parallel(_vit(depth=1, dtype=torch.float32), tp, None, sequence_parallel=True)
    use_plain_collectives(model)
    pairs = _FusiblePairs()
    with inductor_config.patch(_micro_pipeline_tp=True, fx_graph_cache=False, post_grad_custom_post_pass=pairs):
        out = torch.compile(model)(torch.randn(2, 3, 8, 16))
        out.square().mean().backward()
    # forward: qkv and fc1 gather into their GEMMs, proj and fc2 scatter theirs; backward: proj's and fc2's dy
    # gathered into their GEMMs, qkv's and fc1's dx scattered (the other collectives, over dim 1, are not pairs)
    assert pairs.graphs == [(2, 2), (2, 2)], pairs.graphs


def test_compiled_graphs_hold_the_pairs_inductor_fuses():
    run_distributed(_pattern_worker, 2)


ASYNC = {"async_tp": "true", "tensor_parallel": "2", "sequence_parallel": "true", "enable_jit": "true"}
GPUS = Launch(world_size=2, cuda=True, cuda_capability=(9, 0))


@pytest.mark.parametrize("overrides,launch,pattern", [
    ({"tensor_parallel": "1"}, GPUS, "--async_tp has no effect without tensor parallelism; add --tensor_parallel"),
    ({"sequence_parallel": "false"}, GPUS, "--async_tp decomposes the collectives of sequence parallelism; add "
                                           "--sequence_parallel true"),
    ({"enable_jit": "false"}, GPUS, "--async_tp is a pass of torch.compile's inductor; add --enable_jit true"),
    ({"compile_mode": "reduce-overhead"}, GPUS, r"--async_tp cannot run under CUDA graphs \(--compile_mode "
                                                r"reduce-overhead\).* use --compile_mode default"),
    ({"compile_mode": "max-autotune", "attention_backend": "auto"}, Launch(world_size=2),
     r"under CUDA graphs \(--compile_mode max-autotune\)"),  # refused before the CPU is: the fix names both
    ({"attention_backend": "auto"}, Launch(world_size=2),
     "--async_tp needs CUDA GPUs .* none is visible; drop --async_tp on CPU"),
    ({"img_size": "[360,712]"}, GPUS, r"--async_tp needs each context-parallel rank's 4005 tokens to split evenly "
                                      r"over --tensor_parallel 2"),
    ({"context_parallel": "2"}, Launch(world_size=4, cuda=True), r"2025 tokens to split evenly"),
])
def test_bad_combinations_are_one_line_errors(overrides, launch, pattern, tmp_path):
    cfg = load_config(YAML, "mp", {**ASYNC, "expdir": str(tmp_path), **overrides})
    with pytest.raises(UserError, match=pattern):
        validate(cfg, launch)


def test_async_tp_at_mp_passes_validation(tmp_path):
    validate(load_config(YAML, "mp", {**ASYNC, "expdir": str(tmp_path)}), GPUS)
