"""An HF causal LM's KV cache under FuseCallback: none in its training calls, and its text generation run eagerly.

A transformers model keeps ``config.use_cache=True`` in training (only gradient checkpointing turns it off), so
every training forward builds a ``DynamicCache``: a copy of every layer's keys and values that the loss never
reads, and an object a CUDA graph replay cannot rebuild. :class:`NoCacheInTraining` passes ``use_cache=False`` to
the network's training calls that do not set it themselves (TRL's ``inputs["use_cache"] = False``) while it is
:attr:`~NoCacheInTraining.enabled`: FuseCallback enables it for the steps its plan runs and the plan search, and
disables it for eager steps, so the eager reference costs what the user's own eager step costs. The user's config
is never edited, so evaluation and generation keep their cache, and nothing needs restoring at teardown.

``generate`` calls the network once a token, each at a new cache length, and :class:`EagerGeneration` runs it
eagerly during the fit, as HF's Trainer does under ``torch_compile`` (it generates with the model it did not wrap).

Example::

    >>> import torch
    >>> class LM(torch.nn.Module):
    ...     config = type("Config", (), {"use_cache": True})()
    ...     def forward(self, x, use_cache=None):
    ...         return use_cache
    >>> lm = LM()
    >>> no_cache = NoCacheInTraining(lm)
    >>> no_cache.install(); lm(1), lm(1, use_cache=True), lm.eval()(1)
    (False, True, None)
    >>> no_cache.enabled = False; lm.train()(1) is None
    True
    >>> no_cache.uninstall()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn


class NoCacheInTraining:
    """While installed, ``module``'s training calls get ``use_cache=False`` unless they pass ``use_cache`` themselves.

    It applies to a module with a config whose ``use_cache`` is on and whose forward takes ``use_cache`` by name, or
    through ``**kwargs`` to a wrapped model's forward that names it (a peft wrapper's ``get_base_model()``); to any
    other module it does nothing. An encoder's config may hold ``use_cache`` and its forward ``**kwargs`` (BERT's
    classifier in transformers 5): it builds no cache, and is left alone.

    Args:
        module: The network the training step calls.

    Example::

        >>> NoCacheInTraining(torch.nn.Linear(2, 2)).applies
        False
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.applies = _cache_on(module) and _takes_use_cache(module)
        self.enabled = True
        """Whether calls are changed now (a switch per step: the hook stays installed)."""
        self._handle: Any = None
        self._announced = False

    def install(self) -> None:
        if not self.applies or self._handle is not None:
            return
        # prepended: what the other hooks see (the plan search's recorder) is the call as it runs
        self._handle = self.module.register_forward_pre_hook(self._no_cache, with_kwargs=True, prepend=True)
        if not self._announced:  # said here, not in the hook: a compiled network traces its hooks, and guards
            self._announced = True  # on what they read, so a flag the hook flipped would recompile it
            rank_zero_info(
                f"FuseCallback: {type(self.module).__name__} takes use_cache and its config has it on, so the "
                "training steps FuseCallback speeds up call it with use_cache=False (a KV cache, where the model "
                "builds one, is never read by the loss, and no CUDA graph can hold it); its config is unchanged. "
                "Pass use_cache yourself to decide otherwise."
            )

    def uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def as_called(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as ``module``'s forward receives it, this hook having run (for a check that calls the forward
        alone).

        Example::

            >>> net = torch.nn.Module()
            >>> net.config, net.forward = type("Config", (), {"use_cache": True})(), lambda x, use_cache=None: x
            >>> no_cache = NoCacheInTraining(net); no_cache.install()
            >>> no_cache.as_called(net, (1,), {}), no_cache.as_called(net, (1,), {"use_cache": True})
            (((1,), {'use_cache': False}), ((1,), {'use_cache': True}))
        """
        changed = self._no_cache(module, args, kwargs) if module is self.module and self._handle is not None else None
        return changed or (args, kwargs)

    def _no_cache(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (self.enabled and module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is not None:
            return None
        return args, {**kwargs, "use_cache": False}


class EagerGeneration:
    """While installed, ``generate`` of every module under ``root`` that generates text (an HF model whose
    ``can_generate()`` says so) runs eagerly: ``torch.compiler.set_stance("force_eager")`` around the call.

    Each token of ``generate`` calls the network at a new cache length. Compiled, the first lengths recompile every
    region and a dynamic graph follows; under CUDA graphs, each length records its own graph. That costs far more
    than a validation's generation saves (``benchmarks/RESULTS.md``, sixty-fourth session: Bloom generating 64
    tokens in validation), and ``torch.compile(model)``, whose wrapper is not the model that generates, leaves
    ``generate`` eager, as does HF's Trainer under ``torch_compile``. A call that asks for a cache other than the
    dynamic one (``cache_implementation="static"``) is HF's own compiled generation, and is left to it.

    Args:
        root: The LightningModule (or any module) whose generating modules are covered.

    Example::

        >>> from lightning_fuse import compat
        >>> class LM(torch.nn.Module):
        ...     def can_generate(self):
        ...         return True
        ...     def generate(self, **kwargs):
        ...         return compat.active_stance()
        >>> lm = LM()
        >>> eager = EagerGeneration(lm)
        >>> eager.install(); lm.generate(), lm.generate(cache_implementation="static")
        ('force_eager', 'default')
        >>> eager.uninstall(); lm.generate()
        'default'
    """

    def __init__(self, root: nn.Module) -> None:
        self.modules = [module for module in root.modules() if _generates(module)]
        self._announced = False

    def install(self) -> None:
        for module in self.modules:
            module.generate = _EagerGenerate(module, self._announce)  # over the class's method, for this instance

    def uninstall(self) -> None:
        for module in self.modules:
            if isinstance(vars(module).get("generate"), _EagerGenerate):
                del module.generate

    def _announce(self, module: nn.Module) -> None:
        if not self._announced:
            self._announced = True
            rank_zero_info(
                f"FuseCallback: {type(module).__name__}.generate runs eagerly during the fit: each token is a new "
                "cache length, which compiled code would recompile for and record a CUDA graph of, at a cost far "
                "above what the calls save (HF's Trainer under torch_compile generates eagerly too). A static cache "
                '(`cache_implementation="static"`) is HF\'s own compiled generation, and is left to HF.'
            )


class _EagerGenerate:
    """``module.generate`` while :class:`EagerGeneration` is installed; a deep copy of the module generates as
    itself, and a pickled one unpickles with it (eager)."""

    def __init__(self, module: nn.Module, announce: Callable[[nn.Module], None] | None = None) -> None:
        self.module = module
        self.announce = announce

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        generate = type(self.module).generate
        if _hf_compiles(self.module, kwargs):
            return generate(self.module, *args, **kwargs)
        if self.announce is not None:
            self.announce(self.module)
        with torch.compiler.set_stance("force_eager"):
            return generate(self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _EagerGenerate:
        return _EagerGenerate(memo.get(id(self.module), self.module), self.announce)  # the module's copy is made

    def __reduce__(self) -> tuple[type, tuple[nn.Module]]:
        return _EagerGenerate, (self.module,)


def _generates(module: nn.Module) -> bool:
    can_generate = getattr(module, "can_generate", None)
    if not callable(can_generate) or "generate" in vars(module) or not callable(getattr(module, "generate", None)):
        return False
    try:
        return bool(can_generate())
    except Exception:  # noqa: BLE001 - a can_generate of another library's meaning: not an HF model
        return False


def _hf_compiles(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether HF compiles this ``generate`` call's forward itself: it asks for a cache other than the dynamic one
    (a static one), by argument or in the model's generation config."""
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    cache = kwargs.get("past_key_values")
    return implementation not in (None, "dynamic") or (cache is not None and type(cache).__name__ != "DynamicCache")


def _cache_on(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "use_cache", None) is True


def _takes_use_cache(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward
        return False
    if "use_cache" in parameters:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    base = getattr(module, "get_base_model", None)  # peft: forward(*args, **kwargs) into the wrapped model
    wrapped = base() if passes_on and callable(base) else None
    return isinstance(wrapped, nn.Module) and wrapped is not module and _takes_use_cache(wrapped)
