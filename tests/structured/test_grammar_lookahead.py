"""Looking ahead without committing, as speculative decoding needs: how many proposals a
request's grammar allows in a row (the reasoning before the constraint takes any), and the
bitmask rows of the states after each proposal, with the grammar left as it was."""

from __future__ import annotations

import numpy as np

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.manager import RequestGrammar
from tests.structured.conftest import grammar_of


def grammar(manager, regex: str, reasoning_end: list[int] | None = None) -> RequestGrammar:
    return grammar_of(manager, StructuredOutputsParams(regex=regex), reasoning_end)


def mask(manager, request_grammar: RequestGrammar) -> np.ndarray:
    out = np.zeros((1, manager.bitmask_width), dtype=np.int32)
    manager.fill_bitmask([request_grammar], out)
    return out[0]


def test_num_allowed_counts_the_proposals_allowed_in_a_row_and_changes_nothing(manager, ids):
    g = grammar(manager, "[a-c]{3}x")
    assert g.num_allowed(ids("abzc")) == 2
    assert g.num_allowed(ids("cabx")) == 4
    assert g.num_allowed(ids("cabxa")) == 4  # nothing after the complete output
    assert g.num_allowed([]) == 0
    for token in ids("ab"):
        g.accept_token(token)
    assert g.num_allowed(ids("cxa")) == 2 and g.num_allowed(ids("ab")) == 1


def test_the_reasoning_before_the_constraint_takes_any_proposal(manager, ids):
    g = grammar(manager, "[a-c]{2}", reasoning_end=ids("zy"))
    assert g.num_allowed(ids("xxzyabz")) == 6
    assert g.num_allowed(ids("xxz")) == 3  # the reasoning has not ended
    g.accept_token(ids("z")[0])  # half of the end sequence is in already
    assert g.num_allowed(ids("yaz")) == 2


def reference_rows(manager, regex: str, reasoning_end, accepted: list[int],
                   proposal: list[int]) -> list[np.ndarray]:
    """The verification rows of ``proposal`` from states reached by accepting the tokens
    for real: each state's mask until a proposal is refused, all-allowed rows after."""
    reference = grammar(manager, regex, reasoning_end)
    for token in accepted:
        reference.accept_token(token)
    rows, refused = [], False
    for j in range(len(proposal) + 1):
        rows.append(np.full(manager.bitmask_width, -1, dtype=np.int32) if refused
                    else mask(manager, reference))
        if j < len(proposal):
            refused = refused or not reference.allows(proposal[j])
            if not refused:
                reference.accept_token(proposal[j])
    return rows


def test_verification_rows_mask_as_the_states_after_the_proposals_before_them(manager, ids):
    g, other = grammar(manager, "[a-c]{3}x"), grammar(manager, "[a-c]+", reasoning_end=ids("z"))
    g.accept_token(ids("a")[0])
    before = mask(manager, g), mask(manager, other)
    proposals = [ids("bcz"), ids("yza")]  # g refuses "z"; other's reasoning ends at "z"
    out = np.zeros((sum(len(p) + 1 for p in proposals), manager.bitmask_width), dtype=np.int32)
    manager.fill_verify_bitmask([g, other], proposals, out)

    expected = (reference_rows(manager, "[a-c]{3}x", None, ids("a"), proposals[0])
                + reference_rows(manager, "[a-c]+", ids("z"), [], proposals[1]))
    np.testing.assert_array_equal(out, np.stack(expected))
    assert (out[3] == -1).all()  # after the refused proposal: never read
    assert (out[4:6] == -1).all() and (out[6] != -1).any()  # the reasoning, then [a-c]
    np.testing.assert_array_equal(mask(manager, g), before[0])  # the grammars are as they were
    np.testing.assert_array_equal(mask(manager, other), before[1])
    assert g.num_allowed(ids("bcx")) == 3


def test_proposals_past_a_complete_output_leave_the_grammar_unharmed(manager, ids):
    """A drawn proposal kept past the end of the output (the scheduler keeps the first
    refused one) is never accepted: its row and the next allow everything."""
    g = grammar(manager, "[a-c]{3}x")
    g.accept_token(ids("a")[0])
    proposals = [ids("bcxa")]
    out = np.zeros((5, manager.bitmask_width), dtype=np.int32)
    manager.fill_verify_bitmask([g], proposals, out)
    np.testing.assert_array_equal(
        out[:4], np.stack(reference_rows(manager, "[a-c]{3}x", None, ids("a"), ids("bcx"))))
    assert (out[3:] == -1).all()  # complete after "x": nothing is constrained
    assert g.error is None and not g.is_terminated()
    assert g.num_allowed(ids("bcx")) == 3
