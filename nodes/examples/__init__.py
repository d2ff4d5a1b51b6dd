"""Examples of user-written nodes, named in configs by "module:Class" path and listed in no registry.

`compass.CompassMover` is the README's "Write your own node" example; configs/examples/custom_node.yaml
trains it on Plan-Path. `openai_movers.play` is a workflow program: Plan-Path's two movers written with the
`openai` package only, trained through the run's OpenAI-compatible gateway (configs/examples/openai_movers.yaml,
docs/gateway.md).
"""
