"""protrain's plan contract: the file one machine writes and another replays.

The schema (``plan``), its migrations (``migrate``), the structural checks
(``validation``, ``bounds``), the homes and policies vocabulary the schema names
(``homes``) and the errors a load raises (``errors``). Only the standard library and
msgspec are imported, so the plan tools (``show``, ``diff``, ``validate``) and plan
regeneration never import torch or the runtime; the planner writes plans through this
package and the executor reads them through it.

Beside the code, as package data: hardware specs (``hardware/``), shipped model configs
(``configs/``), the committed plans (``<model>/*.json``) and the JSON Schema of each
version (``schema/``).
"""

from __future__ import annotations

from .errors import PlanError
from .migrate import SCHEMA_VERSION
from .plan import Plan, dump
from .reader import load

__all__ = ["SCHEMA_VERSION", "Plan", "PlanError", "dump", "load"]
