"""benchmarks/chain_variants.py's command line (BENCHMARKS.md has the GPU runs): variants as names with the
environment each sets, and an error naming the flag for anything else."""

from __future__ import annotations

import pytest

from benchmarks.chain_variants import parse_variants


def test_variants_are_names_with_the_variables_each_sets():
    assert parse_variants("off:SHARDSERVE_NEXT_EARLY=off,on:SHARDSERVE_NEXT_EARLY=on;SHARDSERVE_PDL=on,base") == [
        ("off", {"SHARDSERVE_NEXT_EARLY": "off"}),
        ("on", {"SHARDSERVE_NEXT_EARLY": "on", "SHARDSERVE_PDL": "on"}),
        ("base", {}),
    ]


@pytest.mark.parametrize("text, named", [
    ("on:SHARDSERVE_NEXT_EARLY", "'SHARDSERVE_NEXT_EARLY' in 'on:SHARDSERVE_NEXT_EARLY' is not VAR=VALUE"),
    ("on:=1", "'=1' in 'on:=1' is not VAR=VALUE"),
    ("a,a:X=1", "distinct names"),
    ("", "distinct names"),
])
def test_a_malformed_variant_names_the_flag(text, named):
    with pytest.raises(SystemExit, match="--variants") as caught:
        parse_variants(text)
    assert named in str(caught.value)
