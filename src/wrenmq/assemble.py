"""What `wrenmq serve` builds from a configuration: the Broker with its configured hooks.

The broker itself (broker/) knows hooks only through `HookChain`; which hooks a served
broker gets is decided here, above every part it puts together, as Mochi's `AddHook`
does at assembly time:

1. the `[auth]` hook (password file, ACL file, and with `[auth.jwt]` / `[auth.http]` the
   token and HTTP sources behind it: auth/hook.py `build_auth_hooks`), which Broker puts first;
2. the `[[hook]]` tables, in the order of the file: `module = "package.module:Class"`,
   imported (with `path` first on the import path) and instantiated with `[hook.options]`
   as keyword arguments;
3. the `[[webhook]]` endpoints (webhooks/), last, so they see messages as the hooks
   before them transformed them;
4. the `[[bridge]]`s (bridge/), as the broker's extensions.

A hook that cannot be imported, is not a `Hook`, or raises when instantiated (or in its
`start`, which the broker awaits before its listeners open) stops the start with an
error naming it. SIGHUP calls every hook's `on_reload`; the `[[hook]]` list itself is
read at start (a changed list needs a restart, as listeners do).
"""

import importlib
import os
import sys

from .broker.hooks import Hook, HookError


def _import_class(cfg, index, spec):
    """The class `spec` names ("package.module:Class"), with spec.path on sys.path."""
    where = f"hook[{index}] {spec.module}"
    module_name, _, class_name = spec.module.partition(":")
    if spec.path:
        base = os.path.dirname(os.path.abspath(cfg.source)) if os.path.isfile(cfg.source) else os.getcwd()
        path = os.path.normpath(os.path.join(base, spec.path))
        if not os.path.isdir(path):
            raise HookError(f"{where}: path {path} is not a directory")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise HookError(f"{where}: cannot import {module_name}: {type(e).__name__}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise HookError(f"{where}: module {module_name} ({getattr(module, '__file__', '?')}) has no "
                        f"{class_name}")
    if not (isinstance(cls, type) and issubclass(cls, Hook)):
        raise HookError(f"{where}: {class_name} is not a subclass of wrenmq.broker.hooks.Hook")
    return cls


def check_hooks(cfg):
    """Import every [[hook]] class without instantiating it (`wrenmq config check`)."""
    for i, spec in enumerate(cfg.hook):
        _import_class(cfg, i, spec)


def load_hooks(cfg):
    """The [[hook]] instances, in the order of the file; HookError names the one that failed."""
    hooks = []
    for i, spec in enumerate(cfg.hook):
        cls = _import_class(cfg, i, spec)
        try:
            hooks.append(cls(**spec.options))
        except Exception as e:
            raise HookError(f"hook[{i}] {spec.module}: raised at start: {type(e).__name__}: {e}") from e
    return hooks


def build_broker(cfg):
    """The Broker `wrenmq serve` runs for `cfg`: its configured hooks added, and the bridges
    (bridge/) as its extensions."""
    from .bridge import bridge_extensions
    from .broker.broker import Broker

    hooks = load_hooks(cfg)
    if cfg.webhook:
        from .webhooks import Webhooks
        hooks.append(Webhooks(cfg.webhook))
    return Broker(cfg, hooks, extensions=bridge_extensions(cfg))
