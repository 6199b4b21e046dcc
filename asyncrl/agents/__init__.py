"""Agents through an OpenAI-compatible endpoint: black-box agent code, trained token-exactly.

``AgentEndpoint`` serves ``/v1/chat/completions`` and ``/v1/completions`` in front of any ``Sampler`` and records
each session's calls; ``Session`` joins them into trajectories with loss masks; ``AgentRunner`` plays ``n``
agents per task and builds GRPO groups from their sessions; ``ChatRenderer`` applies the chat template once and
parses tool calls.
"""

from asyncrl.agents.chat import ChatRenderer, HermesToolParser, ParsedTurn, ToolCall, ToolCallParser
from asyncrl.agents.endpoint import SESSION_HEADER, AgentEndpoint, EndpointConfig
from asyncrl.agents.runner import AgentConfig, AgentFn, AgentRunner
from asyncrl.agents.sessions import CallRecord, Session

__all__ = ["SESSION_HEADER", "AgentConfig", "AgentEndpoint", "AgentFn", "AgentRunner", "CallRecord",
           "ChatRenderer", "EndpointConfig", "HermesToolParser", "ParsedTurn", "Session", "ToolCall",
           "ToolCallParser"]
