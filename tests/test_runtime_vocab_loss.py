"""Vocabulary-parallel cross-entropy (`autopar.runtime.vocab_loss`) on 2 gloo processes: the
loss and gradient of class-sharded logits equal one process's, with Megatron's communication
(3 all-reduces forward, none backward, the logits never gathered); torch's loss-parallel
handlers are off again once the backward is done, and what it does not cover (label smoothing,
whole logits, a bare log-softmax) keeps DTensor's own exact path."""

from __future__ import annotations

import pytest

from tests.test_runtime import launch_layouts

pytestmark = pytest.mark.slow


def test_vocab_parallel_cross_entropy(tmp_path):
    res = launch_layouts(["vocab_loss"], tmp_path, nproc=2)["vocab_loss"]
    for case in ("vocab", "smoothing", "whole"):
        r = res[case]
        assert abs(r["loss"] - r["ref"]) <= 1e-6 * abs(r["ref"]), (case, r)
        assert r["grad_err"] <= 1e-6, (case, r)
        assert r["handlers_left"] is False, (case, r)
    assert res["vocab"]["fwd"] == {"all_reduce": 3} and res["vocab"]["bwd"] == {}, res["vocab"]
    assert "all_gather_into_tensor" in res["smoothing"]["fwd"], res["smoothing"]   # DTensor's gather
    assert res["whole"]["fwd"] == {} and res["whole"]["bwd"] == {}, res["whole"]
    assert res["log_softmax_grad_err"] <= 1e-6, res
