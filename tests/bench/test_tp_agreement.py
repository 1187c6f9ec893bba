"""benchmarks/tp_agreement.py's comparison of two runs' answers, and its options (the runs themselves need a model of a
real shape: they are measured on GPUs, BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_suite import NEMOTRON_3_NANO_30B_A3B
from benchmarks.tp_agreement import GREEDY_TOKENS, compare, parse_runs, shape_with_layers


def _run(tops, greedy):
    return {"top": [[list(t) for t in top] for top in tops], "greedy": greedy}


def test_a_flipped_near_tie_is_reported_with_its_margin_and_the_logprob_moves():
    same = list(range(GREEDY_TOKENS))
    a = _run([[(5, -0.10), (7, -0.15), (9, -3.0)], [(1, -0.5), (2, -2.5)]], [same, same])
    b = _run([[(7, -0.12), (5, -0.13), (9, -3.0)], [(1, -0.5), (2, -2.4)]],
             [[9] + same[1:], same[:10] + [0] * (GREEDY_TOKENS - 10)])
    c = compare(a, b)
    assert c["first_token_flips"] == [{"prompt": 0, "margin": pytest.approx(0.05)}]
    assert c["logprob_move_max"] == pytest.approx(0.1)  # token 2 of prompt 1
    assert c["greedy_common_prefix_mean"] == 5 and c["all_greedy_agree_fraction"] == 0
    assert compare(a, a)["logprob_move_max"] == 0 and compare(a, a)["all_greedy_agree_fraction"] == 1


def test_layers_cut_nemotron_h_pattern_and_runs_name_their_format():
    cut = shape_with_layers(NEMOTRON_3_NANO_30B_A3B, 13)
    assert cut["num_hidden_layers"] == 13 and cut["hybrid_override_pattern"] == "MEMEM*EMEMEM*"
    assert shape_with_layers(NEMOTRON_3_NANO_30B_A3B, None) == NEMOTRON_3_NANO_30B_A3B
    assert parse_runs("1:float32,2:bfloat16") == [(1, "float32"), (2, "bfloat16")]
    with pytest.raises(SystemExit, match="--runs takes TP:DTYPE"):
        parse_runs("2:fp32")
    with pytest.raises(SystemExit, match="--layers 60"):
        shape_with_layers(NEMOTRON_3_NANO_30B_A3B, 60)
