"""What a fit puts on the model and on torch (lightning_fuse.hooks) is taken off again, all of it."""

from __future__ import annotations

import functools

import torch
from lightning.pytorch.plugins import Precision
from torch import nn

from lightning_fuse import compat
from lightning_fuse.hooks import FitHooks
from tests.toy import FunctionalDropoutBlock, ToyTask


class CachedLM(nn.Module):
    """An HF-style causal LM: a config with use_cache on, a forward that takes it."""

    config = type("Config", (), {"use_cache": True})()

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        self.use_cache = use_cache
        return x


def test_install_then_remove_leaves_the_model_and_torch_as_they_were():
    task, network = ToyTask(), CachedLM()
    limit, backward = compat.dynamo_recompile_limit(), task.backward
    dropped: list[str] = []
    hooks = FitHooks.install(network, task, Precision(), dropped.append, pad_buckets=[8, 16])
    hooks.raise_recompile_limit(regions=4, limit=8)
    assert compat.dynamo_recompile_limit() == max(limit, 36)  # (8 + 1) recompiles for each of 4 regions
    network.train()(torch.zeros(2, 5))
    assert network.use_cache is False and hooks.shapes.calls == 1 and hooks.recorded is not None
    hooks.set_plan_step(False)  # an eager reference step: the call as the user wrote it
    network(torch.zeros(2, 5))
    assert network.use_cache is None and hooks.buckets.sizes == [8, 16]
    assert task.backward != backward  # the backward guard is on
    hooks.stop_recording()
    network(torch.zeros(2, 7))
    assert hooks.shapes.calls == 2  # no longer recorded
    hooks.remove()
    network(torch.zeros(2, 5))
    assert network.use_cache is None and task.backward == backward and "backward" not in vars(task)
    assert compat.dynamo_recompile_limit() == limit and not dropped
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert not network._forward_pre_hooks and not network._forward_hooks


def test_the_recorder_sees_whether_the_networks_calls_draw_random_numbers():
    """Dropout written as a function shows in no module tree, only in the generator it draws from: the search then
    does not hold the candidates' losses to eager's."""
    for network, training, drew in ((FunctionalDropoutBlock(4), False, False), (FunctionalDropoutBlock(4), True, True),
                                    (nn.Linear(4, 4), True, False)):  # fmt: skip
        network.train(training)
        hooks = FitHooks()
        hooks.start_recording(network)
        network(torch.ones(2, 4))
        hooks.stop_recording()
        assert hooks.random.drew is drew
        network(torch.ones(2, 4))  # no longer watched
        assert not network._forward_pre_hooks and not network._forward_hooks


def test_the_recompile_limit_rises_above_what_earlier_fits_left_on_a_shared_forward():
    """HF's forwards share one decorator's code: each model class compiled earlier in the process left an entry
    there, and dynamo counts them against its limit. At the tenth fit of a sweep over classes in one process,
    every call ran eagerly while the plan said regions."""

    def shared(forward):
        @functools.wraps(forward)
        def wrapper(self, x):
            return forward(self, x)

        return wrapper

    classes = [type(f"Net{i}", (nn.Linear,), {"forward": shared(nn.Linear.forward)}) for i in range(3)]
    torch.compiler.reset()
    for cls in classes:
        torch.compile(cls(2, 2), backend="eager")(torch.zeros(1, 2))
    assert compat.cache_entries(classes[0].forward.__code__) == 3, "one entry per class, on the shared code"
    before = compat.dynamo_recompile_limit()
    hooks = FitHooks()
    hooks.raise_recompile_limit(regions=1, limit=8, modules=[classes[0](2, 2)])
    assert compat.dynamo_recompile_limit() == max(before, 3 + 9), "(8 + 1) recompiles above the 3 left"
    hooks.remove()
    assert compat.dynamo_recompile_limit() == before
    torch.compiler.reset()


def test_a_recompile_limit_already_higher_is_kept():
    before = compat.dynamo_recompile_limit()
    compat.set_dynamo_recompile_limit(1000)
    try:
        hooks = FitHooks()
        hooks.raise_recompile_limit(regions=1, limit=8)
        assert compat.dynamo_recompile_limit() == 1000
        hooks.remove()
        assert compat.dynamo_recompile_limit() == 1000
    finally:
        compat.set_dynamo_recompile_limit(before)
