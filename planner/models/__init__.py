"""Model sources: the plain-PyTorch zoo, Hugging Face configs and checkpoints, mixture-of-experts
charging, token data.

Submodules import what they need (torch, scipy, networkx) themselves; this package imports
nothing."""
