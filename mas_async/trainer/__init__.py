"""The trainer side of mas-async: advantages, the PPO/GRPO loss and the per-policy trainer process."""
