"""How a `Replayer` sits on a model: a forward pre-hook on the model and a `forward` attribute on each
bound router scope, both inert stand-ins when pickled or copied.

`bind(replayer)` installs them (the scopes' classes are untouched) and `unbind` removes them, putting
back a forward another library had set before `attach`; `attached_replayer(model)` finds the Replayer
through its hook. A pickled model carries `_ModelCallHook(None)` and the scopes' own forwards; a
deep-copied one carries `_ModelCallHook(None)` and, as each scope's `forward`, an inert stand-in that
calls the scope's own forward (attaching the copy unwraps it). Neither holds Replayer state, and
neither is attached.

A scope's `forward` is the bound method `_RouterForward.forward` of its binding, not a callable
object: dynamo guards a patched method by its code (shared by every layer) but a callable object by
its identity, so with a method one compiled graph serves every MoE block of a model.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.interception import RouterSlot


class HookOwner(Protocol):
    """What the hooks and bindings here call on the `Replayer` that owns them (`runtime/replayer.py`)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def sites(self) -> Sequence[RouterSite]: ...
    @property
    def slots(self) -> Sequence[RouterSlot]: ...
    @property
    def _handles(self) -> list[RemovableHandle]: ...
    def _on_model_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...
    def _on_split(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...
    def _route(
        self,
        site: RouterSite,
        slot: RouterSlot,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any: ...


class _ModelCallHook:
    """The model's forward pre-hook (steps of the open context). It pickles and deep-copies as an inert
    hook, so a saved or copied model carries no Replayer state and is not attached."""

    __slots__ = ("replayer",)

    def __init__(self, replayer: HookOwner | None) -> None:
        self.replayer = replayer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        replayer = self.replayer
        if replayer is not None and module is replayer.model and replayer._handles:
            replayer._on_model_call(module, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModelCallHook, (None,))


class _SplitHook:
    """A modality block's forward pre-hook (which tokens each of its routers sees); inert when pickled or
    copied, like `_ModelCallHook`."""

    __slots__ = ("replayer",)

    def __init__(self, replayer: HookOwner | None) -> None:
        self.replayer = replayer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        replayer = self.replayer
        if replayer is not None and replayer._handles:
            replayer._on_split(module, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_SplitHook, (None,))


class _RouterForward:
    """The binding of a bound router scope: its `forward` instance attribute is this object's `forward`
    method (the class is untouched). Pickled, it becomes the forward it wraps; deep-copied, an inert
    binding (`replayer` None) that calls it. Either way the copy routes naturally and is not attached."""

    __slots__ = ("original", "replayer", "site", "slot")

    def __init__(
        self,
        replayer: HookOwner | None,
        site: RouterSite | None,
        slot: RouterSlot | None,
        original: Callable[..., Any],
    ) -> None:
        self.replayer, self.site, self.slot, self.original = replayer, site, slot, original

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        replayer = self.replayer
        if replayer is None or self.site is None or self.slot is None:  # a copy's inert stand-in
            return self.original(*args, **kwargs)
        return replayer._route(self.site, self.slot, self.original, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled bound method is `getattr(<its __self__ reduced>, "forward")`
        if self.site is not None and _is_bound_class_forward(self.original, self.site.scope):
            return (_unwrapped, (self.site.scope,))  # re-resolved on the copy: its class's forward
        return (_holding_forward, (self.original,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _RouterForward:
        # deepcopy rebuilds a bound method around a copy of its __self__: make that inert
        return _RouterForward(None, None, None, copy.deepcopy(self.original, memo))


def _binding(forward: Any) -> _RouterForward | None:
    """The `_RouterForward` behind a scope's `forward` attribute, if it is one."""
    if isinstance(forward, types.MethodType) and isinstance(forward.__self__, _RouterForward):
        return forward.__self__
    return None


def _holding_forward(original: Callable[..., Any]) -> types.SimpleNamespace:
    return types.SimpleNamespace(forward=original)


def _unwrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    return original


def _is_bound_class_forward(forward: Any, scope: nn.Module) -> bool:
    return getattr(forward, "__self__", None) is scope and getattr(forward, "__func__", None) is type(scope).forward


def attached_replayer(model: nn.Module) -> HookOwner | None:
    """The Replayer attached to `model` (found by its forward pre-hook), or None."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        replayer = getattr(hook, "replayer", None) if isinstance(hook, _ModelCallHook) else None
        if replayer is not None and replayer.model is model and replayer._handles:
            return replayer
    return None


def bind(replayer: HookOwner) -> list[RemovableHandle]:
    """Hook the model and wrap each bound router scope's `forward`; returns the hook handles."""
    handles = [replayer.model.register_forward_pre_hook(_ModelCallHook(replayer), with_kwargs=True)]
    splitters = {id(s.splitter): s.splitter for s in replayer.sites if s.splitter is not None}
    for block in splitters.values():
        handles.append(block.register_forward_pre_hook(_SplitHook(replayer), with_kwargs=True))
    for site, slot in zip(replayer.sites, replayer.slots, strict=True):
        original = site.scope.forward
        stand_in = _binding(original)
        if stand_in is not None and stand_in.replayer is None:  # a deep copy's inert stand-in: wrap what it calls
            original = stand_in.original
        site.scope.forward = _RouterForward(replayer, site, slot, original).forward  # instance attribute only
    return handles


def unbind(replayer: HookOwner, handles: list[RemovableHandle]) -> None:
    """Delete the wrappers `bind` set (putting back a forward another library had set) and remove `handles`."""
    for site in replayer.sites:
        wrapper = _binding(site.scope.__dict__.get("forward"))
        if wrapper is not None and wrapper.replayer is replayer:
            del site.scope.__dict__["forward"]
            if not _is_bound_class_forward(wrapper.original, site.scope):
                site.scope.forward = wrapper.original  # another library's wrapper, set before attach
    for handle in handles:
        handle.remove()
    handles.clear()
