"""Each graded exercise's trials, references and checks: one module per exercise.

The module of exercise ``NN_name`` is ``refs.name`` (``03_ring_allreduce``:
:mod:`.ring_allreduce`); :mod:`.common` holds what several share (a model, its data, a
gradient step). Each module holds its *trials* (run where the learner's code runs), its
*references* (computed where the verdict is printed) and ``CHECKS``, the list of
:class:`~pcourse.tools.grading.checks.Check` its notebook's check cells run one by one
(``check(mc, i)``) and the grader runs on a learner's job. An exercise whose ranks open
sockets to each other says ``NETWORKED = True``.

Modules: :mod:`.common`, :mod:`.partitioner` (01), :mod:`.average_gradients` (02),
:mod:`.ring_allreduce` (03), :mod:`.gloo_bootstrap` (04), :mod:`.broadcast_consistency`
(05), :mod:`.bucketed_allreduce` (06), :mod:`.parameter_averaging` (07),
:mod:`.sharded_optimizer` (08), :mod:`.tensor_parallel` (09, its cases and f and g in
:mod:`.conjugates`), :mod:`.pipeline_schedule` (10, its orders in :mod:`.orders`),
:mod:`.predict_memory_and_time` (11), :mod:`.resume_exactly` (12).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def module_name(exercise: str) -> str:
    """The module of an exercise's checks: ``03_ring_allreduce`` -> ``refs.ring_allreduce``."""
    number, _, name = exercise.partition("_")
    if not (number.isdigit() and name.isidentifier()):
        raise ValueError(f"{exercise!r} is not an exercise's name (NN_name)")
    return f"{__name__}.{name}"


def exercise(name: str) -> ModuleType:
    """The checks of exercise ``name`` (``03_ring_allreduce``)."""
    return importlib.import_module(module_name(name))


def load_all() -> list[ModuleType]:
    """Every module here, imported (a learner process imports them before it forks)."""
    return [importlib.import_module(f"{__name__}.{m.name}")
            for m in pkgutil.iter_modules(__path__)]
