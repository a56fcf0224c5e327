"""Which modules the build compiles with mypyc (``setup.py``), and whether this install runs them.

The routing decision (``KvRouter.route`` and what it calls) and the simulated engine are many small
Python steps; mypyc compiles the same typed source to C (no second copy of any policy or engine): the
full decision went from 0.82x to 0.58x Dynamo's hash + match (``bench/route_decision.py``), and the
full Mooncake replay's CPU time fell by about a fifth (``bench/sim_speed.py``). Compiled modules sit
beside their sources in an editable install, and Python loads an extension module before a ``.py`` of
the same name: a source edited after the build would be silently ignored, so :func:`state` names those
(``NativeState.stale``: ``serve`` and ``frontend`` print them, and the test suite fails on them). Rebuild
with ``pip install -e .``.

This module imports nothing of the package: ``setup.py`` reads :data:`MODULES` from it before install.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: compiled by the build, as paths under ``src/``. Kept to the decision's hot path, and to modules whose
#: classes are not subclassed or patched from interpreted code (a compiled class is closed).
MODULES = (
    "thunderagent/kv/check.py",
    "thunderagent/kv/hashing.py",
    "thunderagent/kv/index.py",
    "thunderagent/kv/predictions.py",
    "thunderagent/router/balance.py",
    "thunderagent/router/cost.py",
    "thunderagent/router/hot.py",
    "thunderagent/router/policies.py",
    "thunderagent/router/router.py",
    "thunderagent/router/selection.py",
    "thunderagent/decision.py",
    # the simulated engine: most of a replay's time (``bench/sim_speed.py``); also what serves each simulated
    # worker of ``thunderagent serve``
    "thunderagent/engine/accounting.py",
    "thunderagent/engine/blocks.py",
    "thunderagent/engine/eviction.py",
    "thunderagent/engine/fields.py",
    "thunderagent/engine/kv_handoff.py",
    "thunderagent/engine/pass_end.py",
    "thunderagent/engine/preemption.py",
    "thunderagent/engine/sim_state.py",
    "thunderagent/engine/simulated.py",
    "thunderagent/engine/stretch.py",
    "thunderagent/engine/textgen.py",
    "thunderagent/engine/timing.py",
)


@dataclass(frozen=True, slots=True)
class NativeState:
    compiled: tuple[str, ...]  # module names loaded from an extension module
    interpreted: tuple[str, ...]  # module names loaded from their source
    stale: tuple[str, ...]  # compiled, but the source is newer than the extension (an edit not rebuilt)

    @property
    def summary(self) -> str:
        if not self.compiled:
            return "compiled core: none, pure Python (no C compiler at install, or THUNDERAGENT_PURE_PYTHON)"
        text = f"compiled core: {len(self.compiled)} of {len(MODULES)} modules compiled (mypyc)"
        if self.stale:
            text += f"; STALE, sources edited after the build: {', '.join(self.stale)} (pip install -e . again)"
        return text


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def state() -> NativeState:
    """Where each of :data:`MODULES` is loaded from (found, not imported)."""
    compiled, interpreted, stale = [], [], []
    for path in MODULES:
        name = module_name(path)
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            interpreted.append(name)
            continue
        compiled.append(name)
        source = Path(origin).with_name(Path(path).name)
        if source.exists() and source.stat().st_mtime > Path(origin).stat().st_mtime:
            stale.append(name)
    return NativeState(tuple(compiled), tuple(interpreted), tuple(stale))
