"""mas-async: on-policy multi-agent RL (AT-GRPO) for teams of LLM agents on an asynchronous actor system.

Processes (router, env workers, inference servers, trainers) exchange msgpack messages over ZeroMQ;
trainers broadcast version-tagged weights to their inference servers over torch.distributed.
See DESIGN.md in the project documentation for the architecture.
"""

__version__ = "0.1.0"
