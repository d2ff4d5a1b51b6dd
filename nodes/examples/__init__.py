"""Examples of user-written nodes, named in configs by "module:Class" path and listed in no registry.

`compass.CompassMover` is the README's "Write your own node" example; configs/examples/custom_node.yaml
trains it on Plan-Path.
"""
