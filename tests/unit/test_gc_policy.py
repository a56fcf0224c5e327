"""The serving processes' collector policy (``thunderagent.gc_policy``)."""

from __future__ import annotations

import gc

from thunderagent.gc_policy import GEN0_THRESHOLD, tune_gc


def test_tune_gc_freezes_what_start_up_built_and_collects_young_objects_less_often():
    before = gc.get_threshold()
    try:
        built = [[i] for i in range(1000)]  # what start-up built: lists the collector tracks
        tune_gc()
        assert gc.get_freeze_count() >= len(built)
        assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
        assert gc.isenabled()  # cycles are still collected, less often
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
