"""Adam's step counters between the graph's configuration and the user's (lightning_fuse/step_counters.py).

On CPU the "device" counters are CPU tensors too, so these tests check what the GPU relies on by identity and
value: the tensors a captured graph reads stay the same objects and hold the right count, and every eager update
runs with the user's ``capturable`` setting (under the graph's, torch's foreach Adam adds two kernels a parameter).
"""

from __future__ import annotations

import torch

from lightning_fuse.step_counters import StepCounters
from tests.faults import default_adamw_under_graph


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, x: float) -> None:
    optimizer.zero_grad()
    net(torch.full((1, 2), x)).sum().backward()
    optimizer.step()


def test_eager_updates_between_replays_run_as_the_user_configured_them_and_train_as_plain_adamw():
    """Eager reference steps among replays (a default AdamW): each eager update sees ``capturable=False`` and host
    counters; the replays keep reading the same counter tensors, which hold the count; the parameters and counts
    end as a plain AdamW's."""
    net, optimizer, graph, twin, twin_optimizer = default_adamw_under_graph()
    graph.trial.settle(0.5)  # kept: only the reference steps update eagerly (the trial's eager blocks alike)
    seen: list[tuple[bool, float]] = []  # (capturable, the weight's count) at each update the optimizer runs
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            (opt.param_groups[0]["capturable"], float(opt.state[net.weight].get("step", -1.0)))
        )
    )
    enabled = [True, True, True, False, False, True, True, False, True]
    read_by_graph = None
    for i, on in enumerate(enabled):
        graph.enabled = on
        train_step(net, optimizer, x=1.0 + i)
        train_step(twin, twin_optimizer, x=1.0 + i)
        if graph.replays == 1 and read_by_graph is None:
            read_by_graph = optimizer.state[net.weight]["step"]
    assert graph.replays == 5  # the warm-up ran first, then the capture; the eager updates ran the optimizer's own
    eager_updates = [flags for flags, on in zip(seen[1:], enabled[1:], strict=True) if not on]
    assert eager_updates == [(False, 3.0), (False, 4.0), (False, 7.0)]  # the user's setting, the running count
    assert optimizer.state[net.weight]["step"] is read_by_graph and float(read_by_graph) == 9.0
    assert optimizer.param_groups[0]["capturable"] is True  # the last step replayed
    graph.uninstall()
    assert optimizer.param_groups[0]["capturable"] is False
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert float(optimizer.state[p]["step"]) == float(twin_optimizer.state[q]["step"]) == 9.0


def test_the_device_counters_are_refilled_never_replaced():
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(net.parameters())
    counters = StepCounters(optimizer)
    train_step(net, optimizer, 1.0)  # the user's update: count 1, on the host
    counters.to_device()
    device = optimizer.state[net.weight]["step"]
    params = list(net.parameters())
    for _ in range(3):  # three updates in the graph's configuration (a replay adds one to the tensor it reads)
        for p in params:
            optimizer.state[p]["step"].add_(1)
        counters.updated(params)
    counters.to_host()
    host = optimizer.state[net.weight]["step"]
    assert host is not device and float(host) == 4.0 and optimizer.param_groups[0]["capturable"] is False
    train_step(net, optimizer, 1.0)  # the user's update again: 5
    counters.to_device()
    assert optimizer.state[net.weight]["step"] is device and float(device) == 5.0


def test_counters_the_user_keeps_on_the_device_stay_put_and_only_the_flag_switches():
    net = torch.nn.Linear(2, 1)
    fused = torch.optim.AdamW(net.parameters(), fused=True)
    train_step(net, fused, 1.0)
    counter = fused.state[net.weight]["step"]
    counters = StepCounters(fused)
    counters.to_device()
    assert fused.param_groups[0]["capturable"] is True and fused.state[net.weight]["step"] is counter
    counters.to_host()
    assert fused.param_groups[0]["capturable"] is False and fused.state[net.weight]["step"] is counter
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    StepCounters(sgd).to_device()
    assert "capturable" not in sgd.param_groups[0]


def test_a_checkpoint_taken_in_the_graphs_configuration_holds_the_users_settings():
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(net.parameters())
    train_step(net, optimizer, 1.0)
    counters = StepCounters(optimizer)
    counters.to_device()
    state = optimizer.state_dict()
    counters.as_saved_by_user(state)
    assert state["param_groups"][0]["capturable"] is False
    assert optimizer.param_groups[0]["capturable"] is True  # the live optimizer keeps the graph's configuration
    assert float(state["state"][0]["step"]) == 1.0 and state["state"][0]["step"].device.type == "cpu"
