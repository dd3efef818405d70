"""THD packing of actor micro-batches, up to the Transformer Engine boundary (no GPU or TE needed).

Pins: the padding rule and its refusal of CP; the packed/padded selection; cu_seqlens by hand; the
PackedSeqParams fields Megatron hands to TE attention; pack/unpack round trips and that next-token
values never cross a row boundary (hypothesis); RoPE restarting per row with our cu_seqlens in
Megatron's THD RoPE; and, with transformers' Qwen3 run on each sequence alone, that log-probs
unpacked from the packed stream equal the per-sequence ones exactly (values and gradients).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _apply_rotary_pos_emb_thd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import padded_micro_batches
from megatron_rl.actor.packing import (
    FP8_TOKEN_ALIGNMENT,
    PackingRule,
    pack_tokens,
    packed_seq_params,
    packing_rule,
    padded_sequence_multiple,
    plan_micro_batch_packing,
    plan_packing,
    select_packing,
    unpack_predictions,
    unpack_tokens,
)
from megatron_rl.actor.token_logprobs import packed_token_log_probs, token_log_probs
from megatron_rl.parallel.context_parallel import local_positions


def _padded_ids(lengths: list[int], seq_length: int, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(1, 1000, (len(lengths), seq_length), generator=torch.Generator().manual_seed(seed))
    return ids.masked_fill(torch.arange(seq_length) >= torch.tensor(lengths).unsqueeze(1), 0)


# ---------------------------------------------------------------- rule and selection


def test_padding_rule_is_tp_with_sequence_parallel_times_fp8_alignment():
    assert packing_rule(tp=1, cp=1, sequence_parallel=False, fp8_recipe=None) == PackingRule(1, 1)
    assert packing_rule(tp=4, cp=1, sequence_parallel=True, fp8_recipe=None) == PackingRule(4, 4)
    assert packing_rule(tp=4, cp=1, sequence_parallel=False, fp8_recipe=None) == PackingRule(1, 1)
    assert packing_rule(tp=2, cp=1, sequence_parallel=True, fp8_recipe="tensorwise") == PackingRule(2, 32)
    assert packing_rule(tp=2, cp=1, sequence_parallel=True, fp8_recipe="mxfp8") == PackingRule(2, 64)
    assert packing_rule(tp=8, cp=1, sequence_parallel=True, fp8_recipe="blockwise") == PackingRule(8, 1024)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("recipe", [None, *FP8_TOKEN_ALIGNMENT])
def test_padded_fp8_micro_batches_give_every_tp_rank_aligned_token_rows(tp, recipe):
    """FP8 without packing: rows x S / tp tokens per TP rank are a multiple of TE's FP8 alignment, any row count."""
    lengths = [3, 11, 7, 5, 2]
    batch = ActorBatch(
        input_ids=_padded_ids(lengths, 11),
        lengths=torch.tensor(lengths),
        response_mask=torch.ones(len(lengths), 11, dtype=torch.bool),
        advantages=torch.ones(len(lengths)),
    )
    multiple = padded_sequence_multiple(tp=tp, fp8_recipe=recipe)
    alignment = FP8_TOKEN_ALIGNMENT[recipe] if recipe else 1
    assert multiple == tp * alignment
    for plan in ([[0], [1, 2], [3, 4]], [[0, 1, 2, 3, 4]]):
        for micro in padded_micro_batches(batch, plan, None, seq_multiple=multiple):
            rows, seq_length = micro.input_ids.shape
            assert seq_length >= 11 and seq_length % tp == 0 and (rows * seq_length // tp) % alignment == 0


@pytest.mark.parametrize(("tp", "cp", "recipe"), [(1, 2, None), (2, 2, None), (2, 4, "blockwise"), (4, 2, "mxfp8")])
def test_context_parallel_packing_gives_each_rank_two_chunks_of_every_segment(tp, cp, recipe):
    """Segments are multiples of 2*cp*tp; each CP rank's stream is T/cp tokens, TP- and FP8-aligned, and the
    ranks together hold every position once (Transformer Engine's thd_get_partitioned_indices split)."""
    rule = packing_rule(tp=tp, cp=cp, sequence_parallel=tp > 1, fp8_recipe=recipe)
    alignment = FP8_TOKEN_ALIGNMENT[recipe] if recipe else 1
    assert rule.sequence_multiple == 2 * cp * tp and rule.total_multiple % rule.sequence_multiple == 0
    layout = plan_packing([5, 0, 13, 2], 16, rule)
    bounds = layout.cu_seqlens
    assert all((end - start) % (2 * cp * tp) == 0 for start, end in zip(bounds[:-1], bounds[1:], strict=True))
    shares = [local_positions(layout.total, cp, rank, segments=bounds) for rank in range(cp)]
    assert all(len(share) == layout.total // cp and (len(share) // tp) % alignment == 0 for share in shares)
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(layout.total))


def test_thd_parameters_carry_the_padded_boundaries_under_context_parallelism():
    layout = plan_packing([5, 3], 8, PackingRule(4, 4))
    params = packed_seq_params(layout, "cpu", context_parallel=True)
    assert torch.equal(params.cu_seqlens_q_padded, params.cu_seqlens_q) and params.cu_seqlens_kv_padded is not None
    plain = packed_seq_params(layout, "cpu")
    assert plain.cu_seqlens_q_padded is None and plain.cu_seqlens_kv_padded is None


@pytest.mark.parametrize(("pack", "cuda", "te"), list(itertools.product([False, True], repeat=3)))
def test_selection_packs_only_with_recipe_cuda_and_te(pack, cuda, te):
    rule = select_packing(
        pack_sequences=pack,
        cuda=cuda,
        transformer_engine_spec=te,
        tp=2,
        cp=1,
        sequence_parallel=True,
        fp8_recipe=None,
    )
    assert rule == (PackingRule(2, 2) if pack and cuda and te else None)


def test_context_parallelism_packs_with_transformer_engine_and_pads_on_cpu():
    select = partial(select_packing, tp=2, cp=2, sequence_parallel=True, fp8_recipe=None)
    assert select(pack_sequences=True, cuda=False, transformer_engine_spec=False) is None
    assert select(pack_sequences=True, cuda=True, transformer_engine_spec=True) == PackingRule(8, 8)


@pytest.mark.parametrize(("tp", "cp", "recipe"), [(1, 2, None), (2, 2, None), (2, 4, "blockwise"), (4, 1, "mxfp8")])
def test_padded_rows_split_into_cp_chunks_that_tp_splits_again(tp, cp, recipe):
    """S is a multiple of 2*cp (two chunks per CP rank) and each CP share S/cp of tp x FP8 alignment."""
    multiple = padded_sequence_multiple(tp=tp, fp8_recipe=recipe, cp=cp)
    alignment = FP8_TOKEN_ALIGNMENT[recipe] if recipe else 1
    assert multiple % (2 * cp if cp > 1 else 1) == 0 and (multiple // cp) % (tp * alignment) == 0


def test_local_attention_cannot_run_thd():
    """Why CPU runs pad: Megatron's local DotProductAttention rejects packed_seq_params outright."""
    assert "assert packed_seq_params is None" in inspect.getsource(DotProductAttention.forward)


# ---------------------------------------------------------------- layout by hand


def test_cu_seqlens_by_hand_with_tp4_padding_and_an_empty_row():
    layout = plan_packing([5, 0, 3, 8], 8, PackingRule(4, 4))
    assert layout.cu_seqlens == (0, 8, 12, 20)
    assert layout.starts == (0, 8, 8, 12)
    assert (layout.total, layout.max_seqlen) == (20, 8)
    assert layout.position_ids("cpu").tolist() == [list(range(8)) + list(range(4)) + list(range(8))]


def test_tail_segment_fills_a_larger_total():
    layout = plan_packing([5, 0, 3, 8], 8, PackingRule(4, 4), total=28)
    assert layout.cu_seqlens == (0, 8, 12, 20, 28)
    assert layout.max_seqlen == 8
    assert plan_packing([5, 3], 8, PackingRule(1, 16)).cu_seqlens == (0, 5, 8, 16)
    assert plan_packing([0, 0], 4, PackingRule(2, 2)).cu_seqlens == (0, 2)
    with pytest.raises(ValueError, match="cannot pack 20 tokens into T=16"):
        plan_packing([5, 0, 3, 8], 8, PackingRule(4, 8), total=16)
    with pytest.raises(ValueError, match=r"T=36 \(a positive multiple of 8\)"):
        plan_packing([5, 0, 3, 8], 8, PackingRule(4, 8), total=36)
    with pytest.raises(ValueError, match=r"row lengths must lie in \[0, 8\]"):
        plan_packing([9], 8, PackingRule())


def test_micro_batches_of_a_call_share_one_total():
    layouts = plan_micro_batch_packing([[5, 3], [8, 8, 1], [0, 0]], 8, PackingRule(2, 4))
    assert [layout.total for layout in layouts] == [20, 20, 20]
    assert [layout.cu_seqlens for layout in layouts] == [(0, 6, 10, 20), (0, 8, 16, 18, 20), (0, 20)]


def test_pack_tokens_places_rows_and_fills_pad_positions():
    ids = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 0, 0]])
    layout = plan_packing([3, 0, 2], 4, PackingRule(2, 2), total=8)
    assert pack_tokens(ids, layout, fill=-1).tolist() == [[1, 2, 3, -1, 4, 5, -1, -1]]
    experts = torch.arange(4 * 2).view(1, 4, 1, 2).expand(3, -1, -1, -1) + 100
    packed = pack_tokens(experts, plan_packing([3, 0, 2], 4, PackingRule(2, 2)), fill=torch.arange(2))
    assert packed.shape == (1, 6, 1, 2)
    assert packed[0, 3].tolist() == [[0, 1]] and packed[0, 2].tolist() == [[104, 105]]


