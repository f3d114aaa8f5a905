"""What a user names by ``module:attribute``: reward functions, workflow classes.

``package.module:name`` imports the module the ordinary way (it must be importable: installed, or
on ``PYTHONPATH``); ``path/to/file.py:name`` loads that file as a module, so a reward written next
to the data needs no packaging. Every failure is one :class:`ConfigError` naming the setting, what
went wrong and the fix — never an import traceback.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from stalebound.core.errors import ConfigError

__all__ = ["load_object", "load_workflow"]


def _split(spec: str, setting: str) -> tuple[str, str]:
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(
            f"{setting}={spec!r}: not a 'module:name' reference; write e.g. "
            f"{setting}=my_package.rewards:score or {setting}=rewards.py:score"
        )
    return module, name


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _from_file(path: Path, spec: str, setting: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"{setting}={spec!r}: no such file {str(path)!r}; check the path")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"stalebound_user_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"{setting}={spec!r}: {str(path)!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # as an import would, so the module's own code can find itself
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(
            f"{setting}={spec!r}: importing {str(path)!r} failed ({_last_line(e)}); fix the file"
        ) from None
    return module


def load_object(spec: str, setting: str) -> Any:
    """The object ``spec`` names (``module:name`` or ``file.py:name``)."""
    module_name, name = _split(spec, setting)
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _from_file(Path(module_name).expanduser(), spec, setting)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and module_name.startswith(e.name):
                raise ConfigError(
                    f"{setting}={spec!r}: no module named {e.name!r}; install it, add its "
                    "directory to PYTHONPATH, or name a file: path/to/file.py:name"
                ) from None
            raise ConfigError(
                f"{setting}={spec!r}: importing {module_name!r} failed ({_last_line(e)}); "
                "install what it needs"
            ) from None
        except Exception as e:
            raise ConfigError(
                f"{setting}={spec!r}: importing {module_name!r} failed ({_last_line(e)}); fix "
                "the module"
            ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise ConfigError(
            f"{setting}={spec!r}: {module_name!r} has no {name!r} (it defines {public}); name "
            "one of them"
        ) from None


def load_workflow(spec: str, args: Mapping[str, Any], setting: str = "rollout.workflow") -> Any:
    """An instance of the workflow class ``spec`` names, constructed with the keyword arguments
    ``args`` (``rollout.workflow_args``). The class must define ``async arun_episode(self, engine,
    row)``; anything else is one ConfigError naming ``setting`` and the fix."""
    cls = load_object(spec, setting)
    fix = "name a class that defines async arun_episode(self, engine, row)"
    if not inspect.isclass(cls):
        raise ConfigError(f"{setting}={spec!r}: a {type(cls).__name__}, not a class; {fix}")
    method = getattr(cls, "arun_episode", None)
    if method is None:
        earlier = " (run(generate, sample) is the earlier interface)" if hasattr(cls, "run") else ""
        raise ConfigError(
            f"{setting}={spec!r}: {cls.__qualname__} has no arun_episode{earlier}; {fix}"
        )
    if not inspect.iscoroutinefunction(method):
        raise ConfigError(
            f"{setting}={spec!r}: {cls.__qualname__}.arun_episode is not async; define it with "
            "async def arun_episode(self, engine, row)"
        )
    try:
        inspect.signature(method).bind(None, None, None)  # (self, engine, row)
    except TypeError:
        raise ConfigError(
            f"{setting}={spec!r}: {cls.__qualname__}.arun_episode"
            f"{inspect.signature(method)} cannot be called as arun_episode(self, engine, row); "
            "give it exactly those parameters"
        ) from None
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ConfigError(
            f"{setting}_args={dict(args)!r}: {cls.__qualname__}{inspect.signature(cls)} cannot "
            f"be constructed with them ({e}); give the keyword arguments its __init__ takes"
        ) from None
    try:
        return cls(**args)
    except Exception as e:
        raise ConfigError(
            f"{setting}={spec!r}: constructing {cls.__qualname__} failed ({_last_line(e)}); fix "
            f"the class or {setting}_args"
        ) from None
