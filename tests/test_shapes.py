"""Dynamic dims: partial last batches and varying lengths compile once, not once per shape."""

import dataclasses
from collections import Counter
from enum import Enum
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_fuse import FuseCallback
from lightning_fuse.shapes import CompileTracker, DynamicDims, RegionCompiles, explain_graph_break, warn_recompile
from tests.toy import ToyTask, trainer
from tests.user_models import SequenceNet, VariableLengthTask


def test_partial_last_batch_two_epochs_compile_at_most_twice_per_region():
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, eager_steps=0)
    task = ToyTask(samples=70, batch_size=16)  # 4 full batches and one of 6, in train and in validation
    trainer([fuse], max_epochs=2).fit(task)
    for name, stats in fuse.tracker.regions.items():
        assert stats.compiles <= 2, (name, stats)  # one graph in train mode, one in eval mode
        assert stats.recompiles == 0, (name, stats)
    assert fuse.history[-1]["fuse/recompiles"] == 0


def test_without_dynamic_dims_the_partial_batch_recompiles_and_is_reported():
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, dynamic_dims=None, eager_steps=0)
    with pytest.warns(UserWarning, match="region 'model.blocks.0' recompiled.*size mismatch"):
        trainer([fuse], max_epochs=1).fit(ToyTask(samples=70, batch_size=16))
    assert fuse.tracker.stats("model.blocks.0").recompiles >= 1


def test_train_eval_switching_does_not_recompile_each_epoch():
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, eager_steps=0)
    trainer([fuse], max_epochs=3).fit(ToyTask(samples=64, batch_size=16))
    assert fuse.tracker.stats("model.blocks.0").compiles == 2
    assert fuse.tracker.total_recompiles == 0


class TokenBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):  # (B, T, C)
        return x + torch.tanh(self.proj(x)).cumsum(1) / x.shape[1]


class SequenceTask(pl.LightningModule):
    """Batches of token ids whose length varies from batch to batch."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(32, 8)
        self.model.blocks = nn.ModuleList(TokenBlock(8) for _ in range(2))
        self.model.head = nn.Linear(8, 32)

    def training_step(self, batch, batch_idx):
        x = self.model.embed(batch["input_ids"])
        for block in self.model.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.model.head(x).flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        lengths = [5, 9, 7, 12, 6, 10]
        batches = [{"input_ids": torch.randint(0, 32, (4, t)), "labels": torch.randint(0, 32, (4, t))}
                   for t in lengths]
        return DataLoader(batches, batch_size=None)


def test_declared_sequence_dim_compiles_once_for_all_lengths():
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, dynamic_dims={"input_ids": [0, 1]},
                        eager_steps=0)
    trainer([fuse], max_epochs=1).fit(SequenceTask())
    stats = fuse.tracker.stats("model.blocks.0")
    assert stats.compiles == 1 and stats.recompiles == 0, stats


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def test_spec_walks_dicts_tuples_and_dataclasses():
    nested = {"a": (torch.zeros(5, 3), [torch.zeros(5)]), "b": torch.zeros(5, 2)}
    assert DynamicDims("auto").apply(nested) == {(0, 5)}
    assert DynamicDims({"y": [0]}).apply(Pair(torch.zeros(3, 2), torch.zeros(4))) == {(0, 4)}
    assert DynamicDims({1: [-1]}).apply((torch.zeros(2), torch.zeros(3, 7))) == {(1, 7)}
    assert DynamicDims("auto").apply(nested, partial_possible=False) == set()
    assert DynamicDims(None).apply(nested) == set()


def test_sizes_zero_and_one_are_not_marked():
    assert DynamicDims({0: [0, 1]}).apply((torch.zeros(1, 4),)) == {(1, 4)}


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ([0], TypeError, "must be \"auto\", None or a mapping"),
        ({"x": "0"}, TypeError, r"dynamic_dims\['x'\]. must be a list of ints"),
        ({1.5: [0]}, TypeError, "keys must be str or int"),
        ({"x": [True]}, TypeError, "list of ints"),
    ],
)
def test_bad_specs_fail_at_construction(spec, error, match):
    with pytest.raises(error, match=match):
        FuseCallback(dynamic_dims=spec)


def test_unknown_key_and_dim_out_of_range_name_the_fix():
    with pytest.raises(ValueError, match=r"names key 'ids', but the batch \(dict\) has keys \['input_ids'\]"):
        DynamicDims({"ids": [0]}).apply({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"names dim 2, but that batch entry has shape \(2, 3\)"):
        DynamicDims({"input_ids": [2]}).apply({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="int indices for tuples"):
        DynamicDims({3: [0]}).apply((torch.zeros(2),))


class _Unsized(Dataset):
    def __getitem__(self, i):
        return torch.zeros(2)


def test_auto_policy_reads_the_loader():
    from lightning_fuse.shapes import can_yield_partial_batch

    data = torch.utils.data.TensorDataset(torch.zeros(10, 2))
    assert can_yield_partial_batch(DataLoader(data, batch_size=4))
    assert not can_yield_partial_batch(DataLoader(data, batch_size=4, drop_last=True))
    assert not can_yield_partial_batch(DataLoader(data, batch_size=5))
    assert can_yield_partial_batch([DataLoader(data, batch_size=5), DataLoader(data, batch_size=3)])
    ready = [torch.zeros(4, 2), torch.zeros(4, 2)]  # batches made by the dataset: nothing marked in advance
    assert not can_yield_partial_batch(DataLoader(ready, batch_size=None))


class BreakingBlock(nn.Module):
    """Data-dependent Python control flow: dynamo must break the graph here."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum().item() > 0:
            return y.relu()
        return y


