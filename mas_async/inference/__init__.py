"""Inference backends behind the InferenceServer: `hf` (transformers, the CPU default), `vllm` and `mock`.

A backend turns a list of generation requests into completions (token ids, per-token log-probs and the
weight version that produced them) and loads new weights in place when its trainer broadcasts them.
"""
