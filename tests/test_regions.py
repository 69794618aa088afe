import pytest
from torch import nn

from lightning_fuse.regions import find_repeated_blocks, format_plan, resolve_regions
from tests.toy import Block, ToyTask


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


class Nested(nn.Module):
    """encoder.layers is a repeated ModuleList; decoder.stages is a Sequential of different classes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Layer() for _ in range(3))
        self.decoder = nn.Module()
        self.decoder.stages = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.head = nn.Linear(2, 2)


def names(regions):
    return [r.name for r in regions]


def test_auto_selects_repeated_blocks_in_nested_models():
    assert names(resolve_regions(Nested(), "auto")) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    assert find_repeated_blocks(ToyTask()) == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def test_auto_searches_inside_repeated_groups_that_cannot_be_called():
    """HF's Funnel keeps its layers in a ModuleList of ModuleLists: a group has no forward, so compiling one
    compiles nothing. Its layers are the blocks."""
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleList(Layer() for _ in range(2)) for _ in range(2))
    assert find_repeated_blocks(model) == ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1"]


def test_auto_without_repeats_falls_back_to_the_whole_model():
    model = nn.Module()
    model.net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    model.other = nn.Linear(1, 1)
    assert names(resolve_regions(model, "auto")) == ["net", "other"]


def test_auto_compiles_the_whole_network_where_the_repeated_blocks_hold_almost_none_of_it():
    """HF's Time Series Transformer with one layer a side repeats only three 17-parameter output projections, 1% of
    its parameters: compiling those would leave the network eager. The whole network is compiled instead."""
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    model.heads = nn.ModuleList(nn.Linear(64, 1) for _ in range(3))
    assert names(resolve_regions(model, "auto")) == ["body", "heads"]
    model.body = nn.Linear(64, 1)  # now the heads hold three quarters of the parameters: they are the body
    assert names(resolve_regions(model, "auto")) == ["heads.0", "heads.1", "heads.2"]


def test_globs_classes_and_class_names():
    model = Nested()
    assert names(resolve_regions(model, "encoder.layers.*.mlp")) == [f"encoder.layers.{i}.mlp" for i in range(3)]
    assert names(resolve_regions(model, Attention)) == [f"encoder.layers.{i}.attn" for i in range(3)]
    assert names(resolve_regions(model, "Attention")) == [f"encoder.layers.{i}.attn" for i in range(3)]
    assert names(resolve_regions(model, ["head", "decoder.stages.2"])) == ["decoder.stages.2", "head"]


def test_overlapping_matches_compile_the_outermost_once():
    model = Nested()
    regions = resolve_regions(model, ["encoder.layers.*", "encoder.layers.1.attn", Layer, "encoder.*"])
    assert names(regions) == ["encoder.layers"]


def test_exclude_removes_and_splits_around_excluded_modules():
    model = Nested()
    assert names(resolve_regions(model, "full", exclude="head")) == ["decoder", "encoder"]
    regions = resolve_regions(model, "encoder", exclude="encoder.layers.1")
    assert names(regions) == ["encoder.layers.0", "encoder.layers.2"]


def test_full_selects_top_level_children_with_parameters():
    task = ToyTask()
    assert names(resolve_regions(task, "full")) == ["model"]


def test_pattern_matching_nothing_names_it_and_suggests_close_names():
    with pytest.raises(ValueError, match=r"'model\.blokcs\.\*' matches no submodule.*model\.blocks"):
        resolve_regions(ToyTask(), "model.blokcs.*")
    with pytest.raises(ValueError, match="`exclude` entry 'nothing'"):
        resolve_regions(ToyTask(), "auto", exclude="nothing")
    with pytest.raises(ValueError, match="'Conv2d' matches no submodule"):
        resolve_regions(ToyTask(), nn.Conv2d)


@pytest.mark.parametrize("bad", [3, [Block, 1.5], {"a": 1}, None])
def test_targets_of_the_wrong_type_raise_type_error(bad):
    with pytest.raises(TypeError, match="targets"):
        resolve_regions(ToyTask(), bad)


def test_non_module_class_is_refused():
    with pytest.raises(TypeError, match="not a torch.nn.Module subclass"):
        resolve_regions(ToyTask(), int)


def test_metrics_are_never_selected():
    torchmetrics = pytest.importorskip("torchmetrics")
    task = ToyTask()
    task.acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
    assert "acc" not in names(resolve_regions(task, "full"))
    with pytest.raises(ValueError):
        resolve_regions(task, "acc")


def test_plan_table_lists_regions_classes_and_parameter_counts():
    task = ToyTask()
    text = format_plan(resolve_regions(task, "auto"), task)
    assert "3 region(s)" in text and "model.blocks.2" in text and "Block" in text
    assert f"{sum(p.numel() for p in task.model.blocks[0].parameters()) / 1e3:.1f}K" in text


def test_auto_compiles_the_whole_network_when_blocks_differ_in_shape():
    from recipes.models import resnet18_cifar

    holder = nn.Module()
    holder.model = resnet18_cifar()  # 8 BasicBlocks over 4 widths: not interchangeable
    assert names(resolve_regions(holder, "auto")) == ["model"]
    assert names(resolve_regions(holder, "BasicBlock"))[:2] == ["model.layer1.0", "model.layer1.1"]
