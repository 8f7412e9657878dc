"""Human views of plans: ``show``/``explain``, ``diff``, predicted and measured traces, memory
plots.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
