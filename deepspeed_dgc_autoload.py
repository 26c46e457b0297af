"""Start-up hook: a ``"dgc"`` section of a DeepSpeed config takes effect without ``import deepspeed_dgc``.

Installing deepspeed_dgc puts ``deepspeed_dgc-autoload.pth`` into site-packages; Python's ``site`` runs its one line,
``import deepspeed_dgc_autoload``, at every interpreter start. This module imports nothing heavy: it waits until
``deepspeed.runtime.engine`` is imported, then arms ``DeepSpeedEngine.__init__`` so that the first engine built imports
``deepspeed_dgc`` (which installs its hooks on ``DeepSpeedEngine``) before it reads its config. A job whose script or
launcher never imports deepspeed_dgc therefore still compresses when its config says so, instead of silently training
as stock ZeRO-3. Set ``DEEPSPEED_DGC_AUTOLOAD=0`` to turn this off (then only ``import deepspeed_dgc`` activates it).
"""

import importlib.abc
import importlib.util
import os
import sys

ENV = "DEEPSPEED_DGC_AUTOLOAD"
TARGET = "deepspeed.runtime.engine"


def _arm(engine_module) -> None:
    """The first ``DeepSpeedEngine(...)`` imports deepspeed_dgc, then runs as its hooks say."""
    cls = getattr(engine_module, "DeepSpeedEngine", None)
    if cls is None:
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        if cls.__init__ is not __init__:  # deepspeed_dgc was imported already and wraps this: run the original
            return original(self, *args, **kwargs)
        cls.__init__ = original  # disarm; importing deepspeed_dgc wraps the original
        import deepspeed_dgc  # noqa: F401 -- activates: wraps DeepSpeedEngine.__init__ and _configure_zero_optimizer
        return cls.__init__(self, *args, **kwargs)

    cls.__init__ = __init__


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _arm(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``deepspeed.runtime.engine`` (found by the other finders) to arm the engine once loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once is enough; find the real spec without us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Install the finder, unless ``DEEPSPEED_DGC_AUTOLOAD=0`` or DeepSpeed's engine is already imported."""
    if os.environ.get(ENV, "1") == "0":
        return
    if TARGET in sys.modules:
        _arm(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:  # noqa: BLE001 -- a start-up hook must never stop an interpreter from starting
    pass
