"""molt_hydra: agentic RL post-training for LLMs behind a typed Hydra config tree.

Nothing heavy is imported here: Ray, vLLM and torch load lazily inside the modules that need them.
"""

__version__ = "0.1.0"

from molt_hydra.runtime.role_warnings import attach as _attach  # noqa: E402

_attach()  # in a process a run started: its warnings reach the run's terminal (runtime/role_warnings.py)
