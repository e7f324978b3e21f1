"""The assembly: the broker as `wrenmq serve` runs it and as a program embeds it.

The broker core (broker/) knows nothing of the parts above it. They are put together
here, above all of them, as Mochi's `AddHook` does at assembly time:

1. the `[auth]` hook (password file, ACL file, anonymous policy: auth/hook.py), first in
   the chain: it asks the hooks behind it about users it does not know; with
   `[auth.jwt]` / `[auth.http]`, the token and HTTP sources right behind it
   (`build_auth_sources`);
2. the `[[hook]]` tables, in the order of the file: `module = "package.module:Class"`,
   imported (with `path` first on the import path) and instantiated with `[hook.options]`
   as keyword arguments;
3. the program's hooks (`Broker(config, hooks=[...])`), in their order;
4. the `[[webhook]]` endpoints (webhooks/), last, so they see messages as the hooks
   before them transformed them;
5. with `[cluster]`, the node (cluster/extension.py), which joins before the listeners open;
6. the bridges of the `[[bridge]]` tables (bridge/), or the extensions the program gives
   instead (`Broker.add_extension`);
7. the admin listener's type, `type = "admin"` (`wrenmq.admin.install`).

    from wrenmq import Broker
    async with Broker(config, hooks=[MyHook()]) as broker:
        await broker.serve_forever()

A hook that cannot be imported, is not a `Hook`, or raises when instantiated (or in its
`start`, which the broker awaits before its listeners open) stops the start with an
error naming it. SIGHUP calls every hook's `on_reload`; the `[[hook]]` list itself is
read at start (a changed list needs a restart, as listeners do).
"""

import importlib
import os
import sys

from .auth.hook import build_auth_hook, build_auth_sources
from .broker import broker as core
from .broker.hooks import Hook, HookError
from .config import Config


class Broker(core.Broker):
    """The assembled broker (`wrenmq.Broker`). `hooks` go behind the `[auth]` hook and the
    configuration's hooks; `extensions`, if given, replace the bridges of its `[[bridge]]`
    tables (None: those bridges); `cluster`, if given, is the node's extension in place of
    one made from `[cluster]` (the partitions' manager gives its own, build_node).
    ConfigError if a password, ACL or bridge TLS file cannot be used, HookError if a
    `[[hook]]` cannot be loaded."""

    def __init__(self, config=None, hooks=(), extensions=None, cluster=None):
        config = config if config is not None else Config()
        auth = build_auth_hook(config)
        super().__init__(config, auth)
        auth.chain = self.hooks
        auth.router = self.router  # (a reload re-checks the queued messages)
        for hook in [*build_auth_sources(config), *load_hooks(config), *hooks]:
            self.add_hook(hook)
        if config.webhook:
            from .webhooks import Webhooks
            self.add_hook(Webhooks(config.webhook))
        if cluster is None and config.cluster.enabled:
            from .cluster.extension import ClusterExtension
            cluster = ClusterExtension(config.cluster)
        if cluster is not None:
            self.add_extension(cluster)
        if extensions is None:
            extensions = ()
            if config.bridge:
                from .bridge import bridge_extensions
                extensions = bridge_extensions(config)
        for extension in extensions:
            self.add_extension(extension)
        from . import admin
        admin.install(self)


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


def build_node(cfg):
    """What `wrenmq serve` runs for `cfg`: the assembled Broker, or, with `[cluster]
    replicas` > 1, the process-level manager of the replicated partitions (cluster/ha/),
    which assembles that broker whenever the node leads its own partition (with the
    cluster extension it gives). A `[[hook]]` that cannot be loaded is an error at once
    either way."""
    if cfg.cluster.enabled and cfg.cluster.replicas > 1:
        from .cluster.ha.manager import Partitions

        check_hooks(cfg)
        return Partitions(cfg, lambda config, cluster: Broker(config, cluster=cluster))
    return Broker(cfg)
