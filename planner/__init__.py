"""protrain's planner: profile a model, search a memory plan, write the plan file.

Heavy modules (torch, networkx, scipy) are imported by the submodules that need
them, never here, so ``protrain --help``, ``show`` and ``validate`` start fast.
"""
