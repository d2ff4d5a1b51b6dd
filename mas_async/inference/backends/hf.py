"""The transformers inference backend: the CPU default, and the reference for what a backend returns.

The InferenceServer collects whatever requests are queued and calls `HFBackend.generate` with all of
them in a worker thread (dynamic batching). Every request is expanded into its n samples, all samples
run as one left-padded batch with a KV cache, and each returns a `Completion` tagged with the weight
version the backend holds. The log-probs are those of the sampling distribution,
log_softmax(logits / temperature) at the sampled id, which is what the trainer recomputes with
`mas_async.training.logprobs.completion_logprobs`; the two must agree to float precision, and that
agreement is the evidence that the server ran exactly the trainer's weights.

New weights arrive through `load_weights` (checked against `parameter_manifest` before anything is
written), after which the server sets `version`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mas_async.inference.request import GenerationRequest
from mas_async.lora import LoraSetup, adapter_parameters, with_adapters
from mas_async.weights.flat_params import ParameterAdopter, check_named_tensors
from mas_async.weights.group import dtype_name, torch_dtype
from mas_async.wire.samples import Completion


@dataclass
class _Row:
    """One sample of one request inside a batch, with the tokens generated so far."""

    prompt: np.ndarray
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"

    @property
    def greedy(self) -> bool:
        return self.request.greedy or self.request.temperature == 0.0


class HFBackend:
    """Generates with a transformers causal LM loaded from a local folder."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_sequences: int = 512,
        seed: int = 0,
        lora: LoraSetup | None = None,
    ) -> None:
        """`lora`: serve `model_path` (the base) with the policy's adapters applied (peft, as the trainer
        computes them); weight updates then carry the adapters only."""
        from transformers import AutoModelForCausalLM

        weights_dtype = torch_dtype(dtype)
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be at least 1, got {max_batch_sequences}")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=weights_dtype)
        if lora is not None:
            self.model = with_adapters(self.model, lora, trainable=False)
        self._updated = adapter_parameters(self.model) if lora is not None else list(self.model.named_parameters())
        """The parameters a weight update replaces: every one, or the adapters only."""
        self._manifest: list[tuple[str, list[int], str]] | None = None
        self._adopter: ParameterAdopter | None = None
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        self.max_positions: int = getattr(self.model.config, "max_position_embeddings", 1 << 30)
        pad = self.model.config.pad_token_id
        self.pad_id: int = 0 if pad is None else int(pad)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # transformers 5 renamed the KV-cache argument (and output field) past_key_values -> cache.
        plain = self.model.get_base_model() if lora is not None else self.model
        forward_args = inspect.signature(plain.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self.version: int = 0

    # --- generation ---------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Sample every request's n completions; results are in request order, n per request."""
        for i, request in enumerate(requests):
            request.check(i, self.max_positions)
        rows = [_Row(np.asarray(r.prompt_ids, dtype=np.int64), r) for r in requests for _ in range(r.n)]
        for start in range(0, len(rows), self.max_batch_sequences):
            self._generate_batch(rows[start : start + self.max_batch_sequences])
        results: list[list[Completion]] = []
        it = iter(rows)
        for request in requests:
            results.append([self._completion(next(it)) for _ in range(request.n)])
        return results

    def _completion(self, row: _Row) -> Completion:
        return Completion(
            token_ids=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            version=self.version,
            finish_reason=row.finish_reason,
        )

    @torch.inference_mode()
    def _generate_batch(self, rows: list[_Row]) -> None:
        """Run one left-padded batch to completion, filling each row's tokens and log-probs."""
        width = max(len(r.prompt) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt) :] = torch.from_numpy(row.prompt)
            attention_mask[i, width - len(row.prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # Positions count real tokens only, so a left-padded prompt sees the same positions as alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = None  # the model creates its KV cache on the first call

        active = list(range(len(rows)))  # rows still generating, in cache order
        while True:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            cache = getattr(out, self._cache_kwarg)
            tokens, logprobs = self._sample(out.logits[:, -1, :].float(), [rows[i] for i in active])
            keep = []
            for j, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                row = rows[active[j]]
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if token in row.request.stop_token_ids:
                    row.finish_reason = "stop"
                elif len(row.tokens) < row.request.max_tokens:
                    keep.append(j)
            if not keep:
                return
            if len(keep) < len(active):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                tokens, attention_mask, position_ids = (
                    tokens[index],
                    attention_mask[index],
                    position_ids[index],
                )
                active = [active[j] for j in keep]
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row; return the ids and their log-probs at each row's temperature."""
        greedy = torch.tensor([r.greedy for r in rows], device=logits.device)
        temperature = torch.tensor([1.0 if r.greedy else r.request.temperature for r in rows], device=logits.device)
        logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
        tokens = logits.argmax(dim=-1)
        sampled = (~greedy).nonzero().squeeze(-1)
        if len(sampled) > 0:
            probs = logp[sampled].exp()
            top_p = torch.tensor([rows[i].request.top_p for i in sampled.tolist()], device=logits.device)
            if bool((top_p < 1.0).any()):
                probs = _nucleus(probs, top_p)
            tokens[sampled] = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    # --- weights ------------------------------------------------------------------------------

    def parameter_manifest(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of every parameter an update replaces (with LoRA, every adapter one), in
        `named_parameters()` order (tied ones once). Loading weights never changes it, so it is computed once."""
        if self._manifest is None:
            self._manifest = [(n, list(p.shape), dtype_name(p.dtype)) for n, p in self._updated]
        return self._manifest

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replace every parameter by copying. All names, shapes and dtypes are checked against the
        model before the first copy, so a mismatch raises a ValueError and leaves the model untouched."""
        params = dict(self._updated)
        check_named_tensors(params, named_tensors)
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    def adopt_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replace every parameter without a copy: each becomes a view of its received tensor (checked
        first, like `load_weights`). The tensors must stay untouched until the next update."""
        if self._adopter is None:
            self._adopter = ParameterAdopter(dict(self._updated))
        self._adopter.adopt(named_tensors)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row beyond its top_p probability mass (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