def test_graph_breaks_are_counted_per_region_logged_and_explained(caplog):
    task = ToyTask(samples=64)
    task.model.blocks = nn.ModuleList(BreakingBlock() for _ in range(2))
    task.model.embed = nn.Linear(8, 8)
    task.model.head = nn.Linear(8, 4)
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, eager_steps=0)
    with caplog.at_level("INFO"):
        trainer([fuse], max_epochs=1).fit(task)
    stats = fuse.tracker.stats("model.blocks.0")
    assert stats.graph_breaks >= 1 and stats.break_reasons
    assert fuse.history[0]["fuse/graph_breaks"] >= 1
    assert "model.blocks.0 graph break" in caplog.text and "fix:" in caplog.text


def test_a_graph_the_backend_refuses_counts_as_a_graph_break_with_its_place_and_the_cost_of_every_run():
    """Inductor refusing a graph (a value read in a custom backward: transformers 5.17's MoE grouped-mm fallback on
    an H200's Mixtral, 21 times a fit) makes dynamo run it uncompiled, counted apart from its graph breaks."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def refusing(gm, example_inputs):
        raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    tracker = CompileTracker()
    tracker.install()
    try:
        with tracker.calling("block", (True, True, False)):
            torch.compile(nn.Linear(3, 3), backend=refusing)(torch.ones(2, 3))
    finally:
        tracker.remove()
    stats = tracker.stats("block")
    assert (stats.compiles, stats.graph_breaks) == (1, 1)
    reason = stats.break_reasons[0]
    assert "Backend compiler `refusing` failed with aten._local_scalar_dense" in reason and "(at " in reason
    assert "refused again in every run" in explain_graph_break(reason)


def test_only_dynamo_compiles_count_a_lazy_backward_adds_time_and_a_cudagraph_recording_counts_apart():
    trigger = Enum("CallbackTrigger", "DYNAMO LAZY_BACKWARD CUDAGRAPH_RECORDING")
    tracker = CompileTracker()

    def callback(kind: str, compile_id: str = "0/1") -> None:
        args = SimpleNamespace(callback_trigger=trigger[kind], compile_id=compile_id)
        tracker._on_start(args)
        tracker._on_end(args)

    with tracker.calling("block", (True, True, False)):
        callback("DYNAMO", "0/0")  # the region's first call in this mode: a compile
    for _ in range(3):  # the trees record a graph for each new size, in the region's later calls
        with tracker.calling("block", (True, True, False)):
            callback("CUDAGRAPH_RECORDING")
    callback("LAZY_BACKWARD")  # the backward, compiled at its first call, outside any region call
    stats = tracker.stats("block")
    assert (stats.compiles, stats.recompiles, tracker.total_compiles) == (1, 0, 1)
    assert tracker.stats(CompileTracker.OUTSIDE).compiles == 0
    assert tracker.recordings == 3


def test_lengths_found_varying_before_the_plan_compile_dynamic_from_the_plans_first_step():
    """The dims found varying over the first calls are marked on the batch of the step that activates the plan
    too: its first compile is already dynamic, so no later length recompiles. Before, a plan that no search had
    compiled (a fixed one, as here, or one from the cached decision) compiled that batch's length static, and
    recompiled every region at the next length: on a warm start, a compile the cache did not hold."""
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False)  # eager first steps: lengths seen
    trainer([fuse], max_epochs=2).fit(VariableLengthTask())
    assert fuse.fit.activation_step > 0 and fuse.fit.varying_dims == {1}
    assert fuse.tracker.stats("model.blocks.0").compiles == 1, "one compile, dynamic (blocks.1 runs its code)"
    assert fuse.tracker.total_recompiles == 0, fuse.tracker.regions


class TextAndImage(nn.Module):
    """CLIP-style: a text tower over tokens whose length varies (dim 1), and an image tower on 3 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = SequenceNet(), nn.Conv2d(3, 3, 1)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.text(tokens, mask) + self.image(image).mean((2, 3))


