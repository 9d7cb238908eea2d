"""Third-party patterns and schedule rules, found through entry points.

A plugin package declares ``[project.entry-points."tvm_fusion.patterns"]`` (or
``"tvm_fusion.schedules"``) naming its classes; installing it is all it takes to have them run.
A plugin that does not load stops the compile with its package named, never silently.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from importlib import metadata
from types import ModuleType

from .errors import PluginError


def plugin_rules(group: str, kinds: tuple[type, ...],
                 name_of: Callable[[object], str | None] = lambda rule: getattr(rule, "name", None)) -> list:
    """An instance of what each entry point of ``group`` names (a class, or an instance of one
    of ``kinds``, with a name by ``name_of``)."""
    found = []
    for entry in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        where = f"entry point {entry.name!r} ({entry.value}) of {_distribution(entry)}"
        try:
            loaded = entry.load()
        except Exception as err:  # any failure inside a third party's import is that plugin's
            raise PluginError(f"{where} does not load: {type(err).__name__}: {err}",
                              f"fix or uninstall {_distribution(entry)}") from err
        rule = loaded() if inspect.isclass(loaded) else loaded
        if not isinstance(rule, kinds) or not name_of(rule):
            raise PluginError(f"{where} is not a named {' or '.join(k.__name__ for k in kinds)}",
                              "point the entry point at a subclass of one of them (a pattern also sets `name`)")
        found.append(rule)
    return found


def classes_defined_in(package: ModuleType, kinds: tuple[type, ...]) -> list[type]:
    """The subclasses of ``kinds`` that the modules of ``package`` define (not import), module by
    module: how the built-in patterns and schedule rules are found without a list."""
    found = []
    for module_info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and issubclass(cls, kinds)]
    return found


def _distribution(entry: metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an installed package"
