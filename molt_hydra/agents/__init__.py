"""The agent API: reward is any Python (reference/molt_inventory.md §3). Import-light: no vLLM, Ray or torch."""

from molt_hydra.agents.base import (AGENT_EXCEPTION, AGENT_TIMEOUT, EMPTY_SESSION, ENGINE_ABORTED, Env, Episode,
                                    Result, RolloutOutcome, Runner, Trajectory)
from molt_hydra.agents.chat_agent import AgentContext, ChatAgent, ChatAgentRunner, ChatContext
from molt_hydra.agents.loading import load_runner
from molt_hydra.agents.step_runner import StepEnvRunner

__all__ = ["AGENT_EXCEPTION", "AGENT_TIMEOUT", "EMPTY_SESSION", "ENGINE_ABORTED", "AgentContext", "ChatAgent",
           "ChatAgentRunner", "ChatContext", "Env", "Episode", "Result", "RolloutOutcome", "Runner", "StepEnvRunner",
           "Trajectory", "load_runner"]
