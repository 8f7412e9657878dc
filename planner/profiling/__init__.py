"""Profiles: the execution graph, the Profile format, and analytic profiles estimated on ``meta``.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
