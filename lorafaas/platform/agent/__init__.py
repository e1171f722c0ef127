"""The node agent (node_agent.py) and its parts: one record per function (function_state.py), the instances'
processes (instances.py), the admission view (admission_view.py), the artifacts' sizes (catalogue.py), the scheduler's
artifact plans (artifacts.py)."""

from lorafaas.platform.agent.config import AgentConfig, same_worker
from lorafaas.platform.agent.node_agent import NodeAgent

__all__ = ["AgentConfig", "NodeAgent", "same_worker"]
