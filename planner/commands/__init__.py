"""The ``protrain`` commands: the click group and the work behind train, fit, quickstart, profile
and plan.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
