"""How a `Replayer` sits on a model: a forward pre-hook on the model and a `forward` attribute on each
bound router scope, both inert stand-ins when pickled or copied.

`bind(replayer)` installs them (the scopes' classes are untouched) and `unbind` removes them, putting
back a forward another library had set before `attach`; `attached_replayer(model)` finds the Replayer
through its hook. A pickled or deep-copied model carries `_ModelCallHook(None)` and the scopes' own
forwards: no Replayer state, and not attached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from routereplay.runtime.discovery import RouterSite

if TYPE_CHECKING:
    from routereplay.runtime.replayer import Replayer


class _ModelCallHook:
    """The model's forward pre-hook (steps of the open context). It pickles and deep-copies as an inert
    hook, so a saved or copied model carries no Replayer state and is not attached."""

    __slots__ = ("replayer",)

    def __init__(self, replayer: Replayer | None) -> None:
        self.replayer = replayer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        replayer = self.replayer
        if replayer is not None and module is replayer.model and replayer._handles:
            replayer._on_model_call(module, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModelCallHook, (None,))


class _RouterForward:
    """A bound router scope's `forward` (an instance attribute; the class is untouched). It pickles and
    deep-copies as the forward it wraps, so a copy of the model routes naturally and is not attached."""

    __slots__ = ("original", "replayer", "site")

    def __init__(self, replayer: Replayer, site: RouterSite, original: Callable[..., Any]) -> None:
        self.replayer, self.site, self.original = replayer, site, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.replayer._route(self.site, self.original, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        if _is_bound_class_forward(self.original, self.site.scope):
            return (getattr, (self.site.scope, "forward"))  # re-resolved on the copy: its class's forward
        return (_unwrapped, (self.original,))


def _unwrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    return original


def _is_bound_class_forward(forward: Any, scope: nn.Module) -> bool:
    return getattr(forward, "__self__", None) is scope and getattr(forward, "__func__", None) is type(scope).forward


def attached_replayer(model: nn.Module) -> Replayer | None:
    """The Replayer attached to `model` (found by its forward pre-hook), or None."""
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        replayer = getattr(hook, "replayer", None) if isinstance(hook, _ModelCallHook) else None
        if replayer is not None and replayer.model is model and replayer._handles:
            return replayer
    return None


def bind(replayer: Replayer) -> list[RemovableHandle]:
    """Hook the model and wrap each bound router scope's `forward`; returns the hook handles."""
    handles = [replayer.model.register_forward_pre_hook(_ModelCallHook(replayer), with_kwargs=True)]
    for site in replayer.sites:
        site.scope.forward = _RouterForward(replayer, site, site.scope.forward)  # instance attribute; class untouched
    return handles


def unbind(replayer: Replayer, handles: list[RemovableHandle]) -> None:
    """Delete the wrappers `bind` set (putting back a forward another library had set) and remove `handles`."""
    for site in replayer.sites:
        wrapper = site.scope.__dict__.get("forward")
        if isinstance(wrapper, _RouterForward) and wrapper.replayer is replayer:
            del site.scope.__dict__["forward"]
            if not _is_bound_class_forward(wrapper.original, site.scope):
                site.scope.forward = wrapper.original  # another library's wrapper, set before attach
    for handle in handles:
        handle.remove()
    handles.clear()
