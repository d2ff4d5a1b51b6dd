"""The transformers inference backend: the CPU default, and the reference for what a backend returns.

The InferenceServer collects whatever requests are queued and calls `HFBackend.generate` with all of
them in a worker thread (dynamic batching). Every request is expanded into its n samples, all samples
run as one left-padded batch with a KV cache, and each returns a `Completion` tagged with the weight
version the backend holds. The log-probs are those of the sampling distribution,
log_softmax(logits / temperature) at the sampled id, which is what the trainer recomputes with
`mas_async.training.logprobs.completion_logprobs`; the two must agree to float precision, and that
agreement is the evidence that the server ran exactly the trainer's weights.

A request may carry a `seed`: its i-th sample then draws from a torch.Generator of its own seeded with
seed + i (vLLM's rule for the n samples of a seeded request), so it samples the same tokens whatever else
is in the batch; requests without one draw together from the backend's generator, as they always did. A
request with `top_logprobs` = k > 0 also gets, at each position, the k most likely tokens of that same
distribution, log_softmax(logits / temperature) (at temperature 1 for a greedy request; a top_p < 1 cut
is not applied to it), which is what vLLM returns with this project's `logprobs_mode="processed_logprobs"`
(`vllm_compat.start_engine`). A request without alternatives computes none.

New weights arrive through `load_weights` (checked against `parameter_manifest` before anything is
written), after which the server sets `version`.

With LoRA, one backend may also serve other policies on the same base (`guests`, `policies.<p>.base`):
each keeps its own set of adapter tensors and its own version, and a batch of one policy runs with that
policy's set swapped into the adapter parameters (a pointer swap, `ParameterAdopter`; no copy).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mas_async.inference.request import GenerationRequest
from mas_async.lora import ADAPTER_NAME, LoraSetup, adapter_parameters, saved_adapters, with_adapters
from mas_async.prefixes import MIN_SHARED_PREFIX, common_prefix_length, prompt_owners
from mas_async.weights.flat_params import ParameterAdopter, check_named_tensors
from mas_async.weights.group import dtype_name, torch_dtype
from mas_async.wire.samples import Completion


@dataclass
class _Row:
    """One sample of one request inside a batch, with the tokens generated so far."""

    prompt: np.ndarray
    request: GenerationRequest
    generator: torch.Generator | None = None
    """The row's own generator (a request with a seed), else None: it draws from the backend's."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logprobs: list[np.ndarray] = field(default_factory=list)
    """The alternatives of each position so far (a request with top_logprobs > 0 only)."""
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
        guests: dict[str, LoraSetup] | None = None,
        share_prompts: bool = True,
    ) -> None:
        """`share_prompts`: read each distinct prompt, and the prompts' common first part, once per batch
        (False: every sample's whole prompt, the reference of `bench/prompt_prefix.py`). `lora`: serve `model_path` (the base) with the policy's adapters applied (peft, as the trainer
        computes them); weight updates then carry the adapters only. `guests`: policy -> LoRA setup of other
        policies served on this base with adapters of their own (of the same rank, alpha and modules); a
        generate, load or adopt naming one (`adapter=`) uses that policy's adapters and version."""
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
        self.share_prompts = share_prompts
        self.max_positions: int = getattr(self.model.config, "max_position_embeddings", 1 << 30)
        pad = self.model.config.pad_token_id
        self.pad_id: int = 0 if pad is None else int(pad)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.guest_versions: dict[str, int] = {}
        """Weight version of each guest policy's adapters (the own ones' is `version`)."""
        self._sets: dict[str, list[tuple[str, torch.Tensor]]] = {}
        """Adapter tensors of each policy served ("": the own), when there are guests."""
        self._active = ""
        """The policy whose adapter tensors the model's adapter parameters are now."""
        if guests:
            if lora is None:
                raise ValueError("an hf backend serves guest policies' adapters only on a LoRA base (lora=...)")
            self._sets[""] = [(name, param.data) for name, param in self._updated]
            for policy, setup in guests.items():
                self._sets[policy] = self._starting_adapters(policy, setup, lora)
                self.guest_versions[policy] = 0
        # transformers 5 renamed the KV-cache argument (and output field) past_key_values -> cache.
        plain = self.model.get_base_model() if lora is not None else self.model
        forward_args = inspect.signature(plain.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self.version: int = 0

    # --- generation ---------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], adapter: str = "") -> list[list[Completion]]:
        """Sample every request's n completions (with guest policy `adapter`'s adapters when named); results
        are in request order, n per request."""
        for i, request in enumerate(requests):
            request.check(i, self.max_positions)
        self._use(adapter)
        version = self.guest_versions[adapter] if adapter else self.version
        rows = [
            _Row(np.asarray(r.prompt_ids, dtype=np.int64), r, self._seeded(r, i)) for r in requests for i in range(r.n)
        ]
        for start in range(0, len(rows), self.max_batch_sequences):
            self._generate_batch(rows[start : start + self.max_batch_sequences])
        results: list[list[Completion]] = []
        it = iter(rows)
        for request in requests:
            results.append([self._completion(next(it), version) for _ in range(request.n)])
        return results

    def _seeded(self, request: GenerationRequest, index: int) -> torch.Generator | None:
        """The generator of sample `index` of a seeded request (seed + index, as vLLM seeds its n samples)."""
        if request.seed is None or request.greedy or request.temperature == 0.0:
            return None
        return torch.Generator(device=self.device).manual_seed(request.seed + index)

    @staticmethod
    def _completion(row: _Row, version: int) -> Completion:
        top = bool(row.request.top_logprobs)
        return Completion(
            token_ids=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            version=version,
            finish_reason=row.finish_reason,
            top_ids=np.stack(row.top_ids).astype(np.int32) if top else None,
            top_logprobs=np.stack(row.top_logprobs).astype(np.float32) if top else None,
        )

    @torch.inference_mode()
    def _generate_batch(self, rows: list[_Row]) -> None:
        """Run one batch to completion, filling each row's tokens and log-probs. The prompts are read
        once each (a request's n samples share one prefill) and their common first part once in all
        (`_prefill`); the samples then decode as one batch with a KV cache."""
        owners = prompt_owners([r.prompt for r in rows]) if self.share_prompts else list(range(len(rows)))
        logits, cache, attention_mask, position_ids = self._prefill(
            [rows[owners.index(u)].prompt for u in range(max(owners) + 1)]
        )
        index = torch.tensor(owners, device=self.device)
        cache.batch_select_indices(index)  # each sample's own prompt
        logits, attention_mask, position_ids = logits[index], attention_mask[index], position_ids[index]

        active = list(range(len(rows)))  # rows still generating, in cache order
        seeded = any(row.generator is not None for row in rows)
        alternatives = any(row.request.top_logprobs for row in rows)
        while True:
            tokens, logprobs = self._sample(logits, [rows[i] for i in active], seeded, alternatives)
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
                tokens, attention_mask, position_ids = tokens[index], attention_mask[index], position_ids[index]
                active = [active[j] for j in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            cache = getattr(out, self._cache_kwarg)
            logits = out.logits[:, -1, :].float()

    def _prefill(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """Read the distinct `prompts`: their common first part once (when it is worth a pass), then the
        rest of each, left-padded so that every prompt ends in the last column. Returns the logits of
        each prompt's last position [U, V], the KV cache, the attention mask [U, width] and the
        position ids [U, width] (positions count real tokens only, so a padded prompt sees the same
        positions as alone)."""
        shared = common_prefix_length(prompts) if len(prompts) > 1 and self.share_prompts else 0
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
        cache = None  # the model creates its KV cache on the first call
        if shared:
            prefix = torch.from_numpy(prompts[0][:shared])[None].to(self.device)
            out = self.model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
            cache = getattr(out, self._cache_kwarg)
            cache.batch_select_indices(torch.zeros(len(prompts), dtype=torch.long, device=self.device))
        width = max(len(p) for p in prompts) - shared
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), shared + width), dtype=torch.long)
        attention_mask[:, :shared] = 1
        for u, prompt in enumerate(prompts):
            rest = prompt[shared:]
            input_ids[u, width - len(rest) :] = torch.from_numpy(rest)
            attention_mask[u, shared + width - len(rest) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids[:, shared:],
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float(), getattr(out, self._cache_kwarg), attention_mask, position_ids

    def _sample(
        self, logits: torch.Tensor, rows: list[_Row], seeded: bool = False, alternatives: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row; return the ids and their log-probs at each row's temperature. `seeded`:
        some row of the batch has its own generator; `alternatives`: some row asks for alternatives (added to
        the rows that ask). A batch with neither samples exactly as a backend without these features."""
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
            if seeded:
                tokens[sampled] = self._draw_seeded(probs, [rows[i] for i in sampled.tolist()])
            else:
                tokens[sampled] = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        if alternatives:
            _add_alternatives(logp, rows)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _draw_seeded(self, probs: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """One draw per row of `probs`: a row with its own generator draws alone from it (so its draw depends
        on nothing else in the batch), the others together from the backend's, as they would without it."""
        drawn = torch.empty(len(rows), dtype=torch.long, device=probs.device)
        shared = [j for j, row in enumerate(rows) if row.generator is None]
        if shared:
            drawn[shared] = torch.multinomial(probs[shared], 1, generator=self.generator).squeeze(-1)
        for j, row in enumerate(rows):
            if row.generator is not None:
                drawn[j] = torch.multinomial(probs[j : j + 1], 1, generator=row.generator)[0, 0]
        return drawn

    # --- weights ------------------------------------------------------------------------------

    def parameter_manifest(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of every parameter an update replaces (with LoRA, every adapter one), in
        `named_parameters()` order (tied ones once). Loading weights never changes it, so it is computed once."""
        if self._manifest is None:
            self._manifest = [(n, list(p.shape), dtype_name(p.dtype)) for n, p in self._updated]
        return self._manifest

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], adapter: str = "") -> None:
        """Replace every parameter (of guest policy `adapter`, when named) by copying. All names, shapes and
        dtypes are checked against the model before the first copy, so a mismatch raises a ValueError and
        leaves the model untouched."""
        params = dict(self._updated)
        check_named_tensors(params, named_tensors)
        targets = dict(self._sets[adapter]) if self._sets else params
        with torch.no_grad():
            for name, tensor in named_tensors:
                targets[name].copy_(tensor)

    def adopt_weights(self, named_tensors: list[tuple[str, torch.Tensor]], adapter: str = "") -> None:
        """Replace every parameter (of guest policy `adapter`, when named) without a copy: each becomes a
        view of its received tensor (checked first, like `load_weights`). The tensors must stay untouched
        until the next update."""
        adopter = self._parameter_adopter()
        if not self._sets:
            adopter.adopt(named_tensors)
            return
        if adapter == self._active:
            adopter.adopt(named_tensors)
        else:
            check_named_tensors(adopter.params, named_tensors)
        self._sets[adapter] = list(named_tensors)

    def _parameter_adopter(self) -> ParameterAdopter:
        if self._adopter is None:  # two buffer sets per policy served
            self._adopter = ParameterAdopter(dict(self._updated), keep=2 * max(1, len(self._sets)))
        return self._adopter

    def _use(self, adapter: str) -> None:
        """Make the adapter parameters those of `adapter` ("": the own ones) for the next batches."""
        if adapter == self._active:
            return
        if adapter not in self._sets:
            raise ValueError(f"this backend serves no guest policy {adapter!r} (guests: {sorted(self.guest_versions)})")
        self._parameter_adopter().adopt(self._sets[adapter])
        self._active = adapter

    def _starting_adapters(self, policy: str, setup: LoraSetup, own: LoraSetup) -> list[tuple[str, torch.Tensor]]:
        """Guest `policy`'s first adapter tensors: those saved in its checkpoint, else fresh ones: B is zero,
        so the model served is the base whatever A is (here a copy of the own A; the trainer's first update
        replaces both)."""
        shape = ("r", "alpha", "target_modules")
        if any(getattr(setup, key) != getattr(own, key) for key in shape):
            raise ValueError(
                f"guest policy {policy!r} has LoRA r={setup.r} alpha={setup.alpha} on {list(setup.target_modules)}, "
                f"the base's policy r={own.r} alpha={own.alpha} on {list(own.target_modules)}: a shared base "
                "serves adapters of one shape"
            )
        if setup.adapter is None:
            fresh = [(name, tensor.detach().clone()) for name, tensor in self._sets[""]]
            for name, tensor in fresh:
                if ".lora_B." in name:
                    tensor.zero_()
            return fresh
        saved = {_with_adapter_name(name): tensor for name, tensor in saved_adapters(setup.adapter)}
        params = dict(self._updated)
        loaded = [(name, saved[name].to(params[name].dtype)) for name in params if name in saved]
        check_named_tensors(params, loaded)
        return [(name, tensor.to(self.device)) for name, tensor in loaded]


def _with_adapter_name(saved: str) -> str:
    """A peft-saved adapter tensor's name as a parameter of the wrapped model (peft drops the adapter's name
    when it saves): ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight."""
    for part in ("lora_A", "lora_B"):
        if f".{part}.weight" in saved:
            return saved.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
    return saved


def _add_alternatives(logp: torch.Tensor, rows: list[_Row]) -> None:
    """Append to each row that asks for k alternatives the k most likely ids of its row of `logp` (the
    distribution its token was drawn from) and their log-probs, most likely first: one topk for them all."""
    asking = [j for j, row in enumerate(rows) if row.request.top_logprobs]
    if not asking:  # (those that asked have finished)
        return
    k = min(max(rows[j].request.top_logprobs for j in asking), logp.shape[-1])
    values, ids = logp[asking].topk(k, dim=-1)
    values, ids = values.cpu().numpy(), ids.cpu().numpy()
    for a, j in enumerate(asking):
        row = rows[j]
        row.top_ids.append(ids[a, : row.request.top_logprobs])
        row.top_logprobs.append(values[a, : row.request.top_logprobs])


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row beyond its top_p probability mass (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
