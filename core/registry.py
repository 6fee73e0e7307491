"""The plugin registry: loads entry points through pluggy and collects node types and checks."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from typing import Any, Callable

import attrs
import pluggy

from draftflow.core import hookspecs
from draftflow.core.errors import PluginError
from draftflow.core.manifest import ROLES
from draftflow.core.params import ParamSpec

ENTRY_POINT_GROUP = "draftflow"
DISABLE_AUTOLOAD_ENV = "DRAFTFLOW_DISABLE_PLUGIN_AUTOLOAD"
# Comma-separated importable modules registered as plugins without installing them
# (like PYTEST_PLUGINS): handy while writing a plugin.
PLUGINS_ENV = "DRAFTFLOW_PLUGINS"
SELF_DIST = "draftflow"


@attrs.frozen
class NodeType:
    """A kind of node a graph can use, as registered by a plugin.

    ``manifest(params, env)`` returns the node's ``Manifest`` for validated params and the
    graph environment (``draftflow.core.plan.Env``); it may read small config files but
    must not allocate tensors. ``factory(ctx)`` builds the runtime ``Node``.
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z][a-z0-9_-]*$"))
    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    manifest: Callable[..., Any]
    factory: Callable[..., Any]
    params: tuple[ParamSpec, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""
    # What it can provide, for `draftflow plugins` (the manifest is the authority).
    capabilities: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # Role target: params -> TargetInfo from the config alone, so checks can name the target even
    # when its manifest failed (draftflow.core.target.target_info).
    target_info: Callable[..., Any] | None = None
    # Filled in by the registry: where this node type came from.
    plugin: str = ""
    version: str = ""
    origin: str = ""


@attrs.frozen
class CheckFn:
    name: str
    fn: Callable[..., Any]
    plugin: str = ""


@attrs.frozen
class PluginInfo:
    name: str
    version: str
    origin: str
    module: str


class Registry:
    """What plugins register into. Passed to ``draftflow_register_nodes``/``draftflow_add_checks``."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.node_types: dict[str, NodeType] = {}
        self.checks: list[CheckFn] = []
        self.plugins: list[PluginInfo] = []
        self._current: PluginInfo | None = None

    def add_node_type(self, node_type: NodeType) -> None:
        """Register a node type; a name registered twice is a PluginError naming both plugins."""
        if not isinstance(node_type, NodeType):
            raise PluginError(f"plugin {self._where()} registered {node_type!r}, which is not a NodeType; construct draftflow.core.registry.NodeType")
        info = self._current
        node_type = attrs.evolve(
            node_type,
            plugin=info.name if info else "",
            version=info.version if info else "",
            origin=info.origin if info else "",
        )
        old = self.node_types.get(node_type.name)
        if old is not None:
            raise PluginError(
                f"node type {node_type.name!r} is registered by both plugin {old.plugin!r} ({old.origin}) "
                f"and plugin {node_type.plugin!r} ({node_type.origin}); uninstall one of them"
            )
        self.node_types[node_type.name] = node_type

    def add_check(self, name: str, fn: Callable[..., Any]) -> None:
        """Register a static check ``fn(plan) -> Iterable[Problem]`` under rule name ``name``."""
        self.checks.append(CheckFn(name=name, fn=fn, plugin=self._current.name if self._current else ""))

    def _where(self) -> str:
        return repr(self._current.name) if self._current else "<direct>"

    def _call_each(self, hook_name: str) -> None:
        # Call plugin by plugin so registrations are attributed to the plugin that made them.
        for info in self.plugins:
            plugin = self.pm.get_plugin(info.name)
            impl = getattr(plugin, hook_name, None)
            if impl is None:
                continue
            self._current = info
            try:
                impl(registry=self)
            except PluginError:
                raise
            except Exception as exc:  # a broken third-party plugin must not produce a traceback
                raise PluginError(f"plugin {info.name!r} ({info.origin}) failed in {hook_name}: {type(exc).__name__}: {exc}") from exc
            finally:
                self._current = None


def _entry_points():
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.dist.name if ep.dist else "", ep.name))


def load_registry(autoload: bool | None = None, extra_plugins: tuple = ()) -> Registry:
    """Load built-in and (unless disabled) third-party plugins; return the filled Registry.

    :param autoload: load third-party entry points; default: on unless
        ``DRAFTFLOW_DISABLE_PLUGIN_AUTOLOAD=1``. Built-in plugins always load.
    :param extra_plugins: (name, module_or_object) pairs registered directly, e.g. in tests.
    """
    if autoload is None:
        autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "yes")
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm)
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        if dist != SELF_DIST and not autoload:
            continue
        try:
            module = ep.load()
        except Exception as exc:
            if dist == SELF_DIST:
                raise PluginError(f"built-in plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}; "
                                  "reinstall draftflow (pip install -e .)") from exc
            raise PluginError(
                f"plugin {ep.name!r} from distribution {dist} could not be imported ({ep.value}): "
                f"{type(exc).__name__}: {exc}; fix it, uninstall {dist}, or set {DISABLE_AUTOLOAD_ENV}=1"
            ) from exc
        origin = "built-in" if dist == SELF_DIST else f"entry point of {dist}"
        _register(pm, registry, PluginInfo(ep.name, version, origin, ep.value), module)
    for modname in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            module = importlib.import_module(modname)
        except Exception as exc:
            raise PluginError(f"{PLUGINS_ENV} names module {modname!r}, which could not be imported: {type(exc).__name__}: {exc}") from exc
        _register(pm, registry, PluginInfo(modname, "", f"{PLUGINS_ENV}", modname), module)
    for name, module in extra_plugins:
        _register(pm, registry, PluginInfo(name, "", "registered directly", getattr(module, "__name__", repr(module))), module)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc}; rename the function to a hook listed in docs/PLUGINS.md or remove it") from exc
    registry._call_each("draftflow_register_nodes")
    registry._call_each("draftflow_add_checks")
    return registry


def _register(pm, registry, info: PluginInfo, module) -> None:
    if pm.get_plugin(info.name) is not None:
        raise PluginError(f"two plugins are named {info.name!r}; rename one entry point")
    try:
        pm.register(module, name=info.name)
    except ValueError as exc:
        raise PluginError(f"plugin {info.name!r} ({info.origin}) could not be registered: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {info.name!r} ({info.origin}) is invalid: {exc}") from exc
    registry.plugins.append(info)
