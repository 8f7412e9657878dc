"""Configuration search: the cost model, host tiers, exhaustive and MILP search, layout, and
emission of the plan.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
