"""Build: the routing decision's and the simulated engine's modules compiled to C with mypyc, the rest
pure Python.

Why: a decision is many small Python steps (index match, scoring a few workers, the policy, the
prediction); compiled, the full decision took 0.58x Dynamo's hash + match alone against 0.82x
interpreted (medians of three runs each, ``bench/route_decision.py``). The simulated engine's passes
were most of a replay's time (``bench/sim_speed.py``). mypyc compiles the same typed source (no second
copy of any policy): the modules run unchanged when not compiled.

``THUNDERAGENT_PURE_PYTHON=1`` at install time skips the compilation. Without a C compiler, the
extensions are optional: the build warns and installs the pure-Python modules.
"""

from __future__ import annotations

import os
import runpy

from setuptools import setup

# the module list lives in the package (``thunderagent/native.py`` reports what an install runs); read it
# without importing the package, whose dependencies the build environment does not have
NATIVE = [f"src/{p}" for p in runpy.run_path("src/thunderagent/native.py")["MODULES"]]


def native_extensions() -> list:
    if os.environ.get("THUNDERAGENT_PURE_PYTHON", "") not in ("", "0"):
        return []
    from mypyc.build import mypycify

    # the build environment has none of the runtime dependencies: their types are unknown (Any) there, and
    # the modules imported from the compiled ones are read for their types only (errors there not reported)
    opts = ["--ignore-missing-imports", "--follow-imports=silent"]
    exts = mypycify(opts + NATIVE, group_name="thunderagent.native")
    for ext in exts:
        ext.optional = True  # no compiler: warn and keep the pure-Python modules
    return exts


setup(ext_modules=native_extensions())
