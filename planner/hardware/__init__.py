"""Hardware specs: the spec file format, datasheet cards, and the probes that measure a machine and
its disk.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
