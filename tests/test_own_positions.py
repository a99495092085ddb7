"""Token positions a model makes itself, found for context parallelism (issue 13,
`capture.own_positions`): the `arange`s that follow the sequence length (two traces, a rank's
tokens and the whole sequence) become the op that reads a rank's positions, a coincidence of
lengths does not; a shift of the labels inside the model is taken out (the runtime shifts them
on the whole sequence); an explicit mask from the positions is run as causal attention where
it is the causal one, refused otherwise."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import PlanError
from autopar.capture.export import export_program
from autopar.capture.own_positions import find, reads_positions, rewrite
from autopar.models.positions import positions_set

V, D, L, S = 32, 8, 8, 16


class OwnPositions(nn.Module):
    """A causal LM that makes its own positions (`start` .. `start` + t: 0 is the positions),
    adds a constant `arange(D)` (of the rank's length L: a coincidence), masks its attention by
    `mask` (None: `is_causal`) and shifts its labels inside (`shift`)."""

    def __init__(self, start: int = 0, mask: str = "", shift: bool = False) -> None:
        super().__init__()
        self.emb, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(2 * S + 2, D), nn.Linear(D, V)
        self.start, self.mask, self.shift = start, mask, shift

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        pos = torch.arange(self.start, self.start + t, device=ids.device)
        x = self.emb(ids) + self.pos(pos) + torch.arange(D, device=ids.device).float()
        q = x.unsqueeze(1)
        if self.mask:
            keep = pos[None, :] <= pos[:, None] if self.mask == "causal" else pos[None, :] >= pos[:, None]
            y = F.scaled_dot_product_attention(q, q, q, attn_mask=keep)
        else:
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        logits = self.head(y.squeeze(1))
        if self.shift:
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _programs(model: nn.Module):
    """The model's program at the rank's L tokens and at the whole S, and its input names."""
    ids = torch.zeros(2, L, dtype=torch.long)
    at_l = export_program(model, (ids, ids))[0]
    at_s = export_program(model, (torch.zeros(2, S, dtype=torch.long),) * 2)[0]
    return at_l, at_s, {n: i for i, n in enumerate(at_l.graph_signature.user_inputs)}


def test_the_arange_that_follows_the_sequence_is_the_positions_and_reads_the_ranks():
    """Only the `arange` of L tokens whose namesake is of S is made the positions op: the
    model's `arange(D)`, of L elements too, stays. Run on a rank's tokens with its positions
    set, the program's loss is the eager model's on those tokens at those positions."""
    torch.manual_seed(0)
    model = OwnPositions()
    at_l, at_s, inputs = _programs(model)
    found = find(at_l.graph_module, at_s.graph_module, L, S, inputs)
    assert len(found.positions) == 1 and not found.shifts and not found.causal
    rewrite(at_l.graph_module, found, L)
    assert reads_positions(at_l.graph_module)
    kept = [n for n in at_l.graph_module.graph.nodes if "arange" in str(n.target)]
    assert len(kept) == 1 and kept[0].args[0] == D == L       # the coincidence stays a constant
    ids = torch.randint(0, V, (2, S))
    pos = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])        # rank 0 of cp2's chunks
    with positions_set(pos):
        got = at_l.module()(ids[:, pos], ids[:, pos])
    # the same tokens at their positions in the whole sequence, eagerly: the model's embedding
    # read at `pos` (a causal mask over the rank's tokens in its own order: what a rank's
    # queries see of its own keys)
    x = model.emb(ids[:, pos]) + model.pos(pos) + torch.arange(D).float()
    q = x.unsqueeze(1)
    want = F.cross_entropy(model.head(F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1))
                           .flatten(0, 1), ids[:, pos].flatten())
    assert torch.allclose(got, want)


def test_an_arange_that_follows_the_sequence_otherwise_is_refused():
    """Positions 1 .. t follow the sequence length but are not 0 .. t - 1: no rank could be
    given them, PlanError naming the op."""
    at_l, at_s, inputs = _programs(OwnPositions(start=1))
    with pytest.raises(PlanError, match="arange whose length follows the sequence .* not the tokens' positions"):
        find(at_l.graph_module, at_s.graph_module, L, S, inputs)


def test_a_label_shift_inside_the_model_is_taken_out():
    """`pad(labels, (0, 1), value=-100)[..., 1:]` inside the model: found as model input 1
    shifted by one, -100 after; rewritten, the loss reads the labels as given (the runtime
    shifts them on the whole sequence before the split, `ContextParallel.split_input`), equal
    to the model's on labels shifted outside."""
    from autopar.runtime.context_parallel import ContextParallel

    torch.manual_seed(0)
    model = OwnPositions(shift=True)
    at_l, at_s, inputs = _programs(model)
    found = find(at_l.graph_module, at_s.graph_module, L, S, inputs)
    assert found.shifts == {1: (1, -100.0)}
    rewrite(at_l.graph_module, found, L)
    ids = torch.randint(0, V, (2, L))
    cp = ContextParallel(None, 0, 1, L)
    cp.shifts = found.shifts
    shifted = cp.split_input(1, ids)
    assert torch.equal(shifted[:, :-1], ids[:, 1:]) and (shifted[:, -1] == -100).all()
    with positions_set(torch.arange(L)):
        assert torch.allclose(at_l.module()(ids, shifted), model(ids, ids))


def test_a_causal_mask_from_the_positions_runs_as_causal_attention_and_another_is_refused():
    """A mask `k_pos <= q_pos` computed from the positions alone, evaluated at the whole
    sequence, is the causal one: its attention is made `is_causal=True` without it. The reverse
    (`k_pos >= q_pos`) is refused: context parallelism runs causal or unmasked attention."""
    at_l, at_s, inputs = _programs(OwnPositions(mask="causal"))
    found = find(at_l.graph_module, at_s.graph_module, L, S, inputs)
    assert len(found.causal) == 1
    rewrite(at_l.graph_module, found, L)
    sdpa = [n for n in at_l.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa[0].args[3] is None and (sdpa[0].kwargs.get("is_causal") or sdpa[0].args[5])
    at_l, at_s, inputs = _programs(OwnPositions(mask="reverse"))
    with pytest.raises(PlanError, match="explicit attention mask that is not the causal one"):
        find(at_l.graph_module, at_s.graph_module, L, S, inputs)
