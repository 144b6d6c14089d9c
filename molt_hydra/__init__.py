"""molt_hydra: agentic RL post-training for LLMs behind a typed Hydra config tree.

Nothing heavy is imported here: Ray, vLLM and torch load lazily inside the modules that need them.
"""

__version__ = "0.1.0"
