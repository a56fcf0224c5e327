"""The mypyc-compiled core, routing and simulated engine (``thunderagent/native.py``, ``setup.py``): what
this install runs."""

from __future__ import annotations

import os
from pathlib import Path

from thunderagent import native

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_build_and_the_report_name_the_same_modules() -> None:
    setup_py = (SRC.parent / "setup.py").read_text()
    assert 'runpy.run_path("src/thunderagent/native.py")["MODULES"]' in setup_py  # one list, read by both
    for path in native.MODULES:
        assert (SRC / path).is_file(), path


def test_this_install_runs_what_it_was_built_from() -> None:
    st = native.state()
    assert set(st.compiled) | set(st.interpreted) == {native.module_name(p) for p in native.MODULES}
    assert not st.stale, st.summary  # a source edited after the build: `pip install -e .` again
    if os.environ.get("CI"):
        # CI installs with gcc present: the suite must exercise the compiled modules, not fall back silently
        assert not st.interpreted, st.summary


def test_an_edit_after_the_build_is_reported_stale(tmp_path: Path, monkeypatch) -> None:
    """A compiled module whose source is newer than its extension is named, so an edit never goes unseen."""
    pkg = tmp_path / "thunderagent" / "router"
    pkg.mkdir(parents=True)
    ext = pkg / "cost.cpython-311-x86_64-linux-gnu.so"
    ext.write_bytes(b"")
    src = pkg / "cost.py"
    src.write_text("")
    os.utime(ext, (1_000, 1_000))
    os.utime(src, (2_000, 2_000))

    class Spec:
        origin = str(ext)
        loader = native.importlib.machinery.ExtensionFileLoader("thunderagent.router.cost", str(ext))

    monkeypatch.setattr(native.importlib.util, "find_spec",
                        lambda name: Spec() if name == "thunderagent.router.cost" else None)
    st = native.state()
    assert st.compiled == ("thunderagent.router.cost",)
    assert st.stale == ("thunderagent.router.cost",)
    assert "STALE" in st.summary and "thunderagent.router.cost" in st.summary
    os.utime(src, (500, 500))
    assert native.state().stale == ()


def test_no_compiled_class_shares_an_abc_cache() -> None:
    """A class compiled by mypyc that derives from an ABC (``collections.abc.Sequence``...) gets no ABC cache
    of its own and shares its base's: one ``isinstance(x, Cls)`` then poisons the base's cache (measured:
    ``isinstance([], Sequence)`` turned False). Such classes stay in interpreted modules
    (``router/candidates.py``'s ``FleetView``); this guards the list in ``native.MODULES``."""
    import abc
    import importlib
    import inspect

    for path in native.MODULES:
        mod = importlib.import_module(native.module_name(path))
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or not isinstance(cls, abc.ABCMeta):
                continue
            if getattr(cls, "_is_protocol", False):
                continue  # a typing.Protocol: never instantiated nor isinstance-checked
            assert "_abc_impl" in cls.__dict__, f"{cls.__module__}.{cls.__qualname__} shares its base's ABC cache"


def test_the_index_keeps_the_callers_int_objects() -> None:
    """Index memory (README, "Compiled routing core"): entries share the event's / request's hash objects and a
    lone holder's mask is its worker's bit object. Compiled, an int typed ``int`` below 2**62 is a native
    integer boxed anew at each store; ``kv/index.py`` and ``kv/predictions.py`` keep them as objects."""
    from thunderagent.kv.index import KvIndex
    from thunderagent.types import BlockStored

    index = KvIndex(prediction_ttl=5.0)
    for i in range(40):
        index.add_worker(f"w{i}")
    stored = tuple((1 << 40) + k for k in range(4))  # below 2**62 and above the small-int cache
    index.apply_event(BlockStored("w30", 0, stored, None), 0.0)
    predicted = [(1 << 41) + k for k in range(4)]
    index.predict("w31", predicted, 0.0)
    keys = {id(k) for k in index._confirmed} | {id(k) for k in index._predicted}
    assert keys == {id(h) for h in stored} | {id(h) for h in predicted}
    bit = index._workers["w30"].bit
    assert bit == 1 << 30 and all(index._confirmed[h] is bit for h in stored)


def test_the_decision_classes_init_is_the_dataclass_fields_and_compiled(monkeypatch) -> None:
    """``decision.py``'s classes write their ``__init__`` out (mypyc keeps a generated one interpreted): it must
    take exactly the fields, in order, with the fields' defaults, or ``dataclasses.replace`` and positional
    construction would disagree with the declared fields."""
    import dataclasses
    import importlib.util
    import inspect
    import sys

    from thunderagent import decision

    # the source run as Python (a compiled method shows no signature)
    spec = importlib.util.spec_from_file_location("decision_source", SRC / "thunderagent" / "decision.py")
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, source)  # dataclass() looks its module up
    spec.loader.exec_module(source)
    for name in ("CandidateScore", "Decision"):
        cls = getattr(source, name)
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        fields = dataclasses.fields(cls)
        assert [p.name for p in params] == [f.name for f in fields], name
        assert [p.default for p in params] == [
            inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default for f in fields], name
        if "thunderagent.decision" in native.state().compiled:  # a native method, not a generated Python one
            assert not inspect.isfunction(getattr(decision, name).__init__), name