# ---------------------------------------------------------------- what Megatron and TE receive


def test_packed_seq_params_carry_exactly_the_thd_fields_te_attention_takes():
    layout = plan_packing([5, 0, 3, 8], 8, PackingRule(4, 4))
    params = packed_seq_params(layout, "cpu")
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is params.cu_seqlens_kv
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.device.type == "cpu"
    assert params.cu_seqlens_q.tolist() == [0, 8, 12, 20]
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (8, 8)
    assert type(params.max_seqlen_q) is int
    unset = {f.name for f in dataclasses.fields(PackedSeqParams)} - {
        "qkv_format",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "max_seqlen_q",
        "max_seqlen_kv",
    }
    assert all(getattr(params, name) is None for name in unset)
    # RoPE's table length (GPTModel._preprocess -> get_rotary_seq_len) is max_seqlen, not T:
    # only then does Megatron's THD RoPE restart positions per segment.
    assert RotaryEmbedding.get_rotary_seq_len(None, None, None, None, None, params) == 8 < layout.total


def test_rope_on_the_packed_stream_equals_rope_per_padded_row():
    lengths, seq_length, dim = [5, 0, 3, 8, 1], 8, 8
    layout = plan_packing(lengths, seq_length, PackingRule(4, 4))
    params = packed_seq_params(layout, "cpu")
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    angles = rope.get_freqs_non_repeated(max(params.max_seqlen_q, params.max_seqlen_kv))
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # RotaryEmbedding.get_emb without the GPU move
    heads_SBHD = torch.randn(seq_length, len(lengths), 2, dim, generator=torch.Generator().manual_seed(0))
    padded_SBHD = _apply_rotary_pos_emb_bshd(heads_SBHD, freqs[:seq_length])
    stream_THD = pack_tokens(heads_SBHD.transpose(0, 1), layout)[0]
    no_cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    packed_THD = _apply_rotary_pos_emb_thd(stream_THD, params.cu_seqlens_q, freqs, cp_group=no_cp)
    unpacked_BSHD = unpack_tokens(packed_THD.unsqueeze(0), layout)
    valid_BS = torch.arange(seq_length) < torch.tensor(lengths).unsqueeze(1)
    torch.testing.assert_close(unpacked_BSHD[valid_BS], padded_SBHD.transpose(0, 1)[valid_BS], rtol=0, atol=0)


