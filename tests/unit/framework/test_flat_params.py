"""Flat parameter buffers (the trainer's side of the zero-copy weight sync) and parameter adoption."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mas_async.tiny_model import build_model
from mas_async.weights.flat_params import (
    HEADROOM_BYTES,
    ParameterAdopter,
    adopt_parameters,
    contiguous_region,
    flatten_parameters,
    headroom,
)


def _mixed_module() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.a = nn.Linear(3, 4)
    m.b = nn.Linear(4, 2).to(torch.bfloat16)
    m.c = nn.Linear(2, 5)
    return m


def test_flattening_keeps_values_and_makes_one_buffer_per_dtype() -> None:
    m = _mixed_module()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = {n: id(p) for n, p in m.named_parameters()}
    buffers = flatten_parameters(m.named_parameters())
    assert [b.dtype for b in buffers] == [torch.float32, torch.bfloat16]  # in order of first appearance
    for n, p in m.named_parameters():
        assert id(p) == ids[n]  # the same Parameter objects (optimiser state stays keyed right)
        assert torch.equal(p, before[n]), n
    f32 = [p for p in m.parameters() if p.dtype == torch.float32]
    region = contiguous_region([p.detach().reshape(-1) for p in f32])
    assert region is not None and region.data_ptr() == buffers[0].data_ptr()
    assert region.numel() == buffers[0].numel() == sum(p.numel() for p in f32)
    assert torch.equal(region, torch.cat([before[n].reshape(-1) for n in ("a.weight", "a.bias", "c.weight", "c.bias")]))


def test_training_a_flattened_model_gives_bit_for_bit_the_same_update() -> None:
    plain = build_model("tiny-char", seed=3)
    flat = copy.deepcopy(plain)
    flatten_parameters(flat.named_parameters())
    assert flat.lm_head.weight is flat.model.embed_tokens.weight  # tied weights moved once, still tied
    ids = torch.tensor([[1, 5, 9, 4, 2]])
    for model in (plain, flat):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    for (name, p), (_, q) in zip(plain.named_parameters(), flat.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_contiguous_region_refuses_tensors_that_are_not_back_to_back() -> None:
    flat = torch.arange(10.0)
    a, b, c = flat[0:3], flat[3:5], flat[6:8]
    assert torch.equal(contiguous_region([a, b]), flat[:5])
    assert contiguous_region([a, c]) is None  # a gap
    assert contiguous_region([b, a]) is None  # out of order
    assert contiguous_region([torch.zeros(3), torch.zeros(2)]) is None  # separate storages
    assert contiguous_region([flat[0:4:2]]) is None  # not contiguous


def test_adopting_takes_the_tensors_without_a_copy_and_checks_first() -> None:
    m = _mixed_module()
    params = dict(m.named_parameters())
    new = [(n, torch.randn_like(p.float()).to(p.dtype)) for n, p in params.items()]
    adopt_parameters(params, new)
    for (n, t), p in zip(new, params.values(), strict=True):
        assert p.data_ptr() == t.data_ptr(), n
    wrong = [(n, t) for n, t in new]
    wrong[1] = ("a.bias", torch.zeros(7))
    served = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(ValueError, match=r"'a.bias' is float32\[7\]"):
        adopt_parameters(params, [(n, t.clone()) for n, t in wrong])
    for n, p in params.items():
        assert torch.equal(p, served[n]), n
    with pytest.raises(ValueError, match="missing"):
        adopt_parameters(params, new[:-1])


def test_an_adopter_checks_a_list_of_pairs_once_and_any_other_list_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver hands out the same pairs of a buffer set every version: checked the first time only;
    a list with another pair (a new layout, or a wrong tensor) is checked, and refused before any change."""
    import mas_async.weights.flat_params as flat_params

    m = _mixed_module()
    params = dict(m.named_parameters())
    adopter = ParameterAdopter(params)
    checks = []
    real_check = flat_params.check_named_tensors
    monkeypatch.setattr(flat_params, "check_named_tensors", lambda *a: checks.append(1) or real_check(*a))
    sets = [[(n, torch.randn_like(p.float()).to(p.dtype)) for n, p in params.items()] for _ in range(2)]
    for version in range(6):  # two buffer sets in turn, as ThreadedBackend adopts them
        pairs = sets[version % 2]
        adopter.adopt(list(pairs))
        assert all(params[n].data_ptr() == t.data_ptr() for n, t in pairs)
    assert len(checks) == 2
    wrong = list(sets[0])
    wrong[1] = ("a.bias", torch.zeros(7))
    with pytest.raises(ValueError, match=r"'a.bias' is float32\[7\]"):
        adopter.adopt(wrong)
    assert len(checks) == 3 and params["a.bias"].data_ptr() == sets[1][1][1].data_ptr()


def test_a_flat_buffer_has_headroom_for_the_header_and_nothing_else_does() -> None:
    """`headroom` gives the 16 reserved bytes plus the region only for the start of a buffer that
    `flatten_parameters` made and its first parameter still lives in."""
    m = _mixed_module()
    buffers = flatten_parameters(m.named_parameters())
    f32 = [p.detach().reshape(-1) for p in m.parameters() if p.dtype == torch.float32]
    region = contiguous_region(f32)
    assert region is not None
    room = headroom(region)
    assert room is not None and room.dtype == torch.uint8
    assert room.numel() == HEADROOM_BYTES + region.numel() * 4 and room.data_ptr() + HEADROOM_BYTES == region.data_ptr()
    room[:HEADROOM_BYTES] = 7  # the header's bytes are no parameter's
    assert torch.equal(buffers[0], region)
    assert headroom(contiguous_region(f32[1:])) is None  # not the buffer's start
    assert headroom(torch.zeros(10)[2:]) is None  # not a flat buffer
    m.a.weight.data = m.a.weight.data.clone()  # the first parameter left the buffer
    assert headroom(region) is None
