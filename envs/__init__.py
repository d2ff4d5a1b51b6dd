"""Environments that workflows run on. Their registry keys live in `mas_async.api.registry.ENVS`
(re-exported here); a user's own env plugs in by "module:Class" path. Every env subclasses
`mas_async.api.Env`."""

from __future__ import annotations

from mas_async.api import ENVS

__all__ = ["ENVS"]