@pytest.mark.parametrize("cp", [2, 4])
def test_megatrons_thd_rope_on_a_cp_ranks_stream_equals_the_whole_streams_at_its_positions(cp):
    """Our per-segment split is the layout Megatron's THD RoPE expects under CP (it rotates each segment's
    local chunks by the positions of chunks r and 2cp-1-r, from the padded boundaries)."""
    layout = plan_packing([5, 0, 3, 16, 1], 16, packing_rule(tp=1, cp=cp, sequence_parallel=False, fp8_recipe=None))
    dim = 8
    params = packed_seq_params(layout, "cpu", context_parallel=True)
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    angles = rope.get_freqs_non_repeated(params.max_seqlen_q)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    stream_THD = torch.randn(layout.total, 2, dim, generator=torch.Generator().manual_seed(1))
    whole_THD = _apply_rotary_pos_emb_thd(
        stream_THD, params.cu_seqlens_q_padded, freqs, cp_group=SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    )
    for rank in range(cp):
        own = local_positions(layout.total, cp, rank, segments=layout.cu_seqlens)
        group = SimpleNamespace(size=lambda: cp, rank=lambda rank=rank: rank)
        local_THD = _apply_rotary_pos_emb_thd(stream_THD[own], params.cu_seqlens_q_padded, freqs, cp_group=group)
        torch.testing.assert_close(local_THD, whole_THD[own], rtol=0, atol=0)


