"""Every error of README's troubleshooting table, raised for real, names its fix.

Single-process: a one-rank gloo group stands in for torchrun where an error needs one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import (
    ClusterSpecError,
    CollectiveError,
    ConfigError,
    InfeasibleError,
    InputError,
    MeshError,
    ModelError,
    OffloadError,
    PassError,
    PlanError,
    TraceError,
)
from autopar.passes import check_plan_matches, run_passes
from autopar.runtime import agreement, compile_checks
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return self.linear(x)
        return x


@pytest.fixture(scope="module")
def mlp_plan():
    return autopar.plan(build_model("mlp"), mesh=(2,), example_inputs=example_batch("mlp", 8), cluster="cpu")


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled_mlp(one_rank_group):
    return autopar.compile(build_model("mlp"), mesh=(1,), example_inputs=example_batch("mlp", 8))


def test_trace_error_names_the_traceable_alternatives():
    with pytest.raises(TraceError) as info:
        autopar.plan(_Branchy(), mesh=(2,), example_inputs=(torch.randn(2, 4),), cluster="cpu")
    message = str(info.value)
    assert message.startswith("could not trace _Branchy")
    assert "torch.where" in message and "torch.cond" in message and "shapes or Python values" in message


def test_an_option_that_needs_another_names_it():
    with pytest.raises(ConfigError) as info:
        autopar.plan(build_model("mlp"), mesh=(2,), example_inputs=example_batch("mlp", 8), cluster="cpu", num_microbatches=4)
    message = str(info.value)
    assert message.startswith("num_microbatches=4 cuts the batch for a pipeline, but pipeline is 'off'")
    assert "pass pipeline=N" in message and "drop num_microbatches" in message


def test_an_unknown_cluster_names_the_presets_and_profile():
    with pytest.raises(ClusterSpecError) as info:
        autopar.plan(build_model("mlp"), mesh=(2,), example_inputs=example_batch("mlp", 8), cluster="tpu-v9")
    message = str(info.value)
    assert message.startswith("unknown cluster 'tpu-v9'") and "h100-80g" in message
    assert "autopar profile --out cluster.json" in message


def test_ranks_whose_input_shapes_differ_are_told_to_pad_the_last_batch():
    from autopar.runtime.data import _check_same_shapes

    rows = [[0.0] * 9 + [shapes] for shapes in (11.0, 11.0, 12.0)]  # column 9: a number of each rank's input shapes
    with pytest.raises(InputError) as info:
        _check_same_shapes(rows)
    message = str(info.value)
    assert message.startswith("ranks 0 and 2 passed inputs of different shapes")
    assert "DistributedSampler pads the last batch" in message


def test_compile_without_a_process_group_names_init_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(MeshError) as info:
        autopar.compile(build_model("mlp"), mesh=(2,), example_inputs=example_batch("mlp", 8))
    assert "init_process_group" in str(info.value) and "autopar.plan" in str(info.value)


def test_infeasible_names_budget_mesh_and_offload():
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(
            build_model("mlp"),
            mesh=(2,),
            example_inputs=example_batch("mlp", 8),
            cluster="cpu",
            memory_budget=1024,
            checkpointing=False,
        )
    message = str(info.value)
    assert "Raise the budget" in message and "larger mesh" in message
    assert 'offload="auto"' in message and "checkpointing=True" in message and "--offload auto" in message
    assert len(message.splitlines()) > 3  # the largest tensors, one a line
    # checkpointing is allowed by default: the error says it was tried, and names offload
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(build_model("mlp"), mesh=(2,), example_inputs=example_batch("mlp", 8), cluster="cpu", memory_budget=1024)
    message = str(info.value)
    assert "even with checkpointing every layer" in message and "Raise the budget" in message
    assert 'offload="auto"' in message and "--offload auto" in message


def test_different_graph_names_the_reshaped_input(mlp_plan):
    traced = trace(build_model("mlp"), example_batch("mlp", 4))
    with pytest.raises(PlanError) as info:
        check_plan_matches(mlp_plan, traced, (2,))
    message = str(info.value)
    assert message.startswith("the plan was made for a different graph")
    assert "input 'x' has shape (4, 32)" in message and "(8, 32)" in message
    assert "re-plan" in message


def test_different_graph_names_added_removed_and_reshaped_parameters(mlp_plan):
    traced = trace(build_model("mlp", d_hidden=64, depth=3), example_batch("mlp", 8))
    with pytest.raises(PlanError) as info:
        check_plan_matches(mlp_plan, traced, (2,))
    message = str(info.value)
    assert "parameter 'layers.0.weight' has shape (64, 32)" in message and "(128, 32)" in message
    assert "parameter 'layers.2.weight' is new" in message
    assert "re-plan" in message


def test_different_graph_names_the_input_whose_dtype_changed(mlp_plan):
    x, y = example_batch("mlp", 8)
    traced = trace(build_model("mlp").double(), (x.double(), y.double()))
    with pytest.raises(PlanError) as info:
        check_plan_matches(mlp_plan, traced, (2,))
    message = str(info.value)
    assert "input 'x' has dtype torch.float64; the plan was made for torch.float32" in message
    assert "parameter 'layers.0.weight' has dtype torch.float64" in message and "re-plan" in message


def test_plan_from_another_torch_says_replan_with_this_torch(mlp_plan):
    traced = trace(build_model("mlp"), example_batch("mlp", 8))
    with pytest.raises(PlanError) as info:
        check_plan_matches(dataclasses.replace(mlp_plan, torch_version="1.0.0"), traced, (2,))
    assert "made with torch 1.0.0" in str(info.value) and "re-plan with this torch" in str(info.value)


def test_pass_error_asks_for_a_report_with_the_plan(mlp_plan):
    def broken(gm, plan):
        raise RuntimeError("boom")

    traced = trace(build_model("mlp"), example_batch("mlp", 8))
    with pytest.raises(PassError) as info:
        run_passes(traced.gm, mlp_plan, [broken])
    message = str(info.value)
    assert "pass broken failed (passes run before it: none)" in message
    assert "please report it with the plan JSON" in message


def test_mesh_larger_than_the_world_names_the_world_size(one_rank_group):
    with pytest.raises(MeshError) as info:
        autopar.compile(build_model("mlp"), mesh=(2, 4), example_inputs=example_batch("mlp", 8))
    assert "mesh (2, 4) has 8 devices but the world size is 1" in str(info.value)
    assert "pass a mesh whose sizes multiply to 1" in str(info.value)


def test_bfloat16_on_a_gloo_that_cannot_sum_it_names_float32(one_rank_group, monkeypatch):
    monkeypatch.setitem(compile_checks._REDUCES, ("gloo", torch.bfloat16), False)  # an older gloo build
    with pytest.raises(ValueError) as info:
        autopar.compile(build_model("mlp").bfloat16(), mesh=(1,), example_inputs=example_batch("mlp", 8))
    assert "gloo backend cannot reduce" in str(info.value)
    assert "model.float()" in str(info.value) and "NCCL" in str(info.value)


def test_a_precision_the_runtime_does_not_carry_out_names_the_fix(one_rank_group):
    policy = autopar.MixedPrecision("bfloat16", "float32")  # fp32 reductions of bf16 weights, no master copy
    with pytest.raises(PlanError) as info:
        autopar.compile(build_model("mlp"), mesh=(1,), example_inputs=example_batch("mlp", 8), precision=policy)
    assert "master_dtype='float32'" in str(info.value) and "reduce_dtype='bfloat16'" in str(info.value)


def test_larger_input_shapes_name_the_planned_shape(compiled_mlp):
    x, y = example_batch("mlp", 16)  # smaller ones are planned again per shape (runtime.shapes)
    with pytest.raises(InputError) as info:
        compiled_mlp(x, y)
    message = str(info.value)
    assert "input 'x' has shape (16, 32)" in message and "planned for shape (8, 32)" in message
    assert "compile again" in message


def test_missing_argument_is_named_not_a_treespec(compiled_mlp):
    x, _ = example_batch("mlp", 8)
    with pytest.raises(InputError) as info:
        compiled_mlp(x)
    message = str(info.value)
    assert "missing argument 'y'" in message and "TreeSpec" not in message
    with pytest.raises(InputError, match="unexpected keyword argument 'z'"):
        compiled_mlp(*example_batch("mlp", 8), z=1)


def test_ranks_with_different_plans_are_told_to_share_one(one_rank_group, mlp_plan, monkeypatch):
    def gather(label, fn, hashes, value):
        hashes[:] = [value, "0123456789abcdef"]

    monkeypatch.setattr(agreement.collectives, "call_on_world", gather)
    with pytest.raises(PlanError) as info:
        agreement.check_rank_agreement(mlp_plan)
    assert "ranks hold different plans" in str(info.value)
    assert "give every rank the same plan file and model" in str(info.value)


def test_collective_error_blames_a_closed_connection_not_a_timeout(one_rank_group):
    from autopar.ops import collectives

    error = collectives._collective_error(
        "all-reduce", "no-such-group", RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    )
    message = str(error)
    assert isinstance(error, CollectiveError)
    assert "a peer closed its connection" in message and "did not answer within the timeout" not in message
    assert "restart the job" in message
    timeout = str(collectives._collective_error("all-reduce", "no-such-group", RuntimeError("Timed out")))
    assert "did not answer within the timeout" in timeout


class _SummedLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.linear(x), y, reduction="sum")


def test_a_pipelined_summed_loss_names_the_mean(one_rank_group):
    with pytest.raises(ModelError) as info:
        autopar.compile(
            _SummedLoss(),
            (1,),
            example_inputs=(torch.randn(4, 8), torch.tensor([1, 2, 3, 4])),
            pipeline=1,
            num_microbatches=2,
            cluster="cpu",
        )
    message = str(info.value)
    assert "reduction='sum'" in message and "num_items_in_batch" in message and "without a pipeline" in message


def test_a_microbatch_without_targets_names_the_reorder(one_rank_group):
    idx, targets = example_batch("gpt", 4)
    pm = autopar.compile(build_model("gpt"), (1,), example_inputs=(idx, targets), pipeline=1, num_microbatches=2, cluster="cpu")
    targets[2:] = -100
    with pytest.raises(InputError) as info:
        pm(idx, targets)
    message = str(info.value)
    assert "microbatch 1 of this step holds no target other than ignore_index (-100)" in message
    assert "reorder the batch's rows" in message and "fewer microbatches" in message


class _ScaledBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8), persistent=False)

    def forward(self, x):
        return self.linear(x * self.scale).pow(2).mean()


def test_from_checkpoint_of_a_model_with_unsaved_buffers_names_unsaved(one_rank_group, tmp_path):
    with torch.device("meta"):
        model = _ScaledBuffer()
    with pytest.raises(ModelError) as info:
        autopar.compile(
            model, (1,), example_inputs=(torch.randn(4, 8),), cluster="cpu", init=autopar.FromCheckpoint(tmp_path / "ckpt")
        )
    message = str(info.value)
    assert "non-persistent: scale" in message and "FromCheckpoint(path, unsaved=autopar.SeededInit(" in message


def _gpt_offload_plan():
    """A small GPT, its batch, and its plan under 40% of its unbounded peak: checkpointing, and
    offloaded parameters, gradients and AdamW state."""
    model = autopar.zoo.models.GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
    batch = example_batch("gpt", 4)
    free = autopar.plan(model, (1,), example_inputs=batch, cluster="cpu")
    plan = autopar.plan(
        model, (1,), example_inputs=batch, cluster="cpu", memory_budget=0.4 * free.predicted.peak_memory_bytes, offload="auto"
    )
    return model, batch, plan


def test_a_torch_optimizer_over_offloaded_state_names_autopar_adamw(one_rank_group, tmp_path):
    # Offloaded optimizer state alone: parameters and gradients stay resident, so torch's AdamW
    # would step them and quietly make its state on the device, over the budget.
    model, batch, plan = _gpt_offload_plan()
    states = tuple(entry for entry in plan.memory.offload if entry.kind == "optimizer_state")
    assert states, "the budget should offload optimizer state"
    plan = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, offload=states))
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path}")
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(*batch).backward()
    with pytest.raises(OffloadError) as info:
        optimizer.step()
    message = str(info.value)
    assert "torch.optim.adamw.AdamW steps parameter" in message and "optimizer state the plan offloads" in message
    assert "autopar.optim.AdamW, which takes the same arguments as torch.optim.AdamW" in message
    assert not optimizer.state, "no optimizer state may have been made on the device"
    autopar.optim.AdamW(pm.parameters(), lr=1e-3).step()  # the class swapped, the arguments kept


def test_a_hook_added_after_compile_names_registering_before_compile(compiled_mlp):
    from autopar.errors import HookError

    name, module = next((n, m) for n, m in compiled_mlp.module.named_modules() if n)
    with pytest.raises(HookError) as info:
        module.register_forward_hook(lambda mod, args, out: out)
    message = str(info.value)
    assert f"module {name!r}" in message and "before autopar.compile" in message


def test_a_hand_edited_op_names_the_node_and_the_allowed_choices(mlp_plan):
    import json

    from autopar.passes.plan_check import check_plan_strategies

    data = json.loads(mlp_plan.to_json())
    name = next(n for n, node in data["nodes"].items() if node["op"].endswith("linear.default"))
    data["nodes"][name]["out"] = [["S(0)"]] if data["nodes"][name]["out"] != [["S(0)"]] else [["S(1)"]]
    data["nodes"][name]["in"] = [["R"] for _ in data["nodes"][name]["in"]]
    with pytest.raises(PlanError) as info:
        check_plan_strategies(autopar.Plan.from_json(json.dumps(data)), trace(build_model("mlp"), example_batch("mlp", 8)))
    message = str(info.value)
    assert f"node {name!r}" in message and "which no strategy of its rule allows. Allowed: in (R)" in message
    assert "re-plan" in message


def test_a_flipped_byte_names_the_file_and_tensor_and_loads_nothing(compiled_mlp, tmp_path):
    import torch.distributed.checkpoint as dcp

    from autopar.errors import CheckpointError

    autopar.checkpoint.save(tmp_path / "ckpt", compiled_mlp)
    metadata = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.endswith("weight"))
    shard = tmp_path / "ckpt" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info_error:
        autopar.checkpoint.load(tmp_path / "ckpt", compiled_mlp)
    message = str(info_error.value)
    assert f"{info.relative_path}: {index.fqn}" in message and "No tensor was loaded" in message
    assert "restore these files or load another checkpoint" in message


def test_ranks_in_different_calls_are_told_every_rank_must_call():
    from autopar.runtime.data import PartialCallError, check_same_call

    with pytest.raises(PartialCallError) as info:
        check_same_call(torch.tensor([[5.0, 0.0], [5.0, 1.0]]))
    message = str(info.value)
    assert "every rank must call the compiled module" in message and "rank 0: call 5 in eval mode" in message
    assert "Run it on every rank" in message and "torch.no_grad()" in message


def test_trainer_checkpoints_refuse_best_model_tracking_with_the_strategies_they_take(compiled_mlp):
    import types

    pytest.importorskip("transformers")
    from autopar.errors import CheckpointError

    callback = autopar.checkpoint.trainer_callback()
    for best in (
        {"load_best_model_at_end": True, "save_strategy": "steps"},
        {"load_best_model_at_end": False, "save_strategy": "best"},
    ):
        with pytest.raises(CheckpointError) as info:
            callback.on_init_end(types.SimpleNamespace(**best), None, None, model=compiled_mlp)
        message = str(info.value)
        assert "cannot track the best checkpoint" in message
        assert "load_best_model_at_end=False" in message and "'steps' or 'epoch'" in message


def test_pickling_a_compiled_module_names_its_state_dict_and_dcp(compiled_mlp):
    import io

    from autopar.errors import CheckpointError

    with pytest.raises(CheckpointError) as info:
        torch.save(compiled_mlp, io.BytesIO())
    message = str(info.value)
    assert message.startswith("a compiled module cannot be pickled")
    assert "pm.module.state_dict() on every rank" in message and "autopar.checkpoint.save" in message


def test_trainers_own_save_names_the_callback(one_rank_group, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from autopar.errors import CheckpointError
    from tests.runtime import hf_trainer_job as job

    pm = autopar.compile(job.tiny_llama(), mesh=(1,), example_kwargs=job.example_batch(), cluster="cpu")
    trainer = Trainer(model=pm, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    with pytest.raises(CheckpointError) as info:
        trainer.save_model()
    message = str(info.value)
    assert "saves the model from rank 0 alone" in message
    assert "callbacks=[autopar.checkpoint.trainer_callback()]" in message and "pm.module.save_pretrained" in message


def test_a_gather_of_the_whole_state_on_some_ranks_names_calling_it_on_every_rank():
    from autopar.runtime.data import GATHER, PartialCallError, check_same_call

    with pytest.raises(PartialCallError) as info:
        check_same_call(torch.tensor([[4.0, float(GATHER)], [5.0, 1.0]]))
    message = str(info.value)
    assert "rank 0: gathering the whole state after call 4; rank 1: call 5 in train mode" in message
    assert "Call it on every rank and let rank 0 alone write the file" in message


def test_an_optimizer_keeping_more_state_than_the_budget_has_room_for_names_the_declaration(one_rank_group):
    model = autopar.zoo.models.GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
    batch = example_batch("gpt", 4)
    budget = 1.02 * autopar.plan(model, (1,), example_inputs=batch, cluster="cpu").predicted.peak_memory_bytes
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", memory_budget=budget)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3, amsgrad=True)
    pm(*batch).backward()
    with pytest.raises(ConfigError) as info:
        optimizer.step()
    message = str(info.value)
    assert "holds" in message and "more optimizer state on this rank than the plan priced for torch's AdamW" in message
    assert "optimizer='adamw-amsgrad:for-loop'" in message and "memory_budget" in message


def test_an_offloading_module_trained_in_another_mode_names_the_compiled_one(one_rank_group, tmp_path):
    model, batch, plan = _gpt_offload_plan()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=f"disk:{tmp_path}")
    shorter = tuple(t[:, :16].contiguous() for t in batch)
    pm(*shorter).backward()  # a shorter batch trains, under the same memory decisions
    pm.module.transformer.h[0].eval()
    with pytest.raises(PlanError) as info:
        pm(*batch)
    message = str(info.value)
    assert "a call in train (with 'transformer.h.0' in eval mode) mode: this plan offloads" in message
    assert "trains in the mode it was compiled in alone" in message and "offload='off'" in message
    pm.module.transformer.h[0].train()
    pm.eval()
    pm(*shorter)  # an eval graph runs any shape
