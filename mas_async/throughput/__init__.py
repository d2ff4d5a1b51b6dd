"""Rollout throughput of any deployment (`mas-async bench CONFIG`): a rollout-only deployment of the
config (no trainers, fixed weights), what its actors record, the figures computed from it, and the
replay of the same prompts on each policy's engine alone."""