# ---------------------------------------------------------------- properties


@st.composite
def _micro_batches(draw):
    seq_length = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, seq_length), min_size=1, max_size=6))
    sequence_multiple = draw(st.sampled_from([1, 2, 4, 8]))
    rule = PackingRule(sequence_multiple, sequence_multiple * draw(st.sampled_from([1, 16])))
    return lengths, seq_length, rule


@settings(max_examples=150, deadline=None)
@given(_micro_batches())
def test_layout_respects_the_padding_rule(case):
    lengths, seq_length, rule = case
    layout = plan_packing(lengths, seq_length, rule)
    bounds = layout.cu_seqlens
    assert bounds[0] == 0 and all(a < b for a, b in itertools.pairwise(bounds))
    assert layout.total % rule.total_multiple == 0 and layout.total >= 1
    used = sum(-(-n // rule.sequence_multiple) * rule.sequence_multiple for n in lengths)
    assert layout.total == max(-(-used // rule.total_multiple) * rule.total_multiple, rule.total_multiple)
    rows = [(start, n) for start, n in zip(layout.starts, lengths, strict=True) if n]
    for (start, n), segment_start, segment_end in zip(rows, bounds[:-1], bounds[1:], strict=False):
        assert start == segment_start and (segment_end - segment_start) % rule.sequence_multiple == 0
        assert n <= segment_end - segment_start < n + rule.sequence_multiple
    assert layout.max_seqlen == max(b - a for a, b in itertools.pairwise(bounds))


@settings(max_examples=150, deadline=None)
@given(_micro_batches())
def test_pack_unpack_round_trip(case):
    lengths, seq_length, rule = case
    layout = plan_packing(lengths, seq_length, rule)
    ids_BS = _padded_ids(lengths, seq_length)
    packed_1T = pack_tokens(ids_BS, layout, fill=-1)
    assert packed_1T.shape == (1, layout.total)
    assert (packed_1T >= 0).sum() == sum(lengths)
    torch.testing.assert_close(unpack_tokens(packed_1T, layout), ids_BS, rtol=0, atol=0)
    values_BSD = torch.randn(len(lengths), seq_length, 3).masked_fill((ids_BS == 0).unsqueeze(-1), 0.0)
    torch.testing.assert_close(unpack_tokens(pack_tokens(values_BSD, layout), layout), values_BSD, rtol=0, atol=0)


@settings(max_examples=150, deadline=None)
@given(_micro_batches())
def test_next_token_values_never_cross_a_row_boundary(case):
    """Stream position p may feed the result only if p and p + 1 are valid tokens of the same row."""
    lengths, seq_length, rule = case
    layout = plan_packing(lengths, seq_length, rule)
    ids_BS = _padded_ids(lengths, seq_length)
    stream = pack_tokens(ids_BS, layout, fill=-1)[0]
    row_of = torch.full((layout.total,), -1)
    for row, (start, n) in enumerate(zip(layout.starts, lengths, strict=True)):
        row_of[start : start + n] = row
    allowed = (row_of[:-1] >= 0) & (row_of[:-1] == row_of[1:])
    # value at p: the id of the token p predicts, where allowed; NaN (poison) anywhere else.
    values = torch.where(allowed, stream[1:].double(), torch.nan).unsqueeze(0)
    unpacked_BS = unpack_predictions(values, layout)
    expected_BS = ids_BS.double()
    expected_BS[:, 0] = 0
    assert torch.isfinite(unpacked_BS).all()
    torch.testing.assert_close(unpacked_BS, expected_BS, rtol=0, atol=0)


# ---------------------------------------------------------------- numerical equivalence with transformers


@pytest.fixture(scope="module")
def qwen3_per_sequence_logits():
    """Tiny Qwen3 (fp32, eager) run on each sequence ALONE; the rows' logits and ids, padded layout."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    lengths, seq_length = [7, 0, 3, 10, 1, 6], 10
    ids_BS = _padded_ids(lengths, seq_length) % config.vocab_size
    logits_BSV = torch.full((len(lengths), seq_length, config.vocab_size), torch.nan)
    with torch.no_grad():
        for row, n in enumerate(lengths):
            if n:
                logits_BSV[row, :n] = model(ids_BS[row : row + 1, :n]).logits[0].float()
    return lengths, ids_BS, logits_BSV, config.vocab_size


def _pack_logits(logits_BSV: torch.Tensor, layout, fill: float) -> torch.Tensor:
    return pack_tokens(torch.nan_to_num(logits_BSV, nan=fill), layout, fill=fill)


def test_unpacked_log_probs_equal_per_sequence_log_probs_exactly(qwen3_per_sequence_logits):
    lengths, ids_BS, logits_BSV, vocab = qwen3_per_sequence_logits
    valid_BS = ids_BS != 0
    temperature = 0.7
    padded = token_log_probs(logits_BSV, ids_BS, vocab, None, temperature=temperature)
    reference = torch.log_softmax(logits_BSV[:, :-1] / temperature, dim=-1).gather(-1, ids_BS[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(padded.log_probs[:, 1:][valid_BS[:, 1:]], reference[valid_BS[:, 1:]])
    for rule in (PackingRule(1, 1), PackingRule(4, 4), PackingRule(2, 32)):
        layout = plan_packing(lengths, ids_BS.shape[1], rule)
        # pad positions' logits are NaN: any read of them would poison the result
        packed = packed_token_log_probs(
            _pack_logits(logits_BSV, layout, torch.nan),
            pack_tokens(ids_BS, layout),
            layout,
            vocab,
            None,
            temperature=temperature,
        )
        expected_mask = valid_BS.clone()
        expected_mask[:, 0] = False
        for name in ("log_probs", "entropy"):
            got, want = getattr(packed, name), getattr(padded, name)
            assert torch.equal(got[expected_mask], want[expected_mask]), name
            assert torch.equal(got[~expected_mask], torch.zeros_like(got[~expected_mask])), name


def test_packed_log_prob_gradients_reach_only_the_rows_own_positions(qwen3_per_sequence_logits):
    lengths, ids_BS, logits_BSV, vocab = qwen3_per_sequence_logits
    layout = plan_packing(lengths, ids_BS.shape[1], PackingRule(4, 4))
    weights_BS = torch.randn(ids_BS.shape, generator=torch.Generator().manual_seed(1))
    padded_BSV = torch.nan_to_num(logits_BSV, nan=3.0).requires_grad_()
    packed_1TV = _pack_logits(logits_BSV, layout, 3.0).requires_grad_()
    mask_BS = (ids_BS != 0).float()
    (
        token_log_probs(padded_BSV, ids_BS, vocab, None, temperature=1.0).log_probs * weights_BS * mask_BS
    ).sum().backward()
    (
        packed_token_log_probs(packed_1TV, pack_tokens(ids_BS, layout), layout, vocab, None, temperature=1.0).log_probs
        * weights_BS
    ).sum().backward()
    assert packed_1TV.grad is not None and padded_BSV.grad is not None
    grad_BSV = unpack_tokens(packed_1TV.grad, layout)
    torch.testing.assert_close(grad_BSV, padded_BSV.grad * (ids_BS != 0).unsqueeze(-1), rtol=0, atol=1e-7)
    last_of_row = torch.tensor([start + n - 1 for start, n in zip(layout.starts, lengths, strict=True) if n])
    read = torch.zeros(layout.total, dtype=torch.bool)
    for start, n in zip(layout.starts, lengths, strict=True):
        read[start : start + n - 1] = n > 1
    assert packed_1TV.grad[0, ~read].abs().sum() == 0 and packed_1TV.grad[0, last_of_row].abs().sum() == 0
