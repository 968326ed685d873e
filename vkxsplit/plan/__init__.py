"""The split planner and what it is made of, one concern per module.

- :mod:`.spec`: the split-spec grammar (``none | layer | tensor | mode | auto``) and ``--backends``;
- :mod:`.schedule`: a plan lowered to items (hub ops, backend jobs) and :func:`build_schedule`,
  which cuts them into hub segments and backend jobs (what the executor runs);
- :mod:`.workspace`: memory the planner inserts (activation shadows, weights converted once);
- :mod:`.profile`: the device profile (measured costs keyed by device, driver and kernels);
- :mod:`.cost`: the cost model read from the profile, and :func:`simulate` (predicted step time);
- :mod:`.result`: the :class:`Plan` a planner returns and its description;
- :mod:`.participants`: :class:`~.participants.Participants`, who takes part (the hub and
  attached backends, or the Vulkan hubs ``hub0``, ``hub1``, ... of a model over several GPUs),
  a split spec checked against them, and what each backend can take;
- :mod:`.lowering`: an assignment (who runs which node and rows) lowered to items;
- :mod:`.strategies`: the split kinds as assignments (``layer``, ``tensor``, ``mode``, ``auto``);
- :mod:`.hub_split`: a model over several hubs as a plan, and ``auto``'s choice among one hub,
  the layer split and the row split;
- :mod:`.planner`: :class:`Planner`, a ``Participants`` whose :meth:`~Planner.plan` runs those
  steps in order: assignment, caps check, lowering, schedule, prediction.

Imports go one way: ``vkxsplit.graph`` -> ``vkxsplit.plan.*`` -> ``vkxsplit.executor``,
``vkxsplit.relay`` -> ``vkxsplit.calibrate`` (the cost model's measurements: it runs executors),
``vkxsplit.hubs`` -> ``vkxsplit.model``.
Nothing here imports the executor, the calibration or the model. ``vkxsplit plan`` (the
command) lives in :mod:`vkxsplit.runner`. Design and grammar: ``docs/PLANNER.md``.

This package re-exports the names callers use; new code imports them from their modules.
"""

from __future__ import annotations

from .cost import DEFAULTS, CostModel, Prediction, simulate
from .participants import F32_ONLY_OPS, GRANULE
from .planner import Planner
from .profile import PROFILE_VERSION, Profile
from .result import OFFLOADABLE_OPS, Part, Plan
from .schedule import (
           BackendIdOp,
           BackendNodeOp,
           BackendOp,
           HubOp,
           Item,
           Job,
           Schedule,
           Segment,
           build_schedule,
)
from .spec import (
           HUB,
           HUB_ALIASES,
           KINDS,
           SPLIT_HELP,
           Override,
           Rule,
           SplitSpec,
           parse_backends,
           parse_spec,
           parse_specs,
)
from .workspace import ELEM_BYTES, FLOAT_TYPES, ArenaWorkspace, Workspace

__all__ = ["DEFAULTS", "ELEM_BYTES", "F32_ONLY_OPS", "FLOAT_TYPES", "GRANULE", "HUB", "HUB_ALIASES",
           "KINDS", "OFFLOADABLE_OPS", "PROFILE_VERSION", "SPLIT_HELP", "ArenaWorkspace", "BackendIdOp", "BackendNodeOp",
           "BackendOp", "CostModel", "HubOp", "Item", "Job", "Override", "Part", "Plan", "Planner", "Prediction", "Profile", "Rule",
           "Schedule", "Segment", "SplitSpec", "Workspace", "build_schedule", "parse_backends",
           "parse_spec", "parse_specs", "simulate"]