class TextAndImageTask(VariableLengthTask):
    def __init__(self) -> None:
        super().__init__()
        self.model = TextAndImage()

    def training_step(self, batch, batch_idx):
        image = torch.ones(batch["tokens"].shape[0], 3, 4, 4)
        return torch.nn.functional.cross_entropy(self.model(batch["tokens"], batch["mask"], image), batch["labels"])


def test_a_varying_dim_is_not_marked_where_it_held_a_fixed_size_in_inputs_that_never_varied():
    """Text lengths vary in dim 1; the images' dim 1 is their 3 channels. Marking dim 1 on every input made the
    image tower's channels dynamic too (a CPU sweep found it on HF DETR and YOLOS, whose box counts vary in dim 0
    beside a fixed batch of images)."""
    from lightning_fuse.shapes import mark_dims

    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False)
    trainer([fuse], max_epochs=1).fit(TextAndImageTask())
    assert fuse.fit.varying_dims == {1} and fuse.fit.static_sizes == {1: {3}}
    tokens, image = torch.zeros(2, 9), torch.zeros(2, 3, 4, 4)
    assert mark_dims((tokens, image), fuse.fit.varying_dims, fuse.fit.static_sizes) == {(1, 9)}
    assert fuse.tracker.total_recompiles == 0, fuse.tracker.regions


@pytest.mark.parametrize(("reason", "hint"), [
    ("0/2: len(G['__import_transformers_dot_utils_dot_output_capturing']._active_collector.context_var.get()"
     "['router_logits']) == 4", "output_router_logits"),  # HF Mixtral: each layer appends to a list
    ("22/0: GLOBAL_STATE changed: grad_mode", "another global setting"),  # HF DETR's matcher under no_grad
    ("0/0: KeyError on self._modules['mlp']._modules['0']._parameters['bias']", "ModelPruning"),  # pruned
])
def test_a_recompile_on_a_global_does_not_ask_the_user_to_declare_a_dim(reason, hint):
    """Guards on a global Python value or on global state (grad mode) are not an input's size: the hint once
    pointed at ``dynamic_dims`` for both."""
    stats = RegionCompiles(recompiles_by_code=Counter({"0": 1}), recompile_reasons=[reason])
    with pytest.warns(UserWarning, match="recompiled") as caught:
        warn_recompile("model.model.layers.1", stats)
    message = str(caught[0].message)
    assert hint in message and "declare it with `dynamic_dims`" not in message


@pytest.mark.parametrize(("marked", "hint"), [({1}, "Dim 1 was marked dynamic, but the first compile specialised it"),
                                              ({0}, "declare it with `dynamic_dims`")])
def test_a_recompile_over_a_dim_the_fit_marked_does_not_ask_the_user_to_declare_it(marked, hint):
    """DeBERTa's blocks over varying lengths: the length was marked on their inputs, and dynamo still compiled it
    static beside the attention mask's dims; declaring it would change nothing."""
    stats = RegionCompiles(recompiles_by_code=Counter({"0": 1}),
                           recompile_reasons=["0/0: tensor 'args[0]' size mismatch at index 1. expected 5, actual 14"])
    with pytest.warns(UserWarning, match="recompiled") as caught:
        warn_recompile("model.layer.0", stats, marked=marked)
    assert hint in str(caught[0].message)


@pytest.mark.parametrize("reason", [
    "36/0: tensor 'targets[2]['boxes']' size mismatch at index 0. expected 1, actual 2",  # Faster R-CNN, an H200
    "1/1: 2 <= x.size()[0] # return F.linear(input, self.weight, self.bias) # nn/modules/linear.py:134 in forward "
    "(user code shown is first use of this value--the guard itself is not due user code but due to 0/1 "
    "specialization in the framework; ...)",  # a toy fit's last batch of one, on CPU
])
def test_a_recompile_over_a_size_of_one_names_torchs_constant_sizes(reason):
    """torchvision's Faster R-CNN on an H200: each image's boxes are a tensor of their own, some of one row; torch
    compiles sizes 0 and 1 as constants even in a marked dim, so the region recompiled for each mix (56 times).
    The hint once blamed a static size beside the dim and said there was nothing to do, or asked to declare a dim
    that was declared."""
    stats = RegionCompiles(recompiles_by_code=Counter({"36": 9}), recompile_reasons=[reason])
    with pytest.warns(UserWarning, match="recompiled") as caught:
        warn_recompile("model", stats, marked={0})
    message = str(caught[0].message)
    assert "a size of 0 or 1, which torch compiles as a constant" in message and "`targets`" in message
    assert "first compile specialised it" not in message and "declare it with `dynamic_dims`" not in message
